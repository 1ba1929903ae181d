"""The projection rule (eagle3_build/models/linear.py): decode-sized float32 inputs are traced
weight-stationary, prefill-sized ones and other dtypes as F.linear, and both compute x @ W.T (+ b)."""
import pytest
import torch
import torch.nn.functional as F

from eagle3_build.models.linear import SMALL_ROWS, Linear, linear


@pytest.mark.parametrize("shape", [(1, 1, 24), (2, 4, 24), (1, SMALL_ROWS, 24), (3, 40, 24), (24,)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(shape, bias):
    torch.manual_seed(0)
    x, w = torch.randn(shape), torch.randn(40, 24)
    b = torch.randn(40) if bias else None
    y = linear(x, w, b)
    assert y.shape == (*shape[:-1], 40) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def _mm_ops(rows: int, dtype: torch.dtype = torch.float32) -> list[tuple[str, str]]:
    """(op, first argument) of every matmul in the exported graph of a Linear over `rows` token rows."""
    mod = Linear(24, 40, bias=False, dtype=dtype)
    ep = torch.export.export(mod, (torch.randn(1, rows, 24, dtype=dtype),))
    return [(str(n.target), str(n.args[0])) for n in ep.graph.nodes
            if n.op == "call_function" and n.target in (torch.ops.aten.mm.default, torch.ops.aten.linear.default)]


def test_decode_sized_inputs_trace_weight_stationary():
    # the weight is GEMM operand A: torch.mm(weight, x.T)
    ops = _mm_ops(SMALL_ROWS)
    assert ops and all(op == "aten.mm.default" and arg.startswith("p_weight") for op, arg in ops), ops
    # prefill-sized: plain F.linear, the weight as operand B
    assert _mm_ops(SMALL_ROWS + 1) == [("aten.linear.default", "x")]


@pytest.mark.parametrize("rows", [1, 4, SMALL_ROWS])
def test_bf16_keeps_f_linear(rows):
    # oneDNN's bf16 GEMM: F.linear is faster than weight-stationary at every row count (docs/linear-layout.md)
    assert _mm_ops(rows, torch.bfloat16) == [("aten.linear.default", "x")]


def test_single_row_traces_a_two_column_gemm():
    # MKL's matrix-vector path reads the weights at about half the speed of a 2-column GEMM
    mod = Linear(24, 40, bias=False)
    ep = torch.export.export(mod, (torch.randn(1, 1, 24),))
    mms = [n for n in ep.graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.mm.default]
    assert len(mms) == 1 and tuple(mms[0].args[1].meta["val"].shape) == (24, 2)
    x = torch.randn(1, 1, 24)
    torch.testing.assert_close(ep.module()(x), F.linear(x, mod.weight), rtol=1e-5, atol=1e-5)
