"""The projection rule (eagle3_build/models/linear.py): decode-sized float32 inputs are traced
weight-stationary, prefill-sized ones and other dtypes as F.linear, and both compute x @ W.T (+ b)."""
import re
from unittest import mock

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


@pytest.mark.parametrize("fmt, no_pack", [("mkl_sgemm", False), ("onednn", False), ("onednn", True),
                                           ("onednn_bf16", False), ("onednn_bf16", True), ("blocked", False),
                                           ("blocked_bf16", False)])
def test_packed_forms_compute_the_projection(fmt, no_pack, monkeypatch):
    """Every packed form computes x @ W.T (+ b) in x's dtype: the exact ones to float32 rounding, the draft's
    bfloat16 ones to bfloat16's (x and W rounded; float32 accumulation); without packing (NO_PACK) oneDNN's
    forms take the plain weight (in bfloat16 for the bf16 form) and give the same result."""
    from eagle3_runtime.packing import NO_PACK, pack_available, pack_weight, packed_linear

    if not pack_available(fmt):
        pytest.skip(f"{fmt} is not made by this torch")
    monkeypatch.setenv(NO_PACK, "1" if no_pack else "0")
    torch.manual_seed(0)
    x, w, b = torch.randn(4, 64), torch.randn(96, 64), torch.randn(96)
    p = pack_weight(w, 4, fmt, 32 if fmt.startswith("blocked") else None)
    assert p.dtype == (torch.bfloat16 if fmt.endswith("bf16") else torch.float32)
    y = packed_linear(x, p, w, b, fmt)
    assert y.dtype == torch.float32 and y.shape == (4, 96)
    if fmt.endswith("bf16"):
        want = F.linear(x.bfloat16().float(), w.bfloat16().float(), b.bfloat16().float())
        torch.testing.assert_close(y, want, rtol=2e-2, atol=5e-2)
        assert (y - F.linear(x, w, b)).abs().max() > 1e-4  # (really computed in bfloat16)
    else:
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_projections_of_one_input_share_one_fused_copy():
    """`project` of several layers (q/k/v, gate/up): the Recorder notes the group as one entry by weight name;
    PackedLinears given one oneDNN copy of the concatenated weights computes every projection in one GEMM, equal
    to each one's F.linear; with no copy for the group each takes its own path; with a bias each is on its own."""
    from torch import nn

    from eagle3_build.backends.cpu.packed import Copy, PackedLinears, Recorder
    from eagle3_build.models.linear import project, using
    from eagle3_runtime.packing import pack_available, pack_weight

    torch.manual_seed(0)
    layers = nn.ModuleList(Linear(24, n, bias=False) for n in (40, 8, 8))
    names = ("0.weight", "1.weight", "2.weight")  # (their names in the module `using` is given)
    for layer in layers:
        torch.nn.init.normal_(layer.weight)
    x = torch.randn(1, 4, 24)
    want = [F.linear(x, layer.weight) for layer in layers]

    def run(method, copies=()):
        with using(layers, method), method.bind(tuple(copies)):
            return project(x, *layers)

    with torch.no_grad():
        for g, w in zip(project(x, *layers), want):  # no method given: each layer
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        rec = Recorder()
        run(rec)
        assert rec.seen == {(names, 4)}
        if pack_available("onednn"):
            copy = pack_weight(torch.cat([layer.weight for layer in layers]), 4, "onednn")
            got = run(PackedLinears([Copy(names, 4, "onednn")], 1), [copy])
            assert [g.shape for g in got] == [(1, 4, 40), (1, 4, 8), (1, 4, 8)]
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4)
            for g, w in zip(run(PackedLinears([], 1)), want):  # no copy for the group: each weight-stationary
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
            with pytest.raises(ValueError, match="1 packed copies expected"):
                run(PackedLinears([Copy(names, 4, "onednn")], 1))
        copy = pack_weight(torch.cat([layer.weight for layer in layers]), 4, "blocked", 16)  # (56 columns: padded)
        for g, w in zip(run(PackedLinears([Copy(names, 4, "blocked")], 2), [copy]), want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4)
        layers = nn.ModuleList([Linear(24, 8, bias=True), Linear(24, 8, bias=True)])
        rec = Recorder()
        run(rec)
        assert sorted(rec.seen) == [(("0.weight",), 4), (("1.weight",), 4)]  # (with a bias: each on its own)


