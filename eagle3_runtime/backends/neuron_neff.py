"""Backend `neuron`, the NEFF generation (Neuron SDK 2.32 +) at run time: one NEFF per graph, run through nrtpy.

One process per rank (torchrun, rank 0 driving, as the host backends; tp.py): the process sees one NeuronCore
(`nrtpy.configure(visible_cores=[core])`, core = the rank's entry of NEURON_RT_VISIBLE_CORES, else the rank),
loads every graph's NEFF once with `NrtpyModel.load_from_neff(path, name, core_id=0, cc_enabled=tp > 1,
rank_id=rank, world_size=tp)` (every rank loads the same NEFF: the collectives' replica groups are in it),
uploads its rank's weights once (`NrtpyTensor.from_numpy`) and keeps each model's KV cache as one device
tensor, passed as the NEFF input the manifest binds to the state and as its aliased output [inferred: nrtpy
documents no aliasing; docs/neuron.md]. A call names every NEFF input (`GraphEntry.backend.neff_inputs`:
weight, state, rank, a step input by name, or a constant the lowering kept as data) and passes preallocated
output tensors; the role's outputs are read back to the host.
Refused in one line before anything loads: a bundle of the other generation, a host without nrtpy.
"""
from __future__ import annotations

import os
import shlex
from pathlib import Path

import numpy as np
import torch

from ..manifest import BundleError, Manifest
from ..reader import bundle_file
from . import neuron_sdk
from .base import BACKEND, BAD_BUNDLE, Check, Graph, RuntimeBackend
from .facts import NeuronFacts
from .host import HostBackend
from .neuron import KV_COMPACT, KV_MOVE, kv_compact_inputs, kv_move_inputs, visible_cores

BINDS = ("weight", "state", "rank", "input", "constant")
RANK_TENSOR = "rank_util.rank"


def bundle_generation(m: Manifest) -> str:
    """The SDK generation a neuron bundle was built for (bundles from before the NEFF generation: nxd)."""
    return m.toolchain.get("neuron_generation", neuron_sdk.NXD_GENERATION)


def check_manifest(m: Manifest) -> None:
    """Each graph's NEFF fields, as data: BundleError naming the graph and the field."""
    for g in m.graphs:
        b = g.backend
        ops = b.get("state_ops")
        neffs = [(g.name, b)] + ([(f"{g.name} {op}", f) for op, f in ops.items()] if isinstance(ops, dict) else [])
        for where, f in neffs:
            problem = None
            if not isinstance(f.get("neff"), str) or not isinstance(f.get("compiler_command"), list):
                problem = "backend.neff / compiler_command are missing"
            elif not isinstance(f.get("neff_inputs"), list) or not isinstance(f.get("neff_outputs"), list):
                problem = "backend.neff_inputs / neff_outputs are missing"
            elif any(not isinstance(p, dict) or p.get("binds") not in BINDS or not isinstance(p.get("name"), str)
                     for p in f["neff_inputs"]):
                problem = f"a neff input binds to none of {', '.join(BINDS)}"
            elif sum(o.get("binds") == "state" for o in f["neff_outputs"] if isinstance(o, dict)) != 1 or \
                    sum(p["binds"] == "state" for p in f["neff_inputs"]) != 1:
                problem = "the KV state is not exactly one NEFF input and its one aliased output"
            if problem:
                raise BundleError(f"graph {where}: {problem}; rebuild the bundle with `eagle3-build compile RECIPE "
                                  "--backend neuron` on a Neuron SDK 2.32 + host")
        names = {s.name for s in g.inputs[1:]}
        unknown = [p["input"] for p in b["neff_inputs"] if p["binds"] == "input" and p.get("input") not in names]
        if unknown or ops is None:
            raise BundleError(f"graph {g.name}: its NEFF inputs name {unknown or 'no state_ops'}, not inputs of the "
                              "graph; rebuild the bundle")


