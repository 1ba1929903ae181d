"""Backend `neuron`: every graph traced with torch_neuronx.trace into a NEFF (neuronx-cc).

Per graph (REFERENCE §6):
  * the graph module keeps its weights as parameters and is traced with
    `inline_weights_to_neff=False`, so one NEFF serves every rank: the runtime binds each rank's
    weights with `torch_neuronx.replace_weights`;
  * the KV cache is an input that the traced function also returns, marked as a state tensor
    through `input_output_aliases={kv: last output}` (updated in place on the device);
  * the rank is a tensor input (never a Python int frozen into the NEFF);
  * compiler flags are chosen per graph role (NxDI's context-encoding / token-generation defaults,
    then the recipe's `compiler_args` and `role_compiler_args`); CPU-only build hosts trace with
    `cpu_backend=True` and `--target`; `NEURON_CC_FLAGS` in the environment is refused unless
    `backend_options.fold_env_flags: true`, which folds it into the recorded flags.
The artifact is the TorchScript module embedding the NEFF (`graphs/<name>.pt`, torch.jit.save) plus
the raw `graphs/<name>.neff` from the compiler workdir.

Verified here (no Neuron SDK can be installed): flag handling, the plan, the SDK/version checks,
and — with a stand-in torch_neuronx module — that each graph is traced with the right example
inputs, aliases and compiler arguments. The NEFF compile itself runs only on a host with the SDK.
"""
from __future__ import annotations

import glob
import importlib
import os
import shlex
import shutil
import tempfile
from pathlib import Path

import torch

from eagle3_runtime.manifest import PREFILL_ROLES, ROLE_MODEL

from ..errors import UserError
from . import NEURON_SDK, check_backend_options, preflight

NAME = "neuron"
SUFFIX = ".pt"

COMMON_ARGS = ["--target", "trn2", "--lnc", "2", "--model-type", "transformer", "--auto-cast", "none"]
# NxDI's per-model defaults (neuronx-distributed-inference models/model_wrapper.py, docs/neuron-sdk-facts.md §6):
# context encoding (our prefill graphs) -O1 with the modular flow; token generation and fused speculation
# (decode, verify, draft steps and catch-up) -O2 with pipeline tiling factor 1
ROLE_ARGS = {
    "context": ["-O1", "--tensorizer-options=--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=2 "
                       "--vectorize-strided-dma",
                "--internal-hlo2tensorizer-options=--modular-flow-mac-threshold=10 --verify-hlo=true"],
    "token": ["-O2", "--tensorizer-options=--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=1 "
                     "--vectorize-strided-dma",
              "--internal-hlo2tensorizer-options=--verify-hlo=true"],
}


def role_kind(role: str) -> str:
    return "context" if role in PREFILL_ROLES else "token"


# ------------------------------------------------------------------ flags

def _flag_map(args: list[str]) -> list[tuple[str, str | None]]:
    """['--target','trn2','-O1','--lnc=2'] -> [('--target','trn2'), ('-O1', None), ('--lnc','2')]."""
    out, i = [], 0
    while i < len(args):
        a = args[i]
        if "=" in a and a.startswith("--"):
            k, v = a.split("=", 1)
            out.append((k, v))
        elif a.startswith("--") and i + 1 < len(args) and not args[i + 1].startswith("-"):
            out.append((a, args[i + 1]))
            i += 1
        else:
            out.append((a, None))
        i += 1
    return out


def _args(value) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else list(value or [])


def compiler_args(backend_options: dict, role: str, environ: dict | None = None) -> list[str]:
    """One graph's neuronx-cc flags: NxDI's defaults for its role, then the recipe's
    `compiler_args` (every role), then `role_compiler_args[role]`; a flag replaces the one of the same
    name, any -O level the other. NEURON_CC_FLAGS is never applied silently."""
    environ = os.environ if environ is None else environ
    per_role = backend_options.get("role_compiler_args") or {}
    unknown = sorted(set(per_role) - set(ROLE_MODEL))
    if unknown:
        raise UserError(f"backend_options.role_compiler_args: unknown role(s) {', '.join(unknown)}; the roles are "
                        f"{', '.join(ROLE_MODEL)}")
    env_flags = shlex.split(environ.get("NEURON_CC_FLAGS", ""))
    if env_flags and not backend_options.get("fold_env_flags", False):
        raise UserError(f"NEURON_CC_FLAGS is set ({' '.join(env_flags)!r}) and would change the compiled graphs "
                        "without being recorded; unset it, or put the flags under backend_options.compiler_args, "
                        "or set backend_options.fold_env_flags: true to record them in the manifest")
    merged: dict[str, str | None] = {}
    layers = (COMMON_ARGS + ROLE_ARGS[role_kind(role)], _args(backend_options.get("compiler_args")),
              _args(per_role.get(role)), env_flags)
    for k, v in (kv for layer in layers for kv in _flag_map(layer)):
        if k.startswith("-O") and not k.startswith("--"):
            merged = {kk: vv for kk, vv in merged.items() if not (kk.startswith("-O") and not kk.startswith("--"))}
        merged[k] = v
    out = []
    for k, v in merged.items():
        if v is None:
            out.append(k)
        elif " " in v or v.startswith("-"):  # one argument: the value holds spaces or looks like a flag
            out.append(f"{k}={v}")
        else:
            out += [k, v]
    return out


