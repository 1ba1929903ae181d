"""Weights pre-packed for CPU GEMM, made at load time (manifest `GraphEntry.packed`).

A bundle stores plain weights only. An aoti CPU graph built with packing takes, after its plain
weights, one packed copy per (weight, token rows) that its projections use: MKL's sgemm pack of the
weight for exactly that row count (`torch.ops.mkl._mkl_reorder_linear_weight`), which the compiled
graph passes to `mkl._mkl_linear`. The packed layout is specific to this host's MKL and CPU, which is
why it is made here and never shipped.
"""
from __future__ import annotations

import torch

from .manifest import BundleError

PACK_FORMATS = ("mkl_sgemm",)


def pack_available(fmt: str) -> bool:
    return fmt == "mkl_sgemm" and torch.backends.mkl.is_available()


def pack_weight(weight: torch.Tensor, rows: int, fmt: str) -> torch.Tensor:
    """The packed copy of a [out, in] float32 weight for GEMMs of exactly `rows` token rows."""
    if not pack_available(fmt):
        raise BundleError(f"this bundle's graphs take {fmt!r}-packed weights, which this torch build cannot make "
                          "(needs x86 torch with MKL); rebuild the bundle with backend_options.pack_weights: false")
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.contiguous(), rows)
