"""Backends turn a traced graph module into a graph file. Each exposes NAME, SUFFIX, version(),
compile_graph(module, example_args, out_path) -> info dict and output_specs(module, example_args)."""
from __future__ import annotations

from ..errors import UserError

BACKENDS = ("export", "aoti", "neuron")


def get_backend(name: str):
    if name == "export":
        from . import export

        return export
    raise UserError(f"backend {name!r} is not available in this build (available: export)")
