"""Inductor lowerings of the GEMMs whose weight was packed at load (eagle3_runtime.packing), as graph inputs.

Inductor lowers MKL's and oneDNN's packed GEMMs only for a packed weight that is a graph constant (its freezing
pass makes one); bundle weights and their packed copies are graph inputs, so `packed_input_lowering` lowers
them itself.

The blocked format is Inductor's own CPU GEMM template: a GEMM generated for the CPU it compiles on (a
register-blocked micro-kernel for its vector ISA, threads partitioned over output blocks), which Inductor too offers
only for a constant weight, re-laid out at compile time. Here the runtime makes that layout at load
(`packing.block`), the graph calls `eagle3::blocked_linear` on it, and that call is lowered to the template with the
copy as its weight operand, its micro-kernel the register blocking of the copy's block_n (Inductor's float32
blockings for an ISA differ in block_n): Inductor's own choice for the GEMM's shape (`block_n` asks it the same
question before tracing), or another the build measured faster at that row count (`one_pass_blocking`); the lowering
refuses a block_n no blocking of this ISA has. Inductor's float32 micro-kernel issues no software prefetch (it has
one for int8 weights only); at 4-8 rows its FMAs then keep the core's loads from running far enough ahead to stream
the weight, so the template compiled here prefetches each weight block PREFETCH_BYTES ahead; and since GCC keeps
the kernel's array of Vectorized accumulators on the stack (a store per FMA), on x86 it runs the same FMAs on raw
vector registers (`tuned_kernel`). A bfloat16 copy (blocked_bf16, the draft's) takes Inductor's bfloat16 vector
micro-kernel (x rounded to bfloat16, both operands widened to float32 as they load, products summed in float32),
edited the same way.

Two edits only make compiling cheaper, the code generated for the kernels unchanged: each template source is
parsed once (`_parsed_once`), and AOTI's per-input debugging checks are not written (`lean_wrapper`).
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

from eagle3_runtime import packing  # noqa: F401  (registers eagle3::blocked_linear)

DTYPE = torch.float32
# how far ahead of its loads the micro-kernel prefetches the weight: bytes, whatever the block_n (a k step is block_n
# floats: 16 steps at AVX-512's 48, 96 at AVX2's 8). docs/linear-layout.md: on a Xeon at block_n 48, 3 KB best; on a
# Zen 3 at block_n 8, 1.5-3.75 KB alike and 512 B (16 steps) 14% slower at 8 rows
PREFETCH_BYTES = 3072
AHEAD = f"({PREFETCH_BYTES} / (BLOCK_N * 4))"  # (k steps, in the kernel's C++: BLOCK_N is its template parameter)
AHEAD_BF16 = f"({PREFETCH_BYTES} / (BLOCK_N * 2))"
_WEIGHT_LOAD = ("            vb[col] = Vectorized::loadu(B + k * ldb + col * VLEN);\n"
                "        {%- endif %}\n    {%- endif %}")  # (the float32 weight's load, full block_n)
_VECTORIZED = "    using Vectorized = at::vec::Vectorized<{{compute_t}}>;\n"  # (the kernel body's first line)
# A float32 kernel on x86 (AVX-512, AVX2) holds its accumulators in raw vector registers: GCC keeps Inductor's
# array of Vectorized on the stack, a store per FMA (docs/linear-layout.md). The same FMAs in the same order.
_REGISTERS = """{%- if not trans_b and not tail_n and alpha == 1 and input_dtype == torch.float32
      and input2_dtype == torch.float32 and output_dtype == torch.float32 and compute_dtype == torch.float32 %}
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    {  // the same FMAs in the same order, on raw vector registers
#if defined(CPU_CAPABILITY_AVX512)
        using R = __m512;
        auto vload = [](const float* p) { return _mm512_loadu_ps(p); };
        auto vstore = [](float* p, R v) { _mm512_storeu_ps(p, v); };
        auto vset1 = [](float x) { return _mm512_set1_ps(x); };
        auto vfma = [](R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); };
#else
        using R = __m256;
        auto vload = [](const float* p) { return _mm256_loadu_ps(p); };
        auto vstore = [](float* p, R v) { _mm256_storeu_ps(p, v); };
        auto vset1 = [](float x) { return _mm256_set1_ps(x); };
        auto vfma = [](R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); };
