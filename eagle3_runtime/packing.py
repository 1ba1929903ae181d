"""Weights pre-packed for CPU GEMM, made at load time (manifest `GraphEntry.packed`).

A bundle stores plain weights only. An aoti CPU graph built with packing takes, after its plain
weights, one packed copy per (weight, token rows) that its projections use, in the format the build
chose for that row count by measurement (eagle3_build/backends/gemm.py):

  mkl_sgemm  MKL's sgemm pack for exactly that row count (`mkl._mkl_reorder_linear_weight`), which the
             graph passes to `mkl._mkl_linear`
  onednn     oneDNN's blocked layout for that row count (`mkldnn._reorder_linear_weight`), passed to
             `mkldnn._linear_pointwise`; that call also takes a plain weight, so a host whose torch
             cannot reorder, or a run with EAGLE3_RUNTIME_NO_PACK=1 (no copies: less memory), passes
             the plain weight (same results, slower)

The packed layout is specific to this host's library and CPU, which is why it is made here and never
shipped. `packed_linear` is the matching call, traced into graphs by eagle3_build/models/linear.py.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from .manifest import BundleError

PACK_FORMATS = ("mkl_sgemm", "onednn")
NO_PACK = "EAGLE3_RUNTIME_NO_PACK"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or what the platform says where that is not readable."""
    import platform

    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_available(fmt: str) -> bool:
    """Whether this torch can make `fmt`-packed copies."""
    if fmt == "mkl_sgemm":
        return torch.backends.mkl.is_available()
    return fmt == "onednn" and onednn_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack_weight(weight: torch.Tensor, rows: int, fmt: str) -> torch.Tensor:
    """The packed copy of a [out, in] float32 weight for GEMMs of exactly `rows` token rows."""
    if fmt == "onednn" and onednn_available() and (not pack_available(fmt) or os.environ.get(NO_PACK, "") == "1"):
        return weight  # (_linear_pointwise takes it as it is)
    if not pack_available(fmt):
        raise BundleError(f"this bundle's graphs take {fmt!r}-packed weights, which this torch build cannot make "
                          f"(needs x86 torch with {'MKL' if fmt == 'mkl_sgemm' else 'oneDNN'}); rebuild the bundle "
                          "on this host, or with backend_options.pack_weights: false")
    w = weight.contiguous()
    if fmt == "mkl_sgemm":
        return torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
    return torch.ops.mkldnn._reorder_linear_weight(w, rows)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  fmt: str) -> torch.Tensor:
    """x @ weight.T (+ bias) for a 2-D x, with `packed` = pack_weight(weight, x.shape[0], fmt)."""
    if fmt == "mkl_sgemm":
        return torch.ops.mkl._mkl_linear(x, packed, weight, bias, x.shape[0])
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")


def describe_choice(record: dict | None) -> str | None:
    """One line on a bundle's GEMM choice (the manifest's build record "gemm"): per row count, the form
    chosen and where it was measured, next to this host's CPU. None where there is none, or it is not the
    record the builder writes (the build record is data: nothing in it is trusted to have a shape)."""
    if not isinstance(record, dict) or not isinstance(record.get("rows"), dict):
        return None
    rows = ", ".join(f"{str(r)[:8]} row{'s' if r != '1' else ''} {str(v.get('choice'))[:16]}"
                     for r, v in list(record["rows"].items())[:64] if isinstance(v, dict))
    how = f"named in the recipe ({str(record['named'])[:16]})" if record.get("named") else \
        f"measured on {str(record.get('cpu'))[:80]}, {str(record.get('threads'))[:8]} thread(s)"
    here = cpu_model()
    where = "this host" if here == record.get("cpu") else f"this host is {here}: rebuild here to measure again"
    return f"GEMM per token row count: {rows or 'none'} ({how}; {where})"
