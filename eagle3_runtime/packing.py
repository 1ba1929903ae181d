"""Weights pre-packed for CPU GEMM, made at load time (manifest `GraphEntry.packed`).

A bundle stores plain weights only. An aoti CPU graph built with packing takes, after its plain
weights, packed copies of the weights its projections use, in the format the build chose for the call's
token row count by measurement (eagle3_build/backends/gemm.py):

  mkl_sgemm  MKL's sgemm pack for exactly that row count (`mkl._mkl_reorder_linear_weight`), which the
             graph passes to `mkl._mkl_linear`; one copy per (weight, row count), decode-sized rows only
  onednn     oneDNN's blocked layout (`mkldnn._reorder_linear_weight`), passed to `mkldnn._linear_pointwise`;
             one copy per weight serves every row count, prefill chunks included (made for ONEDNN_ROWS
             rows: docs/linear-layout.md). That call also takes a plain
             weight, so a host whose torch cannot reorder, or a run with EAGLE3_RUNTIME_NO_PACK=1 (fewer
             copies: less memory), passes the plain weight (same results, slower)
  blocked    the weight transposed into blocks of `block_n` output columns, [ceil(N / block_n), K, block_n]
             (zero-padded), which the aoti graph passes to Inductor's CPU GEMM template (its generated
             micro-kernel for this CPU's vector ISA, `eagle3::blocked_linear`): the layout that template
             gives a constant weight, made here from a plain one with torch alone (no MKL or oneDNN), so any
             host can make it. One copy per (weights, block_n) serves every decode-sized row count; the
             build takes block_n from the micro-kernel Inductor picks for the GEMM's shape
  onednn_bf16  (draft projections only) the weight rounded to bfloat16 in oneDNN's blocked layout, x rounded
             to bfloat16 for the call and the result returned in x's dtype: half the bytes a step streams,
             native bf16 dot products where the CPU has them (AVX512_BF16, AMX). A draft's numerics only
             choose what is proposed (verification keeps the output exact), and a draft stored in bfloat16
             loses nothing of its weights; the build offers it only there (backends/gemm.py)
  blocked_bf16  (draft projections only) the blocked layout in bfloat16, x rounded to bfloat16, products
             summed in float32 by Inductor's template (its bfloat16 micro-kernel widens both operands): the
             half-size draft weights on any CPU Inductor has a vector ISA for, AVX2 included (oneDNN has no
             bfloat16 GEMM there)

Projections of one input (q, k, v; gate, up) take, in oneDNN's formats and blocked, one copy of their weights
concatenated along the output dim (PackedWeight.fused: one GEMM instead of three, as vLLM fuses them).
The packed layout is specific to this host's library and CPU, which is why it is made here and never
shipped. `packed_linear` is the matching call, traced into graphs by eagle3_build/models/linear.py.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from . import torch_internals
from .manifest import BLOCKED, BLOCKED_BF16, BLOCKED_FORMATS, ONEDNN_FORMATS, BundleError, PackedWeight

PACK_FORMATS = ("mkl_sgemm", "onednn", BLOCKED)  # exact float32 formats (backend_options.pack_weights names one)
BF16 = "onednn_bf16"
BF16_FORMATS = (BF16, BLOCKED_BF16)  # the draft's bfloat16 formats
FORMATS = (*PACK_FORMATS, *BF16_FORMATS)  # every format a graph's packed input may take (manifest PackedWeight)
# per weight element, of the copy made at load
ELEMENT_BYTES = {"mkl_sgemm": 4, "onednn": 4, BLOCKED: 4, BF16: 2, BLOCKED_BF16: 2}
BLOCKED_DTYPES = {BLOCKED: torch.float32, BLOCKED_BF16: torch.bfloat16}  # a blocked copy's (its GEMM's operands)
NO_PACK = "EAGLE3_RUNTIME_NO_PACK"
ONEDNN_ROWS = 8  # the row count oneDNN's copies are laid out for (module doc)


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or what the platform says where that is not readable."""
    import platform

    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def cpu_family_model() -> str | None:
    """"family F model M" from /proc/cpuinfo (a model name like "AMD EPYC" names several generations), or None."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]  # (the first CPU's block)
    except OSError:
        return None
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in first.splitlines() if ":" in line)}
    family, model = fields.get("cpu family"), fields.get("model")
    return f"family {family} model {model}" if family and model else None


def cpu_description() -> str:
    """The CPU's model name, family / model and the vector ISA torch runs on it ("AMD EPYC" names Zen 3, 4 and 5,
    AVX2 and AVX-512 parts): what a measurement names its host by."""
    fm = cpu_family_model()
    return f"{cpu_model()} ({fm + ', ' if fm else ''}{torch.backends.cpu.get_cpu_capability()})"


def pack_available(fmt: str) -> bool:
    """Whether this torch can make `fmt`-packed copies on this CPU."""
    if fmt == "mkl_sgemm":
        return torch_internals.mkl_available()
    if fmt in BLOCKED_FORMATS:
        return True
    return fmt in ONEDNN_FORMATS and torch_internals.onednn_reorder_available() and \
        (fmt != BF16 or torch_internals.onednn_bf16_available())


def copy_key(p: PackedWeight) -> tuple:
    """What identifies one packed copy: oneDNN's serve every row count, blocked ones every row count of their
    block_n, MKL's one."""
    weights = (p.weight, *p.fused)
    if p.format in BLOCKED_FORMATS:
        return weights, p.format, p.block_n
    return (weights, p.format) if p.format in ONEDNN_FORMATS else (weights, p.rows, p.format)


