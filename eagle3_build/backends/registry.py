"""The backend for a recipe's `backend` name, its options checked."""
from __future__ import annotations

from ..recipe import check_backend_options
from .base import Backend, preflight


def get_backend(name: str, options: dict | None = None) -> Backend:
    preflight(name)
    check_backend_options(name, options)
    if name == "export":
        from .export import ExportBackend

        return ExportBackend(options or {})
    if name == "aoti":
        from .aoti import AotiBackend

        return AotiBackend(options or {})
    from .neuron import NeuronBackend

    return NeuronBackend(options or {})