def test_one_onednn_copy_serves_every_row_count():
    """The runtime makes one oneDNN copy per weight (or fused group) for every row count, one blocked copy per
    block_n, MKL's one per row count."""
    from eagle3_runtime.manifest import PackedWeight
    from eagle3_runtime.packing import copy_key

    def key(weights, rows, fmt, block_n=None):
        return copy_key(PackedWeight(weight=weights[0], fused=list(weights[1:]), rows=rows, format=fmt, block_n=block_n))

    assert key(("t/q", "t/k"), 4, "onednn") == key(("t/q", "t/k"), 64, "onednn")
    assert key(("d/fc",), 1, "onednn_bf16") == key(("d/fc",), 5, "onednn_bf16")
    assert key(("t/q",), 4, "onednn") != key(("t/q", "t/k"), 4, "onednn")
    assert key(("t/q",), 4, "mkl_sgemm") != key(("t/q",), 5, "mkl_sgemm")
    assert key(("t/q", "t/k"), 1, "blocked", 48) == key(("t/q", "t/k"), 4, "blocked", 48)
    assert key(("t/q",), 1, "blocked", 48) != key(("t/q",), 1, "blocked", 32)
    assert key(("d/fc",), 1, "blocked_bf16", 8) == key(("d/fc",), 5, "blocked_bf16", 8)
    assert key(("d/fc",), 1, "blocked_bf16", 8) != key(("d/fc",), 1, "blocked", 8)
    for fmt, block_n in (("blocked", None), ("onednn", 48)):  # block_n goes with the blocked format only
        with pytest.raises(ValueError, match="block_n goes with the blocked format"):
            PackedWeight(weight="t/q", rows=1, format=fmt, block_n=block_n)


def test_blocked_layout_is_inductors():
    """packing.block lays W.T out in [ceil(N / bn), K, bn] blocks, the last zero-padded; eagle3::blocked_linear
    run as is computes x @ W.T from it; compiled (aoti's lowering) it is Inductor's CPU GEMM template over the copy
    as given, to float32 rounding, its micro-kernel the register blocking of the copy's block_n (Inductor's choice or
    another of the ISA's; a block_n none has is refused). The
    micro-kernel as edited (inductor_internals.tuned_kernel) computes what Inductor's as shipped does, bit for bit."""
    from torch._inductor.utils import run_and_get_code

    from eagle3_build.backends.cpu import inductor_internals as inductor
    from eagle3_runtime.packing import block, blocked_linear

    if not inductor.blocked_available():
        pytest.skip("Inductor has no vectorised float32 micro-kernel here")
    torch.manual_seed(0)
    w, x = torch.randn(100, 64), torch.randn(4, 64)
    b = block(w, 32)
    assert b.shape == (4, 64, 32) and torch.equal(b[1, :, 5], w[37]) and not b[3, :, 4:].any()
    torch.testing.assert_close(blocked_linear(x, b, 100, 2), F.linear(x, w), rtol=1e-5, atol=1e-5)
    bn = inductor.block_n(4, 96, 64, 2)
    w = torch.randn(96, 64)
    fn = torch.compile(lambda x, c: blocked_linear(x, c, 96, 2), dynamic=False, fullgraph=True)
    with inductor.packed_input_lowering(), torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        y, code = run_and_get_code(fn, x, block(w, bn))
        torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-4)
        # the micro-kernel prefetches its weight (this torch's kernel is the one the lowering edits); on x86 its
        # accumulators are raw registers, the same FMAs in the same order: the shipped kernel's result bit for bit
        code = "".join(code)
        assert f"B + (k + {inductor.AHEAD}) * ldb" in code and "prefetch" in inductor.kernel_tag()
        assert "vfma(va, vb[col]" in code and "register" in inductor.kernel_tag()
        # a copy of another block_n of this ISA's: that register blocking's micro-kernel; a block_n none has: refused
        other = next(b for b in inductor.register_blockings() if b[1] != bn)
        torch._dynamo.reset()
        y, code = run_and_get_code(torch.compile(lambda x, c: blocked_linear(x, c, 96, 2), dynamic=False), x,
                                   block(w, other[1]))
        torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-4)
        assert f"Mr = {other[0]};" in "".join(code) and f"Nr = {other[1]};" in "".join(code)
        assert f"Nr = {bn};" not in "".join(code)
        missing = next(n for n in (8, 16, 24, 32, 48) if n not in {b[1] for b in inductor.register_blockings()})
        with pytest.raises(Exception, match=f"blocked weight copy of block_n {missing}: no float32 micro-kernel"):
            torch.compile(lambda x, c: blocked_linear(x, c, 96, 2), dynamic=False)(x, block(w, missing))
    simd = {"AVX512": [512, 256], "AVX2": [256]}.get(torch.backends.cpu.get_cpu_capability(), [])
    compile_ = lambda x, c: torch.compile(lambda x, c: blocked_linear(x, c, 96, 2), dynamic=False)(x, c)  # noqa: E731
    for width in simd:  # (x86: the AVX-512 and AVX2 kernels, as edited and as shipped)
        for rows in (3, 8):
            with torch._inductor.config.patch({"cpp.simdlen": width, "fx_graph_cache": False}), torch.no_grad():
                inductor._micro_gemm.cache_clear()
                x, bn = torch.randn(rows, 64), inductor.block_n(rows, 96, 64, 2)
                runs = {}
                for kernel in (inductor.tuned_kernel, lambda: None):
                    torch._dynamo.reset()
                    with mock.patch.object(inductor, "tuned_kernel", kernel), inductor.packed_input_lowering():
                        runs[kernel()], code = run_and_get_code(compile_, x, block(w, bn))
                    assert ("vfma(va, vb[col]" in "".join(code)) == (kernel() is not None)
                assert torch.equal(*runs.values()), (width, rows)
    inductor._micro_gemm.cache_clear()