#endif
        constexpr int64_t W = sizeof(R) / sizeof(float);
        constexpr int64_t ROWS = BLOCK_M;
        constexpr int64_t COLS = BLOCK_N / W;
        static_assert(BLOCK_N % W == 0, "block_n must be a multiple of the vector width");
        R vc[ROWS * COLS];
        #pragma GCC unroll 64
        for (int64_t i = 0; i < ROWS * COLS; ++i) {
            vc[i] = accum ? vload(C + (i / COLS) * ldc + (i % COLS) * W) : vset1(0.0f);
        }
        for (int64_t k = 0; k < K; ++k) {
            R vb[COLS];
            #pragma GCC unroll 16
            for (int64_t col = 0; col < COLS; ++col) {
                __builtin_prefetch(B + (k + AHEAD) * ldb + col * W, 0, 3);
                vb[col] = vload(B + k * ldb + col * W);
            }
            #pragma GCC unroll 16
            for (int64_t row = 0; row < ROWS; ++row) {
                R va = vset1(A[row * lda + k]);
                #pragma GCC unroll 16
                for (int64_t col = 0; col < COLS; ++col) {
                    vc[row * COLS + col] = vfma(va, vb[col], vc[row * COLS + col]);
                }
            }
        }
        #pragma GCC unroll 64
        for (int64_t i = 0; i < ROWS * COLS; ++i) {
            vstore(C + (i / COLS) * ldc + (i % COLS) * W, vc[i]);
        }
        return;
    }
#endif
{%- endif %}
"""


# The same for blocked_bf16's kernel (bfloat16 operands widened to float32 as they load: a shift of each 16-bit
# half into a float's top, exact): its weight prefetched the same bytes ahead.
_REGISTERS_BF16 = (
    _REGISTERS.replace("input_dtype == torch.float32\n      and input2_dtype == torch.float32",
                       "input_dtype == torch.bfloat16\n      and input2_dtype == torch.bfloat16")
    .replace("        auto vfma = [](R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); };\n",
             "        auto vfma = [](R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); };\n"
             "        auto vloadb = [](const void* p) { return _mm512_castsi512_ps(_mm512_slli_epi32(\n"
             "            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16)); };\n")
    .replace("        auto vfma = [](R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); };\n",
             "        auto vfma = [](R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); };\n"
             "        auto vloadb = [](const void* p) { return _mm256_castsi256_ps(_mm256_slli_epi32(\n"
             "            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16)); };\n")
    .replace("vb[col] = vload(B + k * ldb + col * W);", "vb[col] = vloadb(B + k * ldb + col * W);")
    .replace("R va = vset1(A[row * lda + k]);", "R va = vset1(static_cast<float>(A[row * lda + k]));")
    .replace("AHEAD", "AHEAD_BF16"))


@functools.lru_cache(maxsize=None)
def tuned_kernel() -> str | None:
    """Inductor's float32 micro-kernel source with a prefetch of the weight PREFETCH_BYTES ahead of each load
    (__builtin_prefetch: x86 and ARM) and, on x86, its accumulators in registers (_REGISTERS); None where this torch's
    micro-kernel is not the one this edits (then the template is compiled as Inductor ships it)."""
    import torch._inductor.lowering  # noqa: F401  (Inductor's codegen modules import in this order)
    from torch._inductor.codegen.cpp_micro_gemm import CppMicroGemmFP32Vec

    src = CppMicroGemmFP32Vec.TEMPLATE_KERNEL
    if src.count(_WEIGHT_LOAD) != 1 or src.count(_VECTORIZED) != 1:
        return None
    ahead = f"            __builtin_prefetch(B + (k + {AHEAD}) * ldb + col * VLEN, 0, 3);\n"
    src = src.replace(_WEIGHT_LOAD, ahead + _WEIGHT_LOAD)
    return src.replace(_VECTORIZED, _VECTORIZED + _REGISTERS.replace("AHEAD", AHEAD)
                       + _REGISTERS_BF16.replace("AHEAD_BF16", AHEAD_BF16))


def kernel_tag() -> str:
    """What the blocked format's graphs are compiled with (in the graphs' cache keys and the GEMM measurement's)."""
    return (f"inductor fp32 micro-kernel, prefetch {PREFETCH_BYTES} bytes, x86 register accumulators" if tuned_kernel()
            else "inductor fp32 micro-kernel")


