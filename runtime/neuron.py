"""Loading NEFF bundles (backend `neuron`): check the host against the manifest, then load.

Before any graph is loaded: the Neuron SDK must be importable and its versions must equal the ones
the bundle was compiled with; the logical-core setting (lnc) must match; the instance must have at
least tp_degree logical NeuronCores. Each failure names the fix. Verified here with stand-in
modules; loading and running a real NEFF happens only on a Neuron host.
"""
from __future__ import annotations

import glob
import importlib
import os
from pathlib import Path
from typing import Callable

import torch

from .manifest import GraphEntry, Manifest

SDK = {"torch_neuronx": "torch_neuronx", "neuronxcc": "neuronx_cc", "libneuronxla": "libneuronxla"}
PIP_NAMES = {"torch_neuronx": "torch-neuronx", "neuronx_cc": "neuronx-cc", "libneuronxla": "libneuronxla"}
PHYSICAL_CORES_PER_DEVICE = {"trn2": 8, "trn1": 2, "inf2": 2}
DEFAULT_LNC = {"trn2": 2, "trn1": 1, "inf2": 1}


class NeuronHostError(Exception):
    pass


def installed_versions() -> dict[str, str]:
    out = {}
    for mod, key in SDK.items():
        try:
            out[key] = str(getattr(importlib.import_module(mod), "__version__", "unknown"))
        except Exception:
            pass
    return out


def logical_cores(target: str, lnc: int, environ: dict, devices: list[str]) -> int:
    if environ.get("NEURON_RT_NUM_CORES"):
        return int(environ["NEURON_RT_NUM_CORES"])
    return len(devices) * PHYSICAL_CORES_PER_DEVICE.get(target, 2) // max(lnc, 1)


def check_host(m: Manifest, *, environ: dict | None = None, devices: list[str] | None = None,
               versions: dict[str, str] | None = None) -> None:
    """Raise NeuronHostError with the fix when this host cannot run the bundle."""
    environ = os.environ if environ is None else environ
    devices = sorted(glob.glob("/dev/neuron[0-9]*")) if devices is None else devices
    versions = installed_versions() if versions is None else versions
    tc = m.toolchain
    missing = [PIP_NAMES[k] for k in SDK.values() if k not in versions]
    if missing:
        raise NeuronHostError(f"this bundle's graphs are NEFFs and {', '.join(missing)} "
                              f"{'is' if len(missing) == 1 else 'are'} not installed; install the Neuron SDK it was "
                              f"built with (torch-neuronx=={tc.get('torch_neuronx')}, neuronx-cc=={tc.get('neuronx_cc')}, "
                              f"libneuronxla=={tc.get('libneuronxla')}) or rebuild the recipe with backend export")
    for key in SDK.values():
        if tc.get(key) and versions[key] != tc[key]:
            raise NeuronHostError(f"bundle compiled with {PIP_NAMES[key]} {tc[key]}, this host has {versions[key]}; "
                                  f"rebuild it here (eagle3-build compile RECIPE --backend neuron) or install "
                                  f"{PIP_NAMES[key]}=={tc[key]}")
    target = tc.get("neuron_target", "trn2")
    lnc = int(tc.get("neuron_lnc", DEFAULT_LNC.get(target, 1)))
    host_lnc = int(environ.get("NEURON_LOGICAL_NC_CONFIG", DEFAULT_LNC.get(target, 1)))
    if host_lnc != lnc:
        raise NeuronHostError(f"bundle compiled for lnc {lnc} but the runtime uses lnc {host_lnc}; "
                              f"set NEURON_LOGICAL_NC_CONFIG={lnc} or rebuild with --lnc {host_lnc}")
    cores = logical_cores(target, lnc, environ, devices)
    if cores < m.tp_degree:
        raise NeuronHostError(f"bundle needs {m.tp_degree} logical NeuronCores (tp_degree {m.tp_degree}, lnc {lnc}, "
                              f"target {target}), this instance has {cores}; use a larger instance or rebuild "
                              "with a smaller parallel.tp_degree")


def load_graph(path: Path, entry: GraphEntry, weights: tuple[torch.Tensor, ...]) -> Callable:
    """torch.jit.load the NEFF module and bind this rank's weights (traced with inline_weights_to_neff=False)."""
    import torch_neuronx

    model = torch.jit.load(str(path))
    names = entry.backend["param_names"]
    torch_neuronx.replace_weights(model, dict(zip(names, weights)))

    def run(_weights, kv, *inputs):
        out = model(kv, *inputs)
        return tuple(out[:-1])  # the last output is the KV cache, aliased in place on the device

    return run
