"""Backend `export`: torch.export each graph to its own .pt2 (weights stay outside, as inputs).

The runtime runs it through `ExportedProgram.module()` (interpreted FX: portable, slowest).
"""
from __future__ import annotations

from pathlib import Path

import torch
from eagle3_runtime.backends.facts import ExportFacts

from ..files import save_through_python
from ..recipe import check_backend_options
from .per_graph import PerGraphBackend
from .pt2 import set_serialization_id

NAME = ExportFacts.name


def compile_exported(ep, out: Path, key: str, role: str) -> dict:
    ep.example_inputs = None  # would embed the (weight-sized) example inputs in the file
    save_through_python(lambda f: torch.export.save(ep, f), out)
    set_serialization_id(out, key)
    return {"format": ExportFacts.graph_format, "torch": torch.__version__}


class ExportBackend(PerGraphBackend):
    NAME = NAME
    SUFFIX = ".pt2"
    JOB_MEMORY_GB = 0.5  # per compile job, on top of the graph's inputs (none are materialised)
    MAX_JOBS = 1  # (a compile is a serialization: trivial)
    ESTIMATE_S = 0.5

    def __init__(self, backend_options: dict | None = None):
        check_backend_options(NAME, backend_options)

    def version(self) -> str:
        return torch.__version__

    def key_fields(self, role: str) -> dict:
        return {"name": NAME, "version": self.version()}

    def compile_exported(self, ep, out: Path, key: str, role: str) -> dict:
        return compile_exported(ep, out, key, role)  # the module function (tests patch it there)
