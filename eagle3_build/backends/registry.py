"""The backend for a recipe's `backend` name: its class (what `plan` asks, no SDK needed) or an instance
(its SDK checked, its options validated); `preflight` runs before anything heavy (no torch import), so a
missing SDK fails in well under a second."""
from __future__ import annotations

import importlib

from eagle3_runtime.backends.facts import BACKENDS

from ..errors import UserError
from ..recipe import check_backend_options
from .base import Backend

# backend name -> (module, class); a module is imported only when its backend is used
CLASSES = {"export": ("export", "ExportBackend"), "aoti": ("aoti", "AotiBackend"),
           "neuron": ("neuron.backend", "NeuronBackend")}
SDK_CHECKS = {"neuron": "neuron.sdk"}  # backend name -> its torch-free module whose check_sdk() preflight runs


def preflight(name: str) -> None:
    if name not in BACKENDS:
        raise UserError(f"backend {name!r}: choose one of {', '.join(BACKENDS)}")
    if name in SDK_CHECKS:
        importlib.import_module(f"{__package__}.{SDK_CHECKS[name]}").check_sdk()


def backend_class(name: str) -> type[Backend]:
    if name not in CLASSES:
        preflight(name)  # (its one error line for an unknown backend)
    module, cls = CLASSES[name]
    return getattr(importlib.import_module(f"{__package__}.{module}"), cls)


def get_backend(name: str, options: dict | None = None) -> Backend:
    preflight(name)
    check_backend_options(name, options)
    return backend_class(name)(options or {})
