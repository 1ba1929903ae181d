"""How a projection is written into a graph: one rule, used by every model file.

Decode-sized graphs (target decode/verify, draft step/catch-up, the last-position lm_head) multiply a
handful of token rows by every weight matrix: memory-bound work that should cost one read of the
weights whatever the row count. Written as F.linear (y = x @ W.T, the weight as GEMM operand B,
transposed), CPU float32 GEMM does not get there: MKL's small-M path costs 1.3-1.9x more at 2-4 rows
than at 1 row, which is exactly the verify pass of K = 1..3. Written weight-stationary,

    y = (W @ x.T).T        W [N, K] row-major as operand A, the few token rows as B,

MKL runs the same product much closer to one read of the weights, and threads it. Measured on
SmolLM2-135M (benchmarks/graph_latency.py: the same K 3 bundle built both ways, calls interleaved;
benchmarks/results/smollm2-linear-ab-t{1,2}.json): target_verify b1 (4 token rows) 191 -> 128 ms at
one thread, 180 -> 78 ms at two; target_decode b1 (1 row) unchanged (99 -> 99, 89 -> 92 ms);
draft_catchup 1.2-1.6x faster. The projections alone: benchmarks/linear_layout.py.
The [N, rows] result is transposed back and materialised row-major (a transposed view would reach TP
collectives non-contiguous, which compiled code does not handle); that copy is rows x N elements,
nothing next to the weight read.

Prefill-sized inputs (more than SMALL_ROWS token rows) keep F.linear: there the GEMM is compute-bound
and MKL's usual path is the right one. The rule depends only on static shapes, so every backend traces
the same graphs (on Neuron and CUDA the compiler / cuBLAS choose their own operand layouts).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SMALL_ROWS = 8  # at most max_num_seqs * (K + 1) token rows in the demo's verify graphs


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); weight-stationary when x has at most SMALL_ROWS rows (module doc)."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if not 0 < rows <= SMALL_ROWS:
        return F.linear(x, weight, bias)
    y = weight_stationary(x, weight)
    return y if bias is None else y + bias


def weight_stationary(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T computed as (weight @ x.T).T, materialised row-major."""
    k = x.shape[-1]
    rows = x.numel() // k
    return torch.mm(weight, x.reshape(rows, k).t()).t().contiguous().reshape(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """nn.Linear (same parameters and names) whose forward follows `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
