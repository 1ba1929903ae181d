"""How a projection is written into a graph: one rule, used by every model file.

In float32, up to SMALL_ROWS token rows (decode, verify and tree-verify graphs) it is computed
weight-stationary, y = (W @ x.T).T, materialised row-major, which CPU GEMM runs close to one read of the
weights; a single row is computed as two (MKL's matrix-vector path is slower). More rows, and every other dtype,
keep F.linear. Why: docs/linear-layout.md.

A backend that lays projection weights out its own way (aoti on CPU: copies packed at load) passes its
`LinearMethod` to the graph module (graphs.BoundGraph), as vLLM's linear layers ask their quant method for the
call: every projection goes through `project`, which asks the method of the module that owns the weight.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

SMALL_ROWS = 32  # covers max_num_seqs x tree nodes of the demo's verify graphs (docs/linear-layout.md)


class LinearMethod:
    """How a graph computes its projections; this one follows `linear` (module doc). A method may take graph
    inputs after the weights (`bind`: the copies it reads) and fuse projections of one input (`apply` gets them
    together)."""

    def bind(self, extra: tuple[torch.Tensor, ...]):
        """Inside: the graph inputs after the weights are this call's (none for this method)."""
        if extra:
            raise ValueError(f"{type(self).__name__} takes no inputs after the weights, got {len(extra)}")
        return contextlib.nullcontext()

    def apply(self, layers: tuple[nn.Module, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each layer's weight (and bias) applied to x."""
        return tuple(linear(x, layer.weight, getattr(layer, "bias", None)) for layer in layers)


UNPACKED = LinearMethod()


def method_of(layer: nn.Module) -> LinearMethod:
    return layer.__dict__.get("linear_method", UNPACKED)


@contextlib.contextmanager
def using(model: nn.Module, method: LinearMethod):
    """Inside: every projection of `model` goes through `method`; each module knows its name in `model`
    (`projection_name`: what a method keys its layers by)."""
    modules = list(model.named_modules())
    for name, module in modules:
        module.__dict__["linear_method"], module.__dict__["projection_name"] = method, name
    try:
        yield
    finally:
        for _, module in modules:
            module.__dict__.pop("linear_method", None)
            module.__dict__.pop("projection_name", None)


def project(x: torch.Tensor, *layers: nn.Module) -> tuple[torch.Tensor, ...]:
    """Each layer's weight applied to x through its module's method: projections of one input (q, k, v; gate, up)
    given together, which a method may run as one GEMM (vLLM's QKVParallelLinear)."""
    return method_of(layers[0]).apply(layers, x)


def float_rows(x: torch.Tensor) -> int:
    """x's token rows where a float32 projection may take another layout, else 0."""
    k = x.shape[-1]
    return x.numel() // k if k and x.dtype == torch.float32 else 0


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); weight-stationary when a float32 x has at most SMALL_ROWS rows."""
    if not 0 < float_rows(x) <= SMALL_ROWS:
        return F.linear(x, weight, bias)
    y = weight_stationary(x, weight)
    return y if bias is None else y + bias


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
    """nn.Linear (same parameters and names) whose forward goes through its method (`project`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self)[0]
