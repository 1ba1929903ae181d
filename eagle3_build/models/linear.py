"""How a projection is written into a graph: one rule, used by every model file.

Decode-sized graphs (target decode/verify, draft step/catch-up, the last-position lm_head of a
prefill) multiply a handful of token rows by every weight matrix: memory-bound work that should cost
one read of the weights whatever the row count. On CPU, MKL's float32 GEMM does not get there for
small M (it packs the weight panel on every call): measured here on SmolLM2-135M's 211 projections
alone, one thread, AOTInductor, 1 row 66 ms, 4 rows 121 ms. Written as row dot-products,

    y[m, n] = sum_k x[m, k] * W[n, k]      as   (W[:, None, :] * x[None, :, :]).sum(-1).T

Inductor emits one loop per projection - weight row n outer, the token rows inner, a vectorised
reduction over k - which reads each weight row once for all token rows: 60 ms for 1 row, 83 ms for 4
(same 211 projections, each fed from a graph input). Each row's result is also independent of how
many rows share the call.

EXPERIMENTAL, off by default (`backend_options.small_matmul_rows`, aoti only). Inside a whole model
graph it is not yet a win: Inductor fuses each row-dot reduction with the RMSNorm / residual /
activation around it and lays the intermediate [n, rows] buffers out row-minor, so the next
projection vectorises across the (4) token rows instead of k. Measured on the SmolLM2 demo bundle:
target_decode b1 67 ms (fine: one row), but target_verify b1 (4 rows) 800 ms and target_decode b2
787 ms, against ~110 / ~75 ms with F.linear. Making it pay needs the activations pinned to a
row-major layout between projections (a layout barrier Inductor cannot fuse through).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

_SMALL_ROWS: ContextVar[int] = ContextVar("eagle3_small_matmul_rows", default=0)


@contextmanager
def small_matmul_rows(rows: int) -> Iterator[None]:
    """While tracing: projections of at most `rows` token rows use the row-dot form (0 = never)."""
    token = _SMALL_ROWS.set(int(rows))
    try:
        yield
    finally:
        _SMALL_ROWS.reset(token)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), written as row dot-products when x has few rows (see the module doc)."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if not 0 < rows <= _SMALL_ROWS.get():
        return F.linear(x, weight, bias)
    # [N, rows] -> [rows, N] materialised: a transposed view would reach collectives (TP all-reduce /
    # all-gather) non-contiguous, which compiled code does not handle
    y = (weight.unsqueeze(1) * x.reshape(1, rows, k)).sum(-1).t().contiguous().reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


class Linear(nn.Linear):
    """nn.Linear (same parameters and names) whose forward follows `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
