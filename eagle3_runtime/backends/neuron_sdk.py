"""The Neuron SDK's Python packages on this host, read without importing torch or the SDK: which are
installed (a PyPI "WRONG PACKAGE" placeholder of the same name is not) and at which version.

A version is the installed distribution's (`importlib.metadata`), never a module's `__version__`: NxD's
source declares "0.16.0" for wheel 0.16.25997 (setup.py adds VERSION_PATCH), libneuronxla may declare none.
Shared by the builder (which release it compiles for) and the runtime (the bundle's versions, exactly)."""
from __future__ import annotations

import importlib
import importlib.metadata

# the SDK's packages: import name -> (key in a manifest's toolchain record, pip name)
NEURON_SDK = {"torch_neuronx": ("torch_neuronx", "torch-neuronx"), "neuronxcc": ("neuronx_cc", "neuronx-cc"),
              "libneuronxla": ("libneuronxla", "libneuronxla"),
              "neuronx_distributed": ("neuronx_distributed", "neuronx-distributed")}
NXDI = "neuronx-distributed-inference"  # not used by eagle3-build; it tells two releases apart where installed


def distribution_version(pip: str) -> str | None:
    """The installed distribution's version; None where it is absent or PyPI's placeholder of that name."""
    try:
        meta = importlib.metadata.metadata(pip)
    except importlib.metadata.PackageNotFoundError:
        return None
    return None if "WRONG PACKAGE" in f"{meta.get('Summary', '')} {meta.get_payload() or ''}" else meta["Version"]


def missing() -> list[str]:
    """The SDK packages (pip names) that are absent or only the placeholder."""
    return [pip for _, pip in NEURON_SDK.values() if distribution_version(pip) is None]


def installed_versions() -> dict[str, str]:
    """pip name -> version of every SDK package installed (NxD Inference included where it is)."""
    found = {pip: distribution_version(pip) for pip in [*(p for _, p in NEURON_SDK.values()), NXDI]}
    return {pip: v for pip, v in found.items() if v}


def import_failure(mod: str) -> str | None:
    """Why `import mod` fails, in one line, or None when it imports."""
    try:
        importlib.import_module(mod)
    except Exception as e:
        return f"{type(e).__name__}({(str(e).strip().splitlines() or [''])[0][:300]!r})"
    return None