def host_problem(m: Manifest) -> str | None:
    """Why this host cannot serve the bundle's NEFFs (one line), or None."""
    if bundle_generation(m) != neuron_sdk.NEFF_GENERATION:
        return neuron_sdk.generation_refusal(bundle_generation(m), neuron_sdk.NEFF_GENERATION)
    if neuron_sdk.distribution_version("nrtpy") is None:
        host = neuron_sdk.serving_generation()
        if host is not None and host != neuron_sdk.NEFF_GENERATION:
            return neuron_sdk.generation_refusal(neuron_sdk.NEFF_GENERATION, host)
        return (f"this bundle's graphs are NEFFs of the neff generation ({neuron_sdk.GENERATIONS['neff']}), run "
                "through nrtpy, which is not installed; install the Neuron SDK's nrtpy "
                f"(nrtpy=={m.toolchain.get('nrtpy', '2.34')}, pip.repos.neuron.amazonaws.com) on the Neuron host, "
                "or rebuild the recipe with backend export")
    return None


def np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":  # (numpy has no bfloat16: nrtpy takes ml_dtypes')
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def to_numpy(x: torch.Tensor) -> np.ndarray:
    if x.dtype == torch.bfloat16:  # (numpy has no bfloat16: nrtpy takes ml_dtypes')
        import ml_dtypes

        return x.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x.contiguous().numpy()


def to_torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(a))