def block(weight: torch.Tensor, block_n: int) -> torch.Tensor:
    """[N, K] -> [ceil(N / block_n), K, block_n]: weight.T in blocks of block_n columns, the last zero-padded."""
    n, k = weight.shape
    nb = -(-n // block_n)
    return torch.nn.functional.pad(weight.t(), (0, nb * block_n - n)).reshape(k, nb, block_n).transpose(0, 1).contiguous()


def pack_weight(weight: torch.Tensor, rows: int, fmt: str, block_n: int | None = None) -> torch.Tensor:
    """The packed copy of a [out, in] float32 weight for GEMMs of `rows` token rows (any, for oneDNN's and
    blocked ones; block_n: the blocked format's)."""
    if fmt in BLOCKED_FORMATS:
        if not block_n:
            raise BundleError("a blocked weight copy without its block_n: rebuild the bundle")
        return block(weight.to(BLOCKED_DTYPES[fmt]), block_n)
    if fmt == BF16:
        weight = weight.to(torch.bfloat16)
    if fmt in ONEDNN_FORMATS and torch_internals.onednn_available() and \
            (not pack_available(fmt) or os.environ.get(NO_PACK, "") == "1"):
        return weight  # (_linear_pointwise takes it as it is)
    if not pack_available(fmt):
        raise BundleError(f"this bundle's graphs take {fmt!r}-packed weights, which this torch build cannot make "
                          f"(needs x86 torch with {'MKL' if fmt == 'mkl_sgemm' else 'oneDNN'}); rebuild the bundle "
                          "on this host, or with backend_options.pack_weights: false")
    w = weight.contiguous()
    if fmt == "mkl_sgemm":
        return torch_internals.mkl_pack(w, rows)
    return torch_internals.onednn_pack(w, ONEDNN_ROWS)


@torch.library.custom_op("eagle3::blocked_linear", mutates_args=())
def blocked_linear(x: torch.Tensor, w: torch.Tensor, n: int, threads: int) -> torch.Tensor:
    """x @ W.T for a 2-D x, with w = block(W, block_n) and n = W's rows; a bfloat16 w takes x rounded to bfloat16 and
    gives x's dtype. aoti graphs lower it to Inductor's CPU GEMM template, generated for `threads` threads
    (eagle3_build.backends.aoti); run as is, it is the reference."""
    nb, k, bn = w.shape
    return (x.to(w.dtype) @ w.transpose(0, 1).reshape(k, nb * bn)[:, :n]).to(x.dtype)


@blocked_linear.register_fake
def _(x, w, n, threads):
    return x.new_empty(x.shape[0], n)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                  fmt: str, n: int | None = None, threads: int = 1) -> torch.Tensor:
    """x @ weight.T (+ bias) for a 2-D x, with `packed` = pack_weight(weight, x.shape[0], fmt). n: the output
    width where weight is None (fused copies); threads: the blocked format's GEMM's."""
    if fmt in BLOCKED_FORMATS:
        y = torch.ops.eagle3.blocked_linear(x, packed, weight.shape[0] if weight is not None else n, threads)
        return y if bias is None else y + bias
    if fmt == "mkl_sgemm":
        return torch_internals.mkl_linear(x, packed, weight, bias)
    if fmt == BF16:
        b = None if bias is None else bias.to(torch.bfloat16)
        return torch_internals.onednn_linear(x.to(torch.bfloat16), packed, b).to(x.dtype)
    return torch_internals.onednn_linear(x, packed, bias)


def _per_rows(record) -> str | None:
    if not isinstance(record, dict) or not isinstance(record.get("rows"), dict):
        return None
    return ", ".join(f"{str(r)[:8]} row{'s' if r != '1' else ''} {str(v.get('choice'))[:16]}"
                     for r, v in list(record["rows"].items())[:64] if isinstance(v, dict)) or "none"


def describe_choice(record: dict | None) -> str | None:
    """One line on a bundle's GEMM choice (the manifest's build record "gemm": the target's projections, and
    the draft's under "draft"): per row count, the format chosen and where it was measured, next to this host's
    CPU. None where there is none, or it is not the record the builder writes (the build record is data:
    nothing in it is trusted to have a shape)."""
    rows = _per_rows(record)
    if rows is None:
        return None
    draft = _per_rows(record.get("draft"))
    how = f"named in the recipe ({str(record['named'])[:16]})" if record.get("named") else \
        f"measured on {str(record.get('cpu'))[:80]}, {str(record.get('threads'))[:8]} thread(s)"
    here = cpu_model()
    where = "this host" if here == record.get("cpu") else f"this host is {here}: rebuild here to measure again"
    return f"GEMM per token row count: {rows}{f'; draft: {draft}' if draft else ''} ({how}; {where})"
