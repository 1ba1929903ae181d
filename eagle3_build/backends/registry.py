"""The backend for a recipe's `backend` name: its class (what `plan` asks, no SDK needed) or an instance
(its SDK checked, its options validated)."""
from __future__ import annotations

import importlib

from ..recipe import check_backend_options
from .base import Backend, preflight

CLASSES = {"export": ("export", "ExportBackend"), "aoti": ("aoti", "AotiBackend"),
           "neuron": ("neuron.backend", "NeuronBackend")}


def backend_class(name: str) -> type[Backend]:
    if name not in CLASSES:
        preflight(name)  # (its one error line for an unknown backend)
    module, cls = CLASSES[name]
    return getattr(importlib.import_module(f"{__package__}.{module}"), cls)


def get_backend(name: str, options: dict | None = None) -> Backend:
    preflight(name)
    check_backend_options(name, options)
    return backend_class(name)(options or {})