def flag_value(args: list[str], name: str) -> str | None:
    return dict(_flag_map(args)).get(name)


def neuronx_cc_command(name: str, args: list[str]) -> str:
    """The neuronx-cc invocation torch_neuronx.trace runs for one graph (as the plan prints it)."""
    return shlex.join(["neuronx-cc", "compile", "--framework", "XLA", f"{name}.hlo.pb", "--output", f"{name}.neff",
                       *args])


# ------------------------------------------------------------------ SDK

def neuron_devices() -> list[str]:
    """This host's Neuron devices; none on a CPU-only build host, where torch_neuronx.trace needs
    cpu_backend=True (with --target, always in the flags)."""
    return sorted(glob.glob("/dev/neuron[0-9]*"))


def sdk_versions() -> dict[str, str]:
    """Versions of the installed Neuron SDK packages (UserError naming what is missing)."""
    preflight(NAME)
    return {dist: str(getattr(importlib.import_module(mod), "__version__", "unknown"))
            for mod, dist in NEURON_SDK.items()}


class NeuronBackend:
    """Bound to one recipe pair's options (flags are validated once, before any graph)."""

    NAME, SUFFIX = NAME, SUFFIX

    def __init__(self, backend_options: dict):
        check_backend_options(NAME, backend_options)
        self.versions = sdk_versions()  # fails fast, before any checkpoint is read
        self.role_args = {role: compiler_args(backend_options, role) for role in ROLE_MODEL}
        first = next(iter(self.role_args.values()))
        self.target = flag_value(first, "--target") or "trn2"
        self.lnc = int(flag_value(first, "--lnc") or 2)
        if any(flag_value(a, "--target") != flag_value(first, "--target") or flag_value(a, "--lnc") !=
               flag_value(first, "--lnc") for a in self.role_args.values()):
            raise UserError("backend_options.role_compiler_args: --target and --lnc must be the same for every role "
                            "(one bundle runs on one instance type)")

    def version(self) -> str:
        return self.versions["torch-neuronx"]

    def toolchain(self) -> dict[str, str]:
        return {"neuronx_cc": self.versions["neuronx-cc"], "torch_neuronx": self.versions["torch-neuronx"],
                "libneuronxla": self.versions["libneuronxla"], "neuron_target": self.target,
                "neuron_lnc": str(self.lnc)}

    JOB_MEMORY_GB = 16.0  # neuronx-cc on an 8B-class graph; plan/--jobs use it

    def key_fields(self, role: str) -> dict:
        return {"name": NAME, "versions": self.versions, "compiler_args": self.role_args[role]}

    def output_specs(self, module: torch.nn.Module, example_args: tuple):
        from .export import output_specs

        return output_specs(module, example_args)

    def compile_exported(self, ep, out: Path, key: str, role: str) -> dict:
        import torch_neuronx

        from .aoti import example_inputs

        (weights, kv, *inputs), _ = ep.example_inputs or example_inputs(ep)
        traced_fn = StatefulGraph(ep.module(), weights)
        example = (kv, *inputs)
        n_out = len(ep.graph_signature.user_outputs)
        workdir = Path(tempfile.mkdtemp(prefix=f"{out.stem}-", dir=out.parent))
        try:
            traced = torch_neuronx.trace(traced_fn, example, input_output_aliases={kv: n_out},
                                         compiler_workdir=str(workdir), compiler_args=list(self.role_args[role]),
                                         inline_weights_to_neff=False, cpu_backend=not neuron_devices())
            torch.jit.save(traced, str(out))
            neffs = sorted(workdir.rglob("*.neff"))
            if neffs:
                shutil.copyfile(neffs[0], out.with_suffix(".neff"))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        return {"format": "torchscript+neff", "param_names": traced_fn.param_names, "kv_output_index": n_out,
                "compiler_args": list(self.role_args[role]), "neff": out.with_suffix(".neff").name}


class StatefulGraph(torch.nn.Module):
    """What torch_neuronx traces: the exported graph with its weights held as real (non-inlined)
    parameters, taking (kv, rank, *inputs) and returning (*outputs, kv) so that the cache can be
    aliased as device state (the runtime binds each rank's weights by `param_names`)."""

    def __init__(self, graph: torch.nn.Module, weights: tuple[torch.Tensor, ...]):
        super().__init__()
        self.graph = graph
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(w, requires_grad=False) for w in weights])
        self.param_names = [f"weights.{i}" for i in range(len(weights))]  # names in the traced state_dict

    def forward(self, kv, *inputs):
        return (*self.graph(tuple(self.weights), kv, *inputs), kv)
