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

from eagle3_runtime.manifest import BACKENDS

from ..errors import UserError

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
