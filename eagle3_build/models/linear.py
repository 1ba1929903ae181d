"""How a projection is written into a graph: one rule, used by every model file.

In float32, up to SMALL_ROWS token rows (decode, verify and tree-verify graphs) it is computed
weight-stationary, y = (W @ x.T).T, materialised row-major, which CPU GEMM (MKL) runs close to one read of
the weights; a single row is computed as two (MKL's matrix-vector path reads the weights at half the
speed). More rows, and every other dtype (bf16 goes to oneDNN, where F.linear is the faster form at every
row count), keep F.linear. Why, and the measurements: docs/linear-layout.md.

Where the backend packs weights (aoti on CPU, float32), a weight with a packed copy for the call's row
count (decode-sized, and with oneDNN's formats prefill chunks too) goes to that copy's GEMM instead
(eagle3_runtime.packing: MKL's, oneDNN's or Inductor's blocked layout, whichever the build measured fastest
for that row count on its host); the copies are graph inputs made by the runtime at load, bound here by tensor identity while tracing
(`packed_weights`). Projections that read the same input (q, k, v; gate, up) go through `linears`: with
oneDNN's formats and blocked one copy of their concatenated weights serves them in one GEMM.
"""
from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F
from torch import nn

from eagle3_runtime.packing import packed_linear

SMALL_ROWS = 32  # covers max_num_seqs x tree nodes of the demo's verify graphs (docs/linear-layout.md)


# (id(weight), ...) -> {rows: (format, packed copy)} while tracing with packed inputs (a key of several ids: one
# copy of those weights concatenated along the output dim); a list collecting ((weight, ...), rows) while finding
# which projections take them
_PACKED: contextvars.ContextVar[dict | list | None] = contextvars.ContextVar("packed_weights", default=None)
_THREADS: contextvars.ContextVar[int] = contextvars.ContextVar("gemm_threads", default=1)


@contextlib.contextmanager
def packed_weights(table: dict | list, threads: int = 1):
    """Inside: `linear` / `linears` use the (format, copy) at table[(id(weight), ...)][rows] where present, or,
    given a list, append ((weight, ...), rows) for every projection (group) that packing would serve.
    threads: what the blocked format's GEMMs are generated for (the host's, where the build measured)."""
    token, t_token = _PACKED.set(table), _THREADS.set(threads)
    try:
        yield table
    finally:
        _PACKED.reset(token)
        _THREADS.reset(t_token)


def _float_rows(x: torch.Tensor) -> int:
    """x's token rows where packing may serve it (float32), else 0."""
    k = x.shape[-1]
    return x.numel() // k if k and x.dtype == torch.float32 else 0


def _unpacked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
    """`rows`: _float_rows(x)."""
    if not 0 < rows <= SMALL_ROWS:
        return F.linear(x, weight, bias)
    y = weight_stationary(x, weight)
    return y if bias is None else y + bias


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); weight-stationary when a float32 x has at most SMALL_ROWS rows, or the packed
    copy bound for x's row count (module doc)."""
    rows, table = _float_rows(x), _PACKED.get()
    if rows and isinstance(table, list):
        table.append(((weight,), rows))
    elif rows and table is not None and rows in table.get((id(weight),), {}):
        fmt, packed = table[(id(weight),)][rows]
        y = packed_linear(x.reshape(rows, x.shape[-1]), packed, weight, bias, fmt, threads=_THREADS.get())
        return y.reshape(*x.shape[:-1], weight.shape[0])
    return _unpacked(x, weight, bias, rows)


def linears(x: torch.Tensor, *layers: nn.Linear) -> tuple[torch.Tensor, ...]:
    """Each bias-free layer applied to x, as ONE GEMM over their weights concatenated along the output dim where
    the backend packed them together (vLLM's QKVParallelLinear / MergedColumnParallelLinear; here the fused
    copy is made at load, the bundle keeps the weights apart), one each otherwise."""
    rows, table = _float_rows(x), _PACKED.get()
    weights = tuple(layer.weight for layer in layers)
    if not rows or table is None or any(layer.bias is not None for layer in layers):
        return tuple(layer(x) for layer in layers)
    if isinstance(table, list):
        table.append((weights, rows))
        return tuple(_unpacked(x, w, None, rows) for w in weights)
    key = tuple(id(w) for w in weights)
    if rows not in table.get(key, {}):  # (a format that does not fuse: each weight's own copy)
        return tuple(layer(x) for layer in layers)
    fmt, packed = table[key][rows]
    widths = [w.shape[0] for w in weights]
    y = packed_linear(x.reshape(rows, x.shape[-1]), packed, None, None, fmt, n=sum(widths), threads=_THREADS.get())
    return tuple(t.reshape(*x.shape[:-1], t.shape[-1]) for t in y.split(widths, dim=-1))


def weight_stationary(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T computed as (weight @ x.T).T, materialised row-major."""
    k = x.shape[-1]
    rows = x.numel() // k
    cols = x.reshape(rows, k)
    if rows == 1:  # as a 2-column GEMM, not MKL's matrix-vector path
        cols = cols.expand(2, k).contiguous()
    y = torch.mm(weight, cols.t())[:, :rows]
    return y.t().contiguous().reshape(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """nn.Linear (same parameters and names) whose forward follows `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
