"""Backend `export`: torch.export each graph to its own .pt2 (weights stay outside, as inputs).

The runtime runs it through `ExportedProgram.module()` (interpreted FX: portable, slowest).
"""
from __future__ import annotations

from pathlib import Path

import torch

from .pt2 import set_serialization_id

NAME = "export"
SUFFIX = ".pt2"
JOB_MEMORY_GB = 0.5  # per compile job, on top of the graph's inputs (none are materialised)


def version() -> str:
    return torch.__version__


def key_fields(role: str) -> dict:
    return {"name": NAME, "version": version()}


def toolchain() -> dict[str, str]:
    return {}


def compile_exported(ep, out: Path, key: str, role: str) -> dict:
    ep.example_inputs = None  # would embed the (weight-sized) example inputs in the file
    torch.export.save(ep, out)
    set_serialization_id(out, key)
    return {"format": "torch.export", "torch": torch.__version__}


def output_specs(module: torch.nn.Module, example_args: tuple) -> list[tuple[list[int], torch.dtype]]:
    """Shapes/dtypes of a graph's outputs, from a meta-device run (no real compute)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else tuple(mode.from_tensor(t) for t in a)
                for a in example_args]
        outs = module(*fake)
    return [(list(o.shape), o.dtype) for o in outs]