def test_blocked_bf16_takes_inductors_bfloat16_kernel():
    """blocked_bf16 (a draft's projections): the blocked layout in bfloat16; run as is, x rounded to bfloat16 times
    the copy, in x's dtype; compiled, Inductor's bfloat16 micro-kernel over the copy (products of the rounded
    operands summed in float32, so within bfloat16's rounding of that), on x86 on raw registers with the weight
    prefetched: Inductor's shipped kernel's result bit for bit, at one row and at a full register block."""
    from torch._inductor.utils import run_and_get_code

    from eagle3_build.backends.cpu import inductor_internals as inductor
    from eagle3_runtime.manifest import BLOCKED_BF16, PackedWeight
    from eagle3_runtime.packing import pack_weight, packed_linear

    if not inductor.blocked_available(torch.bfloat16):
        pytest.skip("Inductor has no vectorised bfloat16 micro-kernel here")
    torch.manual_seed(0)
    w = torch.randn(96, 64)
    for rows in (1, 8):
        x = torch.randn(rows, 64)
        bn = inductor.block_n(rows, 96, 64, 2, dtype=torch.bfloat16)
        c = pack_weight(w, rows, BLOCKED_BF16, bn)
        assert c.dtype == torch.bfloat16 and torch.equal(c[0, :, 1], w[1].to(torch.bfloat16))
        want = (x.to(torch.bfloat16).float() @ w.to(torch.bfloat16).float().T)
        ref = packed_linear(x, c, w, None, BLOCKED_BF16)
        assert ref.dtype == torch.float32
        torch.testing.assert_close(ref, want, rtol=1e-2, atol=1e-2)
        runs = {}
        for kernel in (inductor.tuned_kernel, lambda: None):
            torch._dynamo.reset()
            fn = torch.compile(lambda x, c: packed_linear(x, c, None, None, BLOCKED_BF16, n=96, threads=2),
                               dynamic=False, fullgraph=True)
            with mock.patch.object(inductor, "tuned_kernel", kernel), inductor.packed_input_lowering(), \
                    torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
                runs[kernel()], code = run_and_get_code(fn, x, c)
            code = "".join(code)
            assert ("vloadb(B + k * ldb" in code) == (kernel() is not None and inductor.tuned_kernel() is not None
                                                      and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))
            assert "bfloat16" in code and runs[kernel()].dtype == torch.float32
            torch.testing.assert_close(runs[kernel()], want, rtol=1e-5, atol=1e-4)
        assert torch.equal(*runs.values()), rows
    with pytest.raises(ValueError, match="block_n goes with the blocked formats"):
        PackedWeight(weight="d/fc", rows=1, format=BLOCKED_BF16)