class NeffModel:
    """One NEFF loaded on this rank's core, called by input name with this rank's device tensors."""

    def __init__(self, nrtpy, path: Path, fields: dict, bound: dict, kv, rank: int, tp: int):
        self.fields, self.nrtpy = fields, nrtpy
        self.model = nrtpy.NrtpyModel.load_from_neff(str(path), name=path.stem, core_id=0, cc_enabled=tp > 1,
                                                     rank_id=rank, world_size=tp)
        self.fixed, self.inputs = {}, {}  # NEFF input name -> device tensor (weights, state, rank, constants)
        for p in fields["neff_inputs"]:
            if p["binds"] == "input":
                self.inputs[p["name"]] = p["input"]
            elif p["binds"] == "constant":
                value = np.frombuffer(bytes.fromhex(p["data"]), dtype=np_dtype(p["dtype"])).reshape(p["shape"])
                self.fixed[p["name"]] = nrtpy.NrtpyTensor.from_numpy(value, name=p["name"])
            elif p["binds"] == "state":
                self.fixed[p["name"]] = kv
            else:
                self.fixed[p["name"]] = bound[RANK_TENSOR if p["binds"] == "rank" else p["tensor"]]
        self.outputs = {}  # NEFF output name -> its preallocated device tensor (the state: the KV cache itself)
        info = self.model.output_tensors_info
        for o in fields["neff_outputs"]:
            if o["binds"] == "state":
                self.outputs[o["name"]] = kv
            else:
                meta = info[o["name"]]
                self.outputs[o["name"]] = nrtpy.NrtpyTensor.from_numpy(
                    np.zeros(meta.shape, dtype=meta.dtype), name=o["name"])
        self.returns = [(o["output"], o["name"]) for o in fields["neff_outputs"] if o["binds"] == "output"]

    def __call__(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        call = dict(self.fixed)
        for neff_name, name in self.inputs.items():
            call[neff_name] = self.nrtpy.NrtpyTensor.from_numpy(to_numpy(inputs[name]), name=neff_name)
        self.model(inputs=call, outputs=self.outputs)
        return {name: to_torch(self.outputs[neff_name].numpy()) for name, neff_name in self.returns}


class NeuronNeffBackend(NeuronFacts, RuntimeBackend):
    """This process's rank of a NEFF-generation bundle: its NEFFs, weights and KV caches on its NeuronCore."""

    spmd = False
    state_on_host = False
    native_code = True
    graph_kind = "a NEFF per graph (graphs/<graph>.neff)"
    join_world = HostBackend.__dict__["join_world"]  # (torchrun, one process per rank)

    @classmethod
    def host_checks(cls, m: Manifest, environ) -> list[Check]:
        problem = host_problem(m)
        if problem:
            return [Check("backend", False, problem, BACKEND)]
        return [Check("backend", True, f"nrtpy {neuron_sdk.distribution_version('nrtpy')} installed (neff generation)")]

    @classmethod
    def manifest_checks(cls, m: Manifest, root: Path) -> list[Check]:
        try:
            check_manifest(m)
        except BundleError as e:
            return [Check("neff calls", False, str(e), BAD_BUNDLE)]
        return [Check("neff calls", True, f"{len(m.graphs)} graph entries bind every NEFF input and output")]

    @classmethod
    def describe_model(cls, m: Manifest, model: str) -> list[str]:
        """Each graph's NEFF, its HLO and the compiler command that made it."""
        graphs = [g for g in m.graphs if g.model == model]
        lines = [f"neuron generation {bundle_generation(m)} ({neuron_sdk.GENERATIONS[bundle_generation(m)]})"]
        fields = [(g.name, g.backend) for g in graphs] + list(graphs[0].backend.get("state_ops", {}).items())
        for name, f in fields:
            lines.append(f"{name}: {f['neff']} from {f['hlo']}: {shlex.join(f['compiler_command'])}")
        return lines + [f"{w.path}  {w.size / 1e6:.2f} MB" for w in m.models[model].weight_files]

    def __init__(self, root: Path, m: Manifest, rank: int):
        super().__init__(root, m, rank)
        problem = host_problem(m)
        if problem:
            raise BundleError(f"{self.root}: {problem}")
        check_manifest(m)
        import nrtpy
        from safetensors.numpy import load_file

        tp = m.tp_degree
        cores = visible_cores(os.environ["NEURON_RT_VISIBLE_CORES"]) if os.environ.get("NEURON_RT_VISIBLE_CORES") \
            else list(range(tp))
        if len(cores) < tp:
            raise BundleError(f"{self.root}: NEURON_RT_VISIBLE_CORES names {len(cores)} NeuronCore(s) and this bundle "
                              f"runs {tp} ranks, one core each; widen it to {tp} cores")
        try:
            nrtpy.configure(visible_cores=[cores[rank]])
        except RuntimeError as e:
            raise BundleError(f"{self.root}: nrtpy's runtime is already active in this process ({e}); serve one "
                              "bundle per process") from e
        kv = {s.name: nrtpy.NrtpyTensor.from_numpy(np.zeros(s.shape, dtype=np_dtype(s.dtype)), name=s.name)
              for s in m.state}
        self.neffs: dict[str, NeffModel] = {}
        self.ops: dict[str, dict[str, NeffModel]] = {}
        for name, model in m.models.items():
            arrays = load_file(bundle_file(self.root, model.weight_files[rank].path))
            bound = {k: nrtpy.NrtpyTensor.from_numpy(a, name=k) for k, a in arrays.items()}  # once per rank
            graphs = [g for g in m.graphs if g.model == name]
            for g in graphs:
                self.neffs[g.name] = NeffModel(nrtpy, bundle_file(self.root, g.backend["neff"]), g.backend, bound,
                                               kv[g.state], rank, tp)
            self.ops[name] = {op: NeffModel(nrtpy, bundle_file(self.root, f["neff"]), f, bound, kv[graphs[0].state],
                                            rank, tp) for op, f in graphs[0].backend["state_ops"].items()}
        for g in m.graphs:
            self.graphs[g.name] = Graph(g, self._graph_fn(g), (), torch.zeros(0), torch.zeros(1, dtype=torch.int64))

    def _graph_fn(self, g):
        neff, names = self.neffs[g.name], [s.name for s in g.inputs[1:]]
        outputs = [s.name for s in g.outputs]

        def run(_weights, _kv, _rank, *inputs):
            out = neff(dict(zip(names, inputs)))
            return tuple(out[n].to(torch.int64) if not out[n].dtype.is_floating_point else out[n] for n in outputs)

        return run

    def copy_kv_row(self, src: int, dst: int) -> None:
        for ops in self.ops.values():
            ops[KV_MOVE]({"src_dst": kv_move_inputs(src, dst, 1)[0]})

    def compact_kv(self, row: int, src: list[int], dst: list[int]) -> None:
        op = self.ops["target"].get(KV_COMPACT)
        if op is None:
            raise BundleError(f"{self.root}: the target of this neuron bundle has no kv_compact NEFF (token trees need "
                              "it); rebuild the bundle with `eagle3-build compile RECIPE --backend neuron`")
        pairs = (next(p["shape"][0] for p in op.fields["neff_inputs"] if p["binds"] == "input") - 1) // 2
        op({"row_src_dst": kv_compact_inputs(row, src, dst, pairs, 1)[0]})
