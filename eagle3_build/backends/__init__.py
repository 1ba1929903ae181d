"""Backends turn an exported graph (torch.export.ExportedProgram) into a graph file. Each exposes
NAME, SUFFIX, JOB_MEMORY_GB (per parallel compile job), version(), key_fields(role) (what enters the
compile-cache key besides the graph), toolchain() (extra manifest entries),
output_specs(module, example_args) and compile_exported(ep, out_path, key, role) -> info dict (the role
selects per-role options). An SPMD backend (neuron: `SPMD = True`) compiles per model instead,
`compile_model(model_graphs, tp, out_dir)`: one artifact holding every role, bucket and rank.

`preflight` runs before anything heavy (no torch import), so a missing SDK fails in well under a second.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util

from ..errors import UserError

BACKENDS = ("export", "aoti", "neuron")
# the backend_options each backend understands (checked by the recipe, with its line, and by get_backend)
BACKEND_OPTIONS = {"export": (), "aoti": ("device", "inductor_configs"), "neuron": ("compiler_args", "role_compiler_args", "fold_env_flags")}
NEURON_SDK = {"torch_neuronx": "torch-neuronx", "neuronxcc": "neuronx-cc", "libneuronxla": "libneuronxla",
              "neuronx_distributed": "neuronx-distributed"}
NEURON_INSTALL_HINT = (
    "install the Neuron SDK from the Neuron pip repository on a trn1/trn2/inf2 or compile host "
    "(pip install --extra-index-url https://pip.repos.neuron.amazonaws.com torch-neuronx neuronx-cc "
    "libneuronxla neuronx-distributed, or `pip install eagle3-build[neuron]` with that index; PyPI only has "
    "placeholder packages by those names)")


def missing_neuron_sdk() -> list[str]:
    """The SDK packages that are absent, or are PyPI's "WRONG PACKAGE" placeholders (found, but importing
    them raises); read from the installed metadata, without importing anything."""
    return [dist for mod, dist in NEURON_SDK.items() if importlib.util.find_spec(mod) is None or _placeholder(dist)]


def _placeholder(dist: str) -> bool:
    try:
        meta = importlib.metadata.metadata(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return "WRONG PACKAGE" in f"{meta.get('Summary', '')} {meta.get_payload() or ''}"


def preflight(name: str) -> None:
    if name not in BACKENDS:
        raise UserError(f"backend {name!r}: choose one of {', '.join(BACKENDS)}")
    if name == "neuron":
        missing = missing_neuron_sdk()
        if missing:
            raise UserError(
                f"backend neuron needs the Neuron SDK and {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not installed (or only PyPI's placeholder): "
                f"{NEURON_INSTALL_HINT}. Without the SDK, "
                "`eagle3-build plan RECIPE --backend neuron` lists every NEFF with its exact compiler command")


def unknown_option_message(name: str, key) -> str | None:
    """Why `key` is not a backend_options key of backend `name` (None if it is one)."""
    accepted = BACKEND_OPTIONS[name]
    if key in accepted:
        return None
    takes = f"it takes {', '.join(accepted)}" if accepted else "it takes no options"
    return f"unknown option {key!r} for backend {name} ({takes})"


def check_backend_options(name: str, options: dict | None) -> None:
    for key in options or {}:
        message = unknown_option_message(name, key)
        if message:
            raise UserError(f"backend_options.{key}: {message}")


def get_backend(name: str, options: dict | None = None):
    preflight(name)
    check_backend_options(name, options)
    if name == "export":
        from . import export

        return export
    if name == "aoti":
        from .aoti import AotiBackend

        return AotiBackend(options or {})
    from .neuron import NeuronBackend

    return NeuronBackend(options or {})
