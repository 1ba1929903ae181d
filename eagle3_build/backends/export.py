"""Backend `export`: torch.export each graph to its own .pt2 (weights stay outside, as inputs)."""
from __future__ import annotations

from pathlib import Path

import torch

NAME = "export"
SUFFIX = ".pt2"


def version() -> str:
    return torch.__version__


def compile_graph(module: torch.nn.Module, example_args: tuple, out: Path) -> dict:
    ep = torch.export.export(module, example_args, strict=False)
    ep.example_inputs = None  # would embed the (weight-sized) example inputs in the file
    torch.export.save(ep, out)
    return {"format": "torch.export", "torch": torch.__version__}


def output_specs(module: torch.nn.Module, example_args: tuple) -> list[tuple[list[int], torch.dtype]]:
    """Shapes/dtypes of a graph's outputs, from a meta-device run (no real compute)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else tuple(mode.from_tensor(t) for t in a)
                for a in example_args]
        outs = module(*fake)
    return [(list(o.shape), o.dtype) for o in outs]