@functools.lru_cache(maxsize=None)
def _micro_gemm(rows: int, n: int, k: int, threads: int, simdlen: int | None, dtype: torch.dtype = DTYPE):
    # (simdlen: Inductor's cpp.simdlen, which create_micro_gemm reads itself; here a cache key)
    import torch._inductor.lowering  # noqa: F401  (Inductor's codegen modules import in this order)
    from torch._inductor.codegen.cpp_micro_gemm import create_micro_gemm
    from torch._inductor.graph import GraphLowering
    from torch._inductor.virtualized import V

    graph = torch.fx.Graph()
    graph.output(())
    with V.set_graph_handler(GraphLowering(torch.fx.GraphModule(torch.nn.Module(), graph))), _kernels(dtype):
        return create_micro_gemm("micro_gemm", rows, n, k, input_dtype=dtype, input2_dtype=dtype, output_dtype=DTYPE,
                                 compute_dtype=DTYPE, num_threads=threads, use_ref=False)


def _of(config, dtype: torch.dtype = DTYPE) -> bool:
    """Whether a micro-kernel config multiplies two `dtype` operands in float32 (the blocked formats' kernels)."""
    return config.input_dtype == config.input2_dtype == dtype and config.compute_dtype == DTYPE


def register_blockings() -> list[tuple[int, int]]:
    """(block_m, block_n) of each float32 micro-kernel Inductor has for the vector ISA it compiles for here."""
    import torch._inductor.lowering  # noqa: F401  (Inductor's codegen modules import in this order)
    from torch._inductor.codegen.cpp_micro_gemm import micro_gemm_configs
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    return [(c.register_blocking.block_m, c.register_blocking.block_n) for configs in micro_gemm_configs.values()
            for c in configs if _of(c) and c.register_blocking.block_k == 1 and isinstance(isa, c.vec_isa_cls)]


def one_pass_blocking(rows: int) -> tuple[int, int] | None:
    """The float32 register blocking of this ISA that covers `rows` token rows in one pass (block_m >= rows) with the
    largest register block (Inductor's own size rank), or None. Where Inductor's choice for a shape takes two passes
    (AVX2's 4 x 24 at 5-8 rows) each weight tile's second pass of FMAs runs after its load, not beside it: the build
    measures this one beside it (gemm.choose)."""
    fits = [b for b in register_blockings() if b[0] >= rows]
    return max(fits, key=lambda b: b[0] * b[1] + b[0] + b[1]) if fits else None


def blocking(rows: int, n: int, k: int, threads: int, dtype: torch.dtype = DTYPE) -> tuple[int, int] | None:
    """(block_m, block_n) of the micro-kernel Inductor's template takes for a (rows x k) @ (k x n) of `dtype`
    operands on `threads` threads on this CPU, or None where it has no vectorised one (then the blocked format is not
    offered)."""
    import torch._inductor.config

    mg = _micro_gemm(rows, n, k, threads, torch._inductor.config.cpp.simdlen, dtype)
    return None if mg is None else (mg.register_blocking.block_m, mg.register_blocking.block_n)


def block_n(rows: int, n: int, k: int, threads: int, forced: tuple[int, int] | None = None,
            dtype: torch.dtype = DTYPE) -> int | None:
    """The block_n of a blocked copy for a (rows x k) @ (k x n) of `dtype` operands: Inductor's choice (`blocking`),
    or the `forced` blocking's where this ISA has it (None where not)."""
    if forced is not None:
        return forced[1] if tuple(forced) in register_blockings() else None
    b = blocking(rows, n, k, threads, dtype)
    return None if b is None else b[1]


@contextlib.contextmanager
def _kernels(dtype: torch.dtype, bn: int | None = None):
    """Inside: Inductor's micro-kernels of `dtype` operands are its vector ones (CppMicroGemmFP32Vec: the blocked
    layout as it is; not AMX's, which reads its weight VNNI-packed), of block_n `bn` where given."""
    import torch._inductor.lowering  # noqa: F401  (Inductor's codegen modules import in this order)
    from torch._inductor.codegen import cpp_micro_gemm as cmg

    shipped = {c: list(v) for c, v in cmg.micro_gemm_configs.items()}
    for c, v in shipped.items():
        cmg.micro_gemm_configs[c] = [x for x in v if not _of(x, dtype) or (
            c is cmg.CppMicroGemmFP32Vec and bn in (None, x.register_blocking.block_n))]
    try:
        yield
    finally:
        cmg.micro_gemm_configs.update(shipped)


@contextlib.contextmanager
def only_block_n(bn: int, dtype: torch.dtype = DTYPE):
    """Inside: Inductor's micro-kernels of `dtype` operands are its vector ones of block_n `bn` (one per ISA)."""
    _micro_gemm.cache_clear()
    try:
        with _kernels(dtype, bn):
            yield
    finally:
        _micro_gemm.cache_clear()