def test_each_template_source_is_parsed_once():
    """Inside packed_input_lowering Inductor's jinja parse is memoised per template source (one Template object
    per text), the code it generates is the code Inductor's own parse gives, and leaving restores Inductor's."""
    from torch._inductor.codegen.common import KernelTemplate
    from torch._inductor.utils import run_and_get_code

    from eagle3_build.backends.cpu import inductor_internals as inductor
    from eagle3_runtime.packing import block, blocked_linear

    if not inductor.blocked_available():
        pytest.skip("Inductor has no vectorised float32 micro-kernel here")
    shipped = KernelTemplate.__dict__["_template_from_string"]
    torch.manual_seed(0)
    w, x = torch.randn(96, 64), torch.randn(4, 64)
    c = block(w, inductor.block_n(4, 96, 64, 2))
    codes, memoised = [], inductor._parsed_once
    for parse_once in (memoised, lambda parse: parse):
        torch._dynamo.reset()
        with mock.patch.object(inductor, "_parsed_once", parse_once), inductor.packed_input_lowering(), \
                torch._inductor.config.patch(fx_graph_cache=False), torch.no_grad():
            t = KernelTemplate._template_from_string("x{{ y }}")
            assert (t is KernelTemplate._template_from_string("x{{ y }}")) == (parse_once is memoised)
            assert t.render(y=1) == "x1"
            fn = torch.compile(lambda x, c: blocked_linear(x, c, 96, 2), dynamic=False)
            y, code = run_and_get_code(fn, x, c)
        torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-4)
        codes.append([line for line in "".join(code).splitlines() if not line.startswith("# AOT ID")])  # (a counter)
    assert codes[0] == codes[1]
    assert KernelTemplate.__dict__["_template_from_string"] is shipped
    assert KernelTemplate._template_from_string("x") is not KernelTemplate._template_from_string("x")


def test_a_micro_kernel_the_edits_do_not_know_compiles_as_shipped(monkeypatch):
    """On a torch whose float32 micro-kernel is not the one the edit was written against, the template is
    compiled as Inductor ships it, and the graphs' cache keys say so."""
    import torch._inductor.lowering  # noqa: F401  (Inductor's codegen modules import in this order)
    from torch._inductor.codegen.cpp_micro_gemm import CppMicroGemmFP32Vec

    from eagle3_build.backends.cpu import inductor_internals as inductor

    if not inductor.blocked_available():
        pytest.skip("Inductor has no vectorised float32 micro-kernel here")
    from eagle3_runtime.torch_internals import TorchInternalsWarning

    monkeypatch.setattr(CppMicroGemmFP32Vec, "TEMPLATE_KERNEL", "// another kernel")
    inductor.tuned_kernel.cache_clear()
    inductor.HOOKS.forget()
    try:
        with pytest.warns(TorchInternalsWarning, match="builder hook 'micro_kernel_edit' off: its probe failed on "
                                                       f"torch {re.escape(torch.__version__)}"):
            assert inductor.tuned_kernel() is None
        assert inductor.kernel_tag() == "inductor fp32 micro-kernel"
        assert inductor.report()["hooks"]["micro_kernel_edit"].startswith("off: its probe failed")
        with inductor.packed_input_lowering():
            assert CppMicroGemmFP32Vec.TEMPLATE_KERNEL == "// another kernel"
    finally:
        inductor.tuned_kernel.cache_clear()
        inductor.HOOKS.forget()
