"""Which tensors of a model are its weights: the one rule the checks, graphs, sharding and plan share."""
from __future__ import annotations

import torch
from torch import nn


def weight_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters, then persistent buffers (the draft's d2t; not RoPE's inv_freq), in a stable order:
    what a checkpoint must hold, a graph binds and a bundle ships."""
    nonpersistent = set().union(*(m._non_persistent_buffers_set for m in model.modules()))
    out = dict(model.named_parameters())
    out.update((n, b) for n, b in model.named_buffers() if n.split(".")[-1] not in nonpersistent)
    return out