def available(dtype: torch.dtype = DTYPE) -> bool:
    """Whether Inductor has a vectorised micro-kernel of `dtype` operands (float32 products) on this CPU."""
    try:
        return block_n(8, 256, 256, 1, dtype=dtype) is not None
    except Exception:  # (no usable vector ISA or compiler: the format is simply not a candidate)
        return False


@functools.lru_cache(maxsize=None)
def _parsed_once(parse):
    """Inductor's jinja parse of a template source, memoised per source: it parses the GEMM template and its
    micro-kernel's afresh for every GEMM it renders (~0.1 s each: about half the time of compiling a graph of 121
    GEMMs); a parsed jinja Template renders any number of times."""
    return functools.lru_cache(maxsize=256)(parse)


def _mkl_linear(x, packed_w, orig_w, b, batch_size, *, layout=None):
    from torch._inductor import mkldnn_ir
    from torch._inductor.ir import TensorBox

    return TensorBox.create(mkldnn_ir.MKLPackedLinear.create(x, packed_w, orig_w, b, batch_size))


def _onednn_linear(x, w, b, attr, scalars, algorithm, layout=None):
    from torch._inductor import mkldnn_ir
    from torch._inductor.ir import FixedLayout, TensorBox

    cls = mkldnn_ir.LinearUnary
    x, w = cls.require_contiguous(cls.realize_input(x)), cls.realize_input(w)  # (w: an opaque oneDNN tensor)
    inputs = [x, w] + ([cls.require_contiguous(cls.realize_input(b))] if b is not None else [])
    consts = ([] if b is not None else [None]) + [attr, scalars if scalars else [-1], algorithm]
    *m, _ = x.get_size()
    node = cls(layout=FixedLayout(device=x.get_device(), dtype=x.get_dtype(), size=[*m, w.get_size()[0]]),
               inputs=inputs, constant_args=consts)
    return TensorBox.create(mkldnn_ir._create_output_node(node))


def _onednn_linear_add(x, y, w, b, attr, layout=None):  # (Inductor fuses a following add into the GEMM)
    from torch._inductor import lowering, mkldnn_ir
    from torch._inductor.ir import FixedLayout, TensorBox

    cls = mkldnn_ir.LinearBinary
    x, y = (cls.require_contiguous(cls.realize_input(lowering.view(t, [-1, t.get_size()[-1]]))) for t in (x, y))
    w = cls.realize_input(w)
    inputs = [x, y, w] + ([cls.require_contiguous(cls.realize_input(b))] if b is not None else [])
    node = cls(layout=FixedLayout(device=x.get_device(), dtype=x.get_dtype(), size=[x.get_size()[0], w.get_size()[0]]),
               inputs=inputs, constant_args=([] if b is not None else [None]) + [attr])
    return TensorBox.create(mkldnn_ir._create_output_node(node))


def _blocked_linear(x, w, n, threads):
    from torch._inductor import config, ir, lowering
    from torch._inductor.codegen.cpp_gemm_template import CppGemmTemplate
    from torch._inductor.select_algorithm import autotune_select_algorithm

    out_dtype, dtype = x.get_dtype(), w.get_dtype()
    if dtype != out_dtype:  # (blocked_bf16: x rounded to the weight's dtype, products summed in float32)
        x = lowering.to_dtype(x, dtype)
    x = ir.ExternKernel.require_contiguous(ir.ExternKernel.realize_input(x))
    w = ir.ExternKernel.require_contiguous(ir.ExternKernel.realize_input(w))
    m, k = x.get_size()
    _, _, bn = w.get_size()
    layout = ir.FixedLayout(x.get_device(), out_dtype, [m, n])
    # the template reads its weight's [k, n] shape before laying it out; prep_weight then hands it w as is
    stand_in = ir.ReinterpretView(data=w.data if isinstance(w, ir.TensorBox) else w,
                                  layout=ir.FixedLayout(w.get_device(), w.get_dtype(), [k, n], [1, k]))

    class Preblocked(CppGemmTemplate):
        @classmethod
        def prep_weight(cls, inputs, layout_, micro_gemm, should_block_weight, *args, **kwargs):
            if micro_gemm.register_blocking.block_n != bn:
                raise RuntimeError(f"blocked weight copy of block_n {bn}: no {str(dtype).split('.')[-1]} micro-kernel "
                                   f"of Inductor's for this CPU's ISA has it ({register_blockings()}); rebuild the "
                                   "bundle on this host")
            return [inputs[0], w, *inputs[2:]], layout_

        def get_options(self, *args, **kwargs):  # (render's: makes the micro-kernel it generates)
            with only_block_n(bn, dtype):
                return super().get_options(*args, **kwargs)

    choices: list = []
    with config.patch({"cpp.threads": int(threads)}), only_block_n(bn, dtype):
        Preblocked.add_choices(choices, layout, [x, stand_in])
    if len(choices) != 1:
        raise RuntimeError(f"Inductor's CPU GEMM template made {len(choices)} choices for eagle3::blocked_linear")
    node, _ = autotune_select_algorithm("eagle3_blocked_linear", choices, [x, w], layout)
    return node


