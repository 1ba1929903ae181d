"""Greedy tree speculation is lossless against transformers on 20 prompts, for a dynamic and a static
tree, at TP 1 (`verify`, the builder's own check) and TP 2 (the runtime under torchrun, every graph call
and KV move announced to the second rank)."""
import json
from pathlib import Path

import pytest
import torch

from test_tp import torchrun
from test_tree_engine import DYNAMIC, MIXED, STATIC

HERE = Path(__file__).resolve().parent
N_PROMPTS, MAX_TOKENS = 20, 24


@pytest.mark.parametrize("which", ["dynamic", "static"])
def test_verify_tree_bundle_tp1(tiny, which):
    from eagle3_build.verify.run import verify_bundle

    built = tiny.bundle(recipe=DYNAMIC if which == "dynamic" else STATIC)
    report = verify_bundle(built.path, num_prompts=N_PROMPTS, max_tokens=MAX_TOKENS)
    assert report.passed and len(report.prompts) == N_PROMPTS, report
    assert all(r.exact for r in report.prompts)
    assert report.acceptance.num_drafts > 0 and report.acceptance.mean_acceptance_length > 1.0


@pytest.fixture(scope="module")
def prompts_and_reference(tiny):
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(20)
    prompts = [[0] + torch.randint(1, 512, (int(n),), generator=g).tolist()
               for n in torch.randint(4, 40, (N_PROMPTS,), generator=g)]
    hf = AutoModelForCausalLM.from_pretrained(tiny.pair().parent / "target", dtype=torch.float32)
    ref = [hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=0)[0, len(p):]
           .tolist() for p in prompts]
    return prompts, ref


@pytest.mark.parametrize("which", ["mixed", pytest.param("static", marks=pytest.mark.slow)])
def test_tree_bundle_tp2_equals_transformers(tiny, tmp_path, prompts_and_reference, which):
    """`mixed`: the dynamic tree at batch 1 (prompts run one at a time), a chain at batch 2; the same
    TP-2 bundle test_server.py serves under torchrun."""
    prompts, ref = prompts_and_reference
    built = tiny.bundle(tp=2, recipe=MIXED if which == "mixed" else STATIC)
    assert built.manifest["tp_degree"] == 2
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    r = torchrun(2, str(HERE / "tp_generate.py"), str(built.path), str(tmp_path / "prompts.json"),
                 str(tmp_path / "out.json"), str(MAX_TOKENS))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads((tmp_path / "out.json").read_text())
    for i, (g, want) in enumerate(zip(got, ref)):
        # transformers stops at EOS as the runtime does
        assert g["token_ids"] == want, f"prompt {i}"
    assert max(g["acceptance_length"] for g in got) > 1.0


def test_gpt_oss_twin_with_a_tree_tp1(tiny):
    """The GPT-OSS twin (sliding-window + full attention with sinks, MoE, YaRN) with a dynamic tree:
    verify's 20 prompts token for token against transformers' GptOssForCausalLM."""
    from eagle3_build.verify.run import verify_bundle

    built = tiny.bundle(arch="gpt-oss", recipe=DYNAMIC)
    assert built.manifest["models"]["target"]["architecture"] == "gpt_oss"
    report = verify_bundle(built.path, num_prompts=N_PROMPTS, max_tokens=16)
    assert report.passed and all(r.exact for r in report.prompts), report.format()
    assert report.acceptance.num_drafts > 0
