"""The runtime backend class for a manifest's `backend` name."""
from __future__ import annotations

import importlib

from ..manifest import BundleError
from .base import RuntimeBackend
from .facts import BACKENDS

# backend name -> (module, class); a module is imported only when a bundle of its backend is read
CLASSES = {"export": ("export", "ExportBackend"), "aoti": ("aoti", "AotiBackend"),
           "neuron": ("neuron", "NeuronBackend")}
SERVABLE = BACKENDS
GENERATIONS = {("neuron", "neff"): ("neuron_neff", "NeuronNeffBackend")}  # (backend, generation) -> (module, class)


def backend_class(name: str) -> type[RuntimeBackend]:
    """The runtime backend for a manifest's `backend` (BundleError naming the ones this runtime serves)."""
    if name not in CLASSES:
        raise BundleError(f"backend {name!r} cannot be served by this runtime (available: {', '.join(SERVABLE)})")
    module, cls = CLASSES[name]
    return getattr(importlib.import_module(f"{__package__}.{module}"), cls)


def backend_for(m) -> type[RuntimeBackend]:
    """The runtime backend for a manifest: its `backend`, and for neuron its SDK generation (toolchain)."""
    gen = GENERATIONS.get((m.backend, m.toolchain.get("neuron_generation")))
    if gen is None:
        return backend_class(m.backend)
    return getattr(importlib.import_module(f"{__package__}.{gen[0]}"), gen[1])
