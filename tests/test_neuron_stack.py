"""The two numeric references of the neuron-path tests that use transformers-5-only helper APIs, rerun on
transformers 4.x (the Neuron SDK's 4.57; `make test-neuron-stack`). On transformers 5 the originals run
as they are, so these skip there.

* tests/test_graphs_numeric.py::test_target_prefill_and_verify_match_transformers builds its reference
  with `LlamaConfig(rope_parameters=...)`, which 4.x ignores (it keeps the default rope, theta 10000):
  rerun with the config built in the installed transformers' form (`Rope.config_kwargs`).
* tests/test_neuron_spmd.py::test_spmd_bundle_decodes_like_transformers[2-gpt-oss] calls
  `set_experts_implementation("eager")`, absent in 4.x, whose GPT-OSS experts always take the eager
  per-expert loop on CPU: rerun with that call a no-op.
"""
import pytest
import transformers

import test_graphs_numeric
import test_neuron_spmd
from neuron_standin import standin_sdk  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(int(transformers.__version__.split(".")[0]) >= 5,
                                reason="transformers 5: the original tests run as they are")


def test_target_matches_transformers_4x(monkeypatch, tmp_path):
    import sys

    from eagle3_build.models.llama import Rope

    # transformers 4.57 can replace its lazy module in sys.modules (making a tiny pair does): patch the current one
    hf = sys.modules["transformers"]
    real, built = hf.LlamaConfig, []

    def llama_config(**kw):
        if "rope_parameters" not in kw:  # e.g. rope_inv_freq's own, already in the installed form
            return real(**kw)
        rope = kw.pop("rope_parameters")
        cfg = real(**kw, **Rope.config_kwargs(rope))
        cfg.rope_parameters = dict(rope)  # what the test hands to LlamaArgs
        built.append(cfg)
        return cfg

    monkeypatch.setattr(hf, "LlamaConfig", llama_config)
    test_graphs_numeric.test_target_prefill_and_verify_match_transformers(tmp_path)
    assert len(built) == 1 and built[0].rope_scaling["rope_type"] == "llama3"


def test_gpt_oss_spmd_bundle_decodes_like_transformers_4x(monkeypatch, standin_sdk, tmp_path):  # noqa: F811
    from transformers import GptOssForCausalLM

    assert not hasattr(GptOssForCausalLM, "set_experts_implementation")
    monkeypatch.setattr(GptOssForCausalLM, "set_experts_implementation", lambda self, impl: None, raising=False)
    test_neuron_spmd.test_spmd_bundle_decodes_like_transformers(standin_sdk, tmp_path, 2, "gpt-oss")
