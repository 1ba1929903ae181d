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

# The two SDK generations (docs/neuron.md): NxD (SDK 2.27 - 2.31: torch-neuronx + NxD, one process drives every
# rank) and NEFF (SDK 2.32 +: the neuronx-cc CLI, libneuronxla 3, nrtpy; one NEFF per graph, a process per rank)
NXD_GENERATION, NEFF_GENERATION = "nxd", "neff"
GENERATIONS = {NXD_GENERATION: "Neuron SDK 2.27 - 2.31, torch-neuronx + neuronx-distributed",
               NEFF_GENERATION: "Neuron SDK 2.32 +, neuronx-cc + nrtpy"}
NEFF_FORMAT = "neff"  # GraphEntry.backend["format"] of a NEFF-generation graph
# the NEFF generation's packages: import name -> (key in a manifest's toolchain record, pip name)
NEFF_SDK = {"neuronxcc": ("neuronx_cc", "neuronx-cc"), "libneuronxla": ("libneuronxla", "libneuronxla"),
            "nrtpy": ("nrtpy", "nrtpy")}
NEFF_LIBNEURONXLA = 3  # libneuronxla's major version from SDK 2.32 on


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


def generation_versions() -> dict[str, str]:
    """pip name -> version of each NEFF-generation package installed."""
    found = {pip: distribution_version(pip) for _, pip in NEFF_SDK.values()}
    return {pip: v for pip, v in found.items() if v}


def host_generation() -> str | None:
    """The SDK generation this host's packages are: "nxd" where torch-neuronx and NxD are installed, "neff" where
    neuronx-cc is with nrtpy or libneuronxla 3 (and torch-neuronx is not), None where neither is."""
    if not missing():
        return NXD_GENERATION
    found = generation_versions()
    libxla = found.get("libneuronxla", "")
    if "neuronx-cc" in found and distribution_version("torch-neuronx") is None and (
            "nrtpy" in found or libxla.split(".")[0] == str(NEFF_LIBNEURONXLA)):
        return NEFF_GENERATION
    return None


def serving_generation() -> str | None:
    """The generation this host serves: "neff" where nrtpy is installed, "nxd" where torch-neuronx and NxD are."""
    if distribution_version("nrtpy"):
        return NEFF_GENERATION
    return NXD_GENERATION if not missing() else None


def generation_refusal(bundle: str, host: str) -> str:
    """One line: a bundle of generation `bundle` on a host whose Neuron SDK is generation `host`, and the fix."""
    return (f"this neuron bundle is of the {bundle} generation ({GENERATIONS[bundle]}) and this host has the {host} "
            f"generation ({GENERATIONS[host]}); rebuild the bundle with this host's SDK (`eagle3-build compile RECIPE "
            f"--backend neuron` here), or serve it on a host with the {bundle} generation's SDK")


def import_failure(mod: str) -> str | None:
    """Why `import mod` fails, in one line, or None when it imports."""
    try:
        importlib.import_module(mod)
    except Exception as e:
        return f"{type(e).__name__}({(str(e).strip().splitlines() or [''])[0][:300]!r})"
    return None
