"""The KV cache is written by one index_put on the cache input per (layer, k|v) — never through a view.

Writing `kv[layer, 0, rows, :, positions]` with Python ints goes through select() views; functionalized
by torch.export that becomes select_scatter, which Inductor/AOTI materialise as a full copy of the whole
cache per layer (measured on SmolLM2: 2.3 s per decode step instead of 24 ms). This checks the exported
graph of every role, for the Llama and GPT-OSS targets and the EAGLE3 draft, so the slow form cannot
come back unnoticed.
"""
from collections import Counter

import pytest
import torch

from eagle3_build.graphs import GraphSpec, build_graph_module, step_inputs
from eagle3_build.models.eagle3 import Eagle3Args, Eagle3Draft
from eagle3_build.models.gpt_oss import GptOss, GptOssArgs
from eagle3_build.models.llama import Llama, LlamaArgs
from eagle3_build.models.weights import weight_tensors
from eagle3_runtime.speculation import dynamic_tree

B, S = 2, 64
SHAPE = dynamic_tree(3, 2, 6)  # a tree: every tree input (masks, slots, positions) is exercised
LLAMA = LlamaArgs(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  rope={"rope_type": "default", "rope_theta": 10000.0})
GPT_OSS = GptOssArgs(vocab_size=128, hidden_size=32, intermediate_size=32, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, tie_word_embeddings=False, num_experts=4,
                     experts_per_token=2, sliding_window=8, layer_types=("sliding_attention", "full_attention"),
                     rope={"rope_type": "default", "rope_theta": 10000.0})
DRAFT = Eagle3Args(hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5,
                   vocab_size=128, draft_vocab_size=64, target_hidden_size=32, aux_layer_ids=(0, 1, 2),
                   norm_before_residual=True)


def _models():
    with torch.device("meta"):
        return {"llama": Llama(LLAMA, (0, 1, 2)), "gpt_oss": GptOss(GPT_OSS, (0, 1, 1)), "draft": Eagle3Draft(DRAFT)}


def _example(model, spec: GraphSpec):
    module, names = build_graph_module(spec, model)
    local = weight_tensors(model)
    weights = tuple(torch.empty(local[n].shape, dtype=local[n].dtype) for n in names)
    kv = torch.zeros(model.kv_shape(B, S))
    ins = step_inputs(spec, target_hidden=32, draft_hidden=32, dtype=torch.float32)
    example = tuple(torch.zeros(shape, dtype=dt) for _, shape, dt in ins)
    return module, (weights, kv, *example)


def _export(model, spec: GraphSpec):
    module, args = _example(model, spec)
    # functionalized, as every backend lowers it (index_put_ -> index_put + the cache as mutated output)
    return torch.export.export(module, args, strict=False).run_decompositions({})


CASES = [(m, r) for m in ("llama", "gpt_oss") for r in ("target_prefill", "target_verify", "target_decode")]
CASES += [("draft", r) for r in ("draft_prefill", "draft_catchup", "draft_step")]


@pytest.mark.parametrize("model_name,role", CASES)
def test_kv_cache_written_by_index_put_on_the_cache_itself(model_name, role):
    model = _models()[model_name]
    ep = _export(model, GraphSpec(role, 16 if role.endswith("prefill") else B, SHAPE))
    ops = Counter(str(n.target) for n in ep.graph.nodes if n.op == "call_function")
    scatters = {op: c for op, c in ops.items() if "_scatter" in op}  # select/slice/as_strided_scatter
    assert not scatters, f"KV written through a view (full-cache copy per layer): {scatters}"
    layers = model.kv_shape(B, S)[0]
    assert ops["aten.index_put.default"] == 2 * layers, ops
    # each index_put's destination is the running cache itself (the input or the previous write), and
    # the last write is what flows back into the cache
    mutated = ep.graph_signature.user_inputs_to_mutate
    assert len(mutated) == 1, mutated  # the cache is the only mutated input
    (out_name, in_name), = mutated.items()
    cur = in_name
    for n in ep.graph.nodes:
        if n.op == "call_function" and str(n.target) == "aten.index_put.default":
            assert n.args[0].name == cur, f"index_put writes {n.args[0].name}, not the cache {cur}"
            cur = n.name
    assert cur == out_name


@pytest.mark.parametrize("model_name,role", CASES)
def test_role_modules_follow_the_contract_table(model_name, role):
    """Each role module takes the inputs graph_contract.ROLES names (the runtime passes them by name) and
    returns the outputs it lists, shapes and dtypes."""
    import inspect

    from eagle3_build.backends.base import output_specs
    from eagle3_build.graphs import ROLE_MODULES
    from eagle3_runtime.graph_contract import ROLES
    from eagle3_runtime.manifest import dtype_name

    contract = ROLES[role]
    assert set(ROLE_MODULES) == set(ROLES)
    params = list(inspect.signature(ROLE_MODULES[role].forward).parameters)[3:]  # after self, cache, rank
    assert params == [p.name for p in contract.inputs]
    spec = GraphSpec(role, 16 if role.endswith("prefill") else B, SHAPE)
    module, args = _example(_models()[model_name], spec)
    outs = [[shape, dtype_name(dt)] for shape, dt in output_specs(module, args)]
    want = contract.output_specs(spec.bucket, SHAPE, target_hidden=32, draft_hidden=32, vocab=128, dtype="float32")
    assert outs == [[shape, dt] for _, shape, dt in want]
