"""Weights -> per-rank safetensors files (weights/<model>/rank<r>.safetensors).

Tensors are read one at a time from the source, cast to the bundle dtype (integer tensors such as
d2t keep their dtype) and written in canonical names, so the bytes depend only on the recipe and
the checkpoint contents.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from .checkpoints import TensorSource
from .errors import UserError


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


def write_rank_files(tensors: TensorSource, names: list[str], dtype: torch.dtype, out_dir: Path,
                     tp_degree: int) -> list[Path]:
    if tp_degree != 1:
        raise UserError(f"tp_degree {tp_degree}: this build writes TP 1 bundles only; set parallel.tp_degree: 1")
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {n: cast(tensors.get(n), dtype).contiguous() for n in names}
    path = out_dir / "rank0.safetensors"
    # one metadata key only: safetensors writes metadata in hash-map order, which varies per run
    save_file(data, path, metadata={"format": "pt"})
    return [path]
