"""Every reach of the builder into torch's private internals (Inductor's), each a hook behind a probe.

The rule is eagle3_runtime.torch_internals.Hooks: a hook is used only on a torch release CI tests (TESTED) whose
probe passes, checked once per process; otherwise the public path serves (Inductor as shipped, or no packed
form: F.linear) and one warning names the hook and the torch version. `report()` goes into the build record.

The hooks: the packed GEMMs' lowerings with the packed weight a graph input (Inductor lowers MKL's and oneDNN's
only for a constant weight); the blocked format (Inductor's CPU GEMM template over a copy the runtime blocks at
load, its micro-kernel of a block_n the build picks); that micro-kernel's source edited to prefetch the weight and
keep its accumulators in registers (docs/linear-layout.md); and three that only make compiling cheaper: each
template source parsed once, AOTI's per-input debug checks not written, Inductor's per-process ISA probe memoised.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import inspect
import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

from eagle3_runtime import packing  # noqa: F401  (registers eagle3::blocked_linear)
from eagle3_runtime.torch_internals import Hooks

from ...files import atomic_write

TESTED = ("2.13.0",)  # the torch releases CI builds with these hooks on
HOOKS = Hooks("builder", TESTED)

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


def _import_codegen():
    import torch._inductor.lowering  # noqa: F401  (Inductor's codegen modules import in this order)
    from torch._inductor.codegen import cpp_micro_gemm

    return cpp_micro_gemm


# ------------------------------------------------------------------ hooks and their probes

@HOOKS.hook("micro_kernel_edit", "the blocked format's micro-kernel is compiled as Inductor ships it")
def _probe_micro_kernel_edit() -> None:
    src = _import_codegen().CppMicroGemmFP32Vec.TEMPLATE_KERNEL
    if src.count(_WEIGHT_LOAD) != 1 or src.count(_VECTORIZED) != 1:
        raise ValueError("CppMicroGemmFP32Vec.TEMPLATE_KERNEL is not the source this edits")


@HOOKS.hook("blocked_format", "the blocked formats are not offered (packed forms left: MKL's, oneDNN's, or F.linear)")
def _probe_blocked_format() -> None:
    cmg = _import_codegen()
    from torch._inductor.codegen.cpp_gemm_template import CppGemmTemplate
    from torch._inductor.cpu_vec_isa import pick_vec_isa  # noqa: F401  (called when used: it may compile probes)
    from torch._inductor.graph import GraphLowering  # noqa: F401
    from torch._inductor.select_algorithm import autotune_select_algorithm  # noqa: F401
    from torch._inductor.virtualized import V  # noqa: F401

    params = list(inspect.signature(CppGemmTemplate.prep_weight).parameters)
    if params[:4] != ["inputs", "layout", "micro_gemm", "should_block_weight"]:
        raise TypeError(f"CppGemmTemplate.prep_weight{tuple(params)}")
    for name in ("add_choices", "get_options"):
        if not callable(getattr(CppGemmTemplate, name, None)):
            raise AttributeError(f"CppGemmTemplate.{name}")
    params = inspect.signature(cmg.create_micro_gemm).parameters
    if not {"input_dtype", "input2_dtype", "output_dtype", "compute_dtype", "num_threads", "use_ref"} <= set(params):
        raise TypeError(f"create_micro_gemm{tuple(params)}")
    configs = [c for v in cmg.micro_gemm_configs.values() for c in v]
    if not configs or not all(hasattr(c, "register_blocking") and hasattr(c, "vec_isa_cls") for c in configs):
        raise AttributeError("micro_gemm_configs entries without register_blocking / vec_isa_cls")


@HOOKS.hook("packed_extern_lowering", "MKL's and oneDNN's packed formats are not offered (F.linear, or the blocked "
            "format)")
def _probe_packed_extern_lowering() -> None:
    from torch._inductor import lowering, mkldnn_ir
    from torch._inductor.ir import FixedLayout, TensorBox  # noqa: F401

    for name in ("MKLPackedLinear", "LinearUnary", "LinearBinary", "_create_output_node"):
        if not hasattr(mkldnn_ir, name):
            raise AttributeError(f"torch._inductor.mkldnn_ir.{name}")
    if not isinstance(lowering.lowerings, dict):
        raise TypeError("torch._inductor.lowering.lowerings is not a dict")


@HOOKS.hook("template_parsed_once", "each GEMM template source is parsed per GEMM (slower compiles, same code)")
def _probe_template_parsed_once() -> None:
    from torch._inductor.codegen.common import KernelTemplate

    if not isinstance(KernelTemplate.__dict__.get("_template_from_string"), staticmethod):
        raise AttributeError("KernelTemplate._template_from_string is not a staticmethod")


@HOOKS.hook("lean_wrapper", "AOTI writes its per-input debug checks (slower g++, same kernels)")
def _probe_lean_wrapper() -> None:
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
    from torch._inductor.virtualized import V  # noqa: F401

    if not callable(CppWrapperCpu.__dict__.get("generate_input_output_runtime_checks")):
        raise AttributeError("CppWrapperCpu.generate_input_output_runtime_checks")


@HOOKS.hook("vec_isa_memo", "Inductor probes the CPU's vector ISAs itself in every compile")
def _probe_vec_isa_memo() -> None:
    from torch._inductor import config, cpp_builder, cpu_vec_isa

    for obj, name in ((cpu_vec_isa, "x86_isa_checker"), (cpu_vec_isa, "supported_vec_isa_list"),
                      (cpp_builder, "get_cpp_compiler")):
        if not hasattr(obj, name):
            raise AttributeError(f"{obj.__name__}.{name}")
    config.cpp.vec_isa_ok  # noqa: B018


@HOOKS.hook("march_tuning", "code for the psABI level is compiled without -mtune=native")
def _probe_march_tuning() -> None:
    import shlex

    from torch._inductor import config, cpp_builder

    with config.patch({"cpp.march": "x86-64-v3 -mtune=native"}):
        flags = cpp_builder._get_cpu_arch_cflags(cpp_builder.get_cpp_compiler())
    if shlex.split(" ".join(f"-{f}" for f in flags)) != ["-march=x86-64-v3", "-mtune=native"]:
        raise ValueError(f"cpp.march becomes {flags}")


def report() -> dict:
    """Which hooks this build used (for the build record)."""
    return HOOKS.report()


# ------------------------------------------------------------------ the blocked format's micro-kernel

@functools.lru_cache(maxsize=None)
def tuned_kernel() -> str | None:
    """Inductor's float32 micro-kernel source with a prefetch of the weight PREFETCH_BYTES ahead of each load
    and, on x86, its accumulators in registers (_REGISTERS); None where the hook is off."""
    if not HOOKS.on("micro_kernel_edit"):
        return None
    src = _import_codegen().CppMicroGemmFP32Vec.TEMPLATE_KERNEL
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
    cmg = _import_codegen()
    from torch._inductor.graph import GraphLowering
    from torch._inductor.virtualized import V

    graph = torch.fx.Graph()
    graph.output(())
    with V.set_graph_handler(GraphLowering(torch.fx.GraphModule(torch.nn.Module(), graph))), _kernels(dtype):
        return cmg.create_micro_gemm("micro_gemm", rows, n, k, input_dtype=dtype, input2_dtype=dtype,
                                     output_dtype=DTYPE, compute_dtype=DTYPE, num_threads=threads, use_ref=False)


def _float32_products(config, dtype: torch.dtype = DTYPE) -> bool:
    """Whether a micro-kernel config multiplies two `dtype` operands in float32 (the blocked formats' kernels)."""
    return config.input_dtype == config.input2_dtype == dtype and config.compute_dtype == DTYPE


def register_blockings() -> list[tuple[int, int]]:
    """(block_m, block_n) of each float32 micro-kernel Inductor has for the vector ISA it compiles for here."""
    if not HOOKS.on("blocked_format"):
        return []
    cmg = _import_codegen()
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    return [(c.register_blocking.block_m, c.register_blocking.block_n) for configs in cmg.micro_gemm_configs.values()
            for c in configs if _float32_products(c) and c.register_blocking.block_k == 1
            and isinstance(isa, c.vec_isa_cls)]


def one_pass_blocking(rows: int) -> tuple[int, int] | None:
    """The float32 register blocking of this ISA that covers `rows` token rows in one pass (block_m >= rows) with the
    largest register block (Inductor's own size rank), or None. Where Inductor's choice takes two passes, each weight
    tile's second pass of FMAs runs after its load, not beside it: the build measures this one too (gemm.choose)."""
    fits = [b for b in register_blockings() if b[0] >= rows]
    return max(fits, key=lambda b: b[0] * b[1] + b[0] + b[1]) if fits else None


def blocking(rows: int, n: int, k: int, threads: int, dtype: torch.dtype = DTYPE) -> tuple[int, int] | None:
    """(block_m, block_n) of the micro-kernel Inductor's template takes for a (rows x k) @ (k x n) of `dtype`
    operands on `threads` threads on this CPU, or None where it has no vectorised one (or the hook is off)."""
    if not HOOKS.on("blocked_format"):
        return None
    mg = _micro_gemm(rows, n, k, threads, isa_config()[0], dtype)
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
    cmg = _import_codegen()
    shipped = {c: list(v) for c, v in cmg.micro_gemm_configs.items()}
    for c, v in shipped.items():
        cmg.micro_gemm_configs[c] = [x for x in v if not _float32_products(x, dtype) or (
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


def blocked_available(dtype: torch.dtype = DTYPE) -> bool:
    """Whether the blocked format of `dtype` operands can be compiled here: its hook is on and Inductor has a
    vectorised micro-kernel for them on this CPU."""
    return block_n(8, 256, 256, 1, dtype=dtype) is not None


# ------------------------------------------------------------------ lowerings of the packed GEMMs

@functools.lru_cache(maxsize=None)
def _parsed_once(parse):
    """Inductor's jinja parse of a template source, memoised per source (it parses the GEMM template and its
    micro-kernel's afresh for every GEMM it renders); a parsed jinja Template renders any number of times."""
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
    """op overload -> our lowering, for the packed ops this torch build has and whose hook is on."""
    from torch._inductor import lowering

    ours = {torch.ops.eagle3.blocked_linear: _blocked_linear} if HOOKS.on("blocked_format") else {}
    if HOOKS.on("packed_extern_lowering"):
        if torch.backends.mkl.is_available():
            ours[torch.ops.mkl._mkl_linear] = _mkl_linear
        if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
            ours[torch.ops.mkldnn._linear_pointwise] = _onednn_linear
            ours[torch.ops.mkldnn._linear_pointwise.binary] = _onednn_linear_add
    return {k: fn for op, fn in ours.items() for k in (op, getattr(op, "default", op))
            if k in lowering.lowerings or op is torch.ops.eagle3.blocked_linear}


def extern_lowering_available() -> bool:
    """Whether MKL's and oneDNN's packed GEMMs can be lowered with their packed weight a graph input."""
    return HOOKS.on("packed_extern_lowering")


@contextlib.contextmanager
def packed_input_lowering():
    """Inside: MKL's and oneDNN's packed GEMMs lowered with the packed weight a graph input (made at load) to the
    same extern kernels Inductor uses for a constant one; eagle3::blocked_linear to Inductor's GEMM template over
    its blocked copy, the micro-kernel edited (tuned_kernel); each template source parsed once."""
    from torch._inductor import lowering

    table = _packed_lowerings()
    old = {k: lowering.lowerings[k] for k in table if k in lowering.lowerings}
    lowering.lowerings.update(table)
    with contextlib.ExitStack() as stack:
        if tuned_kernel():  # (rendered when the graph's code is generated: inside the compile)
            fp32 = _import_codegen().CppMicroGemmFP32Vec
            shipped = fp32.TEMPLATE_KERNEL
            fp32.TEMPLATE_KERNEL = tuned_kernel()
            stack.callback(setattr, fp32, "TEMPLATE_KERNEL", shipped)
        if HOOKS.on("template_parsed_once"):
            from torch._inductor.codegen.common import KernelTemplate

            parse = KernelTemplate.__dict__["_template_from_string"]
            KernelTemplate._template_from_string = staticmethod(_parsed_once(parse.__func__))
            stack.callback(setattr, KernelTemplate, "_template_from_string", parse)
        try:
            yield
        finally:
            for k in table:
                lowering.lowerings.pop(k, None)
            lowering.lowerings.update(old)


# ------------------------------------------------------------------ AOTInductor compiles

def lean_wrapper_available() -> bool:
    return HOOKS.on("lean_wrapper")


@contextlib.contextmanager
def lean_wrapper():
    """AOTI writes, for every graph input, a function that checks its dtype, sizes, strides and device when
    AOTI_RUNTIME_CHECK_INPUTS is set (a debugging aid: most of a target graph's wrapper lines). The runtime checks
    every call's inputs against the manifest; inside this, Inductor writes those functions over no inputs."""
    if not lean_wrapper_available():
        yield
        return
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
    from torch._inductor.virtualized import V

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
def inductor_cache(directory: str | Path):
    """Inside: Inductor's cache (and its generated sources) under `directory`."""
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


def config_patch(changes: dict):
    """torch._inductor.config.patch (public configuration)."""
    import torch._inductor.config

    return torch._inductor.config.patch(changes)


def isa_config() -> tuple[int | None, str | None]:
    """Inductor's (cpp.simdlen, cpp.march) in force."""
    import torch._inductor.config

    return torch._inductor.config.cpp.simdlen, torch._inductor.config.cpp.march


def compile_for(simdlen: int, level: str):
    """Inside: Inductor compiles for vector width `simdlen` and x86 psABI `level` (e.g. x86-64-v4), tuned for
    this host's CPU model where the march_tuning hook is on."""
    march = f"{level} -mtune=native" if HOOKS.on("march_tuning") else level
    return config_patch({"cpp.simdlen": simdlen, "cpp.march": march})


def tp_graph_configs() -> dict:
    """Inductor configuration for graphs with collectives: torch 2.13's post-grad reorder_for_locality can move a
    kernel that reads a collective's result above its wait_tensor (seen: a TP-2 verify graph's final norm read its
    all-reduce in flight under gloo), so the traced order is kept; on every torch (the reorder only helps speed)."""
    return {"reorder_for_locality": False}


def compile_and_package(ep, package_path: str, inductor_configs: dict):
    """torch._inductor.aoti_compile_and_package (public API)."""
    import torch._inductor

    return torch._inductor.aoti_compile_and_package(ep, package_path=package_path, inductor_configs=inductor_configs)


def load_package(path: str):
    """torch._inductor.aoti_load_package (public API; the builder's GEMM measurement only)."""
    import torch._inductor

    return torch._inductor.aoti_load_package(path)


def warm_up() -> None:
    """Imports what a compile needs (a compile worker does this while the build is still tracing)."""
    import torch._inductor.compile_fx  # noqa: F401


def host_vec_isa(cache_root: Path) -> dict:
    """Which CPU vector ISAs Inductor may use on this host: {"cpuinfo": [...], "verified": [...]}.

    Inductor proves each ISA /proc/cpuinfo lists by compiling and loading a test program, in every process and
    again for every fresh Inductor cache dir (each compile here has a private one). The answer depends only on
    the CPU flags, the C++ compiler and torch, so it is memoised under the compile cache (`host/`), keyed on
    those; where "verified" equals "cpuinfo", compiles set cpp.vec_isa_ok and Inductor skips its probe. Off x86,
    or with the hook off: empty lists (nothing changes)."""
    if platform.machine() not in ("x86_64", "AMD64") or not HOOKS.on("vec_isa_memo"):
        return {"cpuinfo": [], "verified": []}
    from torch._inductor import cpp_builder, cpu_vec_isa

    flags = sorted(cpu_vec_isa.x86_isa_checker())
    compiler = cpp_builder.get_cpp_compiler()
    try:
        compiler_id = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                     timeout=60).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError):
        compiler_id = []
    ident = json.dumps([torch.__version__, platform.machine(), flags, compiler, compiler_id])
    path = cache_root / "host" / f"vec-isa-{hashlib.sha256(ident.encode()).hexdigest()[:24]}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    candidates = [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(f in flags for f in str(isa).split())]
    cpuinfo = [str(isa) for isa in candidates]
    # Inductor's own check per ISA (what valid_vec_isa_list() runs one after another), in parallel
    with tempfile.TemporaryDirectory(prefix="eagle3-isa-") as d, inductor_cache(d), \
            config_patch({"cpp.vec_isa_ok": None}), \
            concurrent.futures.ThreadPoolExecutor(len(candidates) or 1) as pool:
        ok = list(pool.map(bool, candidates))
    verified = [str(isa) for isa, good in zip(candidates, ok) if good]
    result = {"cpuinfo": cpuinfo, "verified": verified, "compiler": compiler, "torch": torch.__version__}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(result))
    return result


def skip_vec_isa_probe() -> dict:
    """The config that tells Inductor the host's ISAs are proven (host_vec_isa's verified equals cpuinfo)."""
    return {"cpp.vec_isa_ok": True}
