"""Projections in decode-sized graphs are traced as row dot-products when the backend asks for it
(eagle3_build/models/linear.py): same values as F.linear, no matmul op left in those graphs, prefill
layers untouched, and each row's result independent of how many rows share the call."""
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from test_kv_write import B, K, S, _models

from eagle3_build.backends.aoti import AotiBackend
from eagle3_build.errors import UserError
from eagle3_build.graphs import GraphSpec, build_graph_module, step_inputs
from eagle3_build.models.linear import Linear, linear, small_matmul_rows

# projection ops (attention's score/value products and GPT-OSS's expert einsums are not projections)
MATMULS = ("aten.linear.default", "aten.mm.default", "aten.addmm.default")


@pytest.mark.parametrize("shape", [(1, 24), (4, 24), (2, 5, 24)])
@pytest.mark.parametrize("bias", [False, True])
def test_row_dot_form_matches_f_linear(shape, bias):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(*shape, generator=g), torch.randn(40, 24, generator=g)
    b = torch.randn(40, generator=g) if bias else None
    with small_matmul_rows(16):
        y = linear(x, w, b)
    assert y.shape == (*shape[:-1], 40)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    with small_matmul_rows(4):  # above the limit (or with the rule off): exactly F.linear
        assert torch.equal(linear(torch.ones(2, 3, 24), w, b), F.linear(torch.ones(2, 3, 24), w, b))
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))


def test_row_results_do_not_depend_on_the_row_count():
    """What makes a verify graph's logits for a row equal the decode graph's: the same reduction per row."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(8, 576, generator=g), torch.randn(300, 576, generator=g)
    with small_matmul_rows(16):
        together = linear(x, w)
        alone = torch.cat([linear(x[i:i + 1], w) for i in range(8)])
    assert torch.equal(together, alone)


def _ops(model, role: str, bucket: int, rows: int) -> Counter:
    module, names = build_graph_module(GraphSpec(role, bucket), model)
    local = dict(model.named_parameters()) | dict(model.named_buffers())
    weights = tuple(torch.empty(local[n].shape, dtype=local[n].dtype) for n in names)
    ins = step_inputs(GraphSpec(role, bucket), K=K, target_hidden=32, draft_hidden=32, dtype=torch.float32)
    args = (weights, torch.zeros(model.kv_shape(B, S)), *(torch.zeros(s, dtype=d) for _, s, d in ins))
    with small_matmul_rows(rows):
        ep = torch.export.export(module, args, strict=False)
    return Counter(str(n.target) for n in ep.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("model_name,role", [("llama", "target_decode"), ("llama", "target_verify"),
                                             ("gpt_oss", "target_verify"), ("draft", "draft_step"),
                                             ("draft", "draft_catchup")])
def test_decode_sized_graphs_have_no_matmul(model_name, role):
    model = _models()[model_name]
    before = _ops(model, role, B, 0)
    assert before["aten.linear.default"] > 0
    ops = _ops(model, role, B, 16)
    assert not {op: c for op, c in ops.items() if op in MATMULS}, ops
    if model_name == "llama":
        # one row-dot reduction per projection: 7 per layer + the lm_head
        assert ops["aten.sum.dim_IntList"] == before["aten.linear.default"] == 7 * 3 + 1


def test_prefill_keeps_matmul_for_its_layers():
    """A 16-token prefill (16 rows, limit 8) keeps F.linear in its layers; its last-position lm_head
    (one row) takes the row-dot form."""
    ops = _ops(_models()["llama"], "target_prefill", 16, 8)
    assert ops["aten.linear.default"] == 7 * 3 and ops["aten.sum.dim_IntList"] == 1


def test_aoti_backend_choice_and_option():
    assert AotiBackend({}).small_matmul_rows("float32") == 0  # experimental: opt-in only
    assert AotiBackend({"small_matmul_rows": 16}).small_matmul_rows("float32") == 16
    assert AotiBackend({"small_matmul_rows": 32}).small_matmul_rows("bfloat16") == 32
    for bad in (-1, "16", True, 2.5):
        with pytest.raises(UserError, match="small_matmul_rows"):
            AotiBackend({"small_matmul_rows": bad})


def test_linear_module_keeps_nn_linear_parameters():
    m = Linear(8, 4, bias=True)
    assert isinstance(m, torch.nn.Linear) and sorted(n for n, _ in m.named_parameters()) == ["bias", "weight"]
