"""How a projection is written into a graph: one rule, used by every model file.

Up to SMALL_ROWS token rows (decode-sized graphs) it is computed weight-stationary, y = (W @ x.T).T,
materialised row-major, which CPU GEMM runs close to one read of the weights; more rows keep
F.linear. Why, and the measurements: docs/linear-layout.md.
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