def _packed_lowerings() -> dict:
    """op overload -> our lowering, for the packed ops this torch build has (Inductor has a lowering of its own
    for the MKL / oneDNN ones, none for eagle3::blocked_linear)."""
    from torch._inductor import lowering

    ours = {torch.ops.eagle3.blocked_linear: _blocked_linear}
    if torch._C.has_mkl:
        ours[torch.ops.mkl._mkl_linear] = _mkl_linear
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        ours[torch.ops.mkldnn._linear_pointwise] = _onednn_linear
        ours[torch.ops.mkldnn._linear_pointwise.binary] = _onednn_linear_add
    return {k: fn for op, fn in ours.items() for k in (op, getattr(op, "default", op))
            if k in lowering.lowerings or op is torch.ops.eagle3.blocked_linear}


@contextlib.contextmanager
def packed_input_lowering():
    """Inductor lowers the packed GEMMs (`mkl._mkl_linear`, `mkldnn._linear_pointwise`) only with the packed
    weight as a graph constant (its freezing pass makes it); here the packed weight is a graph input (made
    at load), so lower each call straight to the same extern kernel (mkldnn_ir.MKLPackedLinear /
    LinearUnary) with every operand an input; and eagle3::blocked_linear to Inductor's GEMM template over its
    blocked copy, its micro-kernel prefetching (module doc); and each template source is parsed once (_parsed_once)."""
    from torch._inductor import lowering
    from torch._inductor.codegen.common import KernelTemplate
    from torch._inductor.codegen.cpp_micro_gemm import CppMicroGemmFP32Vec

    table = _packed_lowerings()
    old = {k: lowering.lowerings[k] for k in table if k in lowering.lowerings}
    lowering.lowerings.update(table)
    shipped = CppMicroGemmFP32Vec.TEMPLATE_KERNEL  # (rendered when the graph's code is generated: inside the compile)
    CppMicroGemmFP32Vec.TEMPLATE_KERNEL = tuned_kernel() or shipped
    parse = KernelTemplate.__dict__.get("_template_from_string")  # (a staticmethod; absent elsewhere: parsed as shipped)
    if isinstance(parse, staticmethod):
        KernelTemplate._template_from_string = staticmethod(_parsed_once(parse.__func__))
    try:
        yield
    finally:
        if isinstance(parse, staticmethod):
            KernelTemplate._template_from_string = parse
        CppMicroGemmFP32Vec.TEMPLATE_KERNEL = shipped
        for k in table:
            lowering.lowerings.pop(k, None)
        lowering.lowerings.update(old)


def lean_wrapper_available() -> bool:
    """Whether this torch's AOTI wrapper codegen is the one lean_wrapper edits."""
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    return callable(CppWrapperCpu.__dict__.get("generate_input_output_runtime_checks"))


@contextlib.contextmanager
def lean_wrapper():
    """AOTI writes, for every graph input, a function that checks its dtype, sizes, strides and device when
    AOTI_RUNTIME_CHECK_INPUTS is set (a debugging aid, ~60 lines each: 24k of a target graph's 30k wrapper lines,
    ~60% of its g++ time). The runtime checks every call's inputs against the manifest (backends.base.Graph) and
    binds the weights it validated at load; inside this, Inductor writes those functions over no inputs."""
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
    from torch._inductor.virtualized import V

    if not lean_wrapper_available():
        yield
        return
    shipped = CppWrapperCpu.__dict__["generate_input_output_runtime_checks"]

    def over_no_inputs(self):
        inputs, V.graph.graph_inputs = V.graph.graph_inputs, {}
        try:
            shipped(self)
        finally:
            V.graph.graph_inputs = inputs

    CppWrapperCpu.generate_input_output_runtime_checks = over_no_inputs
    try:
        yield
    finally:
        CppWrapperCpu.generate_input_output_runtime_checks = shipped


@contextlib.contextmanager
def env(name: str, value: str):
    """Inside: os.environ[name] = value."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
