"""Backend `neuron` at run time: NEFF bundles, one process drives every rank.

A neuron bundle holds one NxD model per model (graphs/target.pt, graphs/draft.pt: every graph role
and bucket, compiled SPMD) and NxD's per-rank checkpoints (weights/<model>/tp<r>_sharded_checkpoint.
safetensors). Loading is NxDI's: `torch.jit.load`, then `nxd_model.initialize(per-rank weight dicts,
start_rank int32)`; the KV caches are device state (zeroed by initialize, shared by every key) and
never cross to the host; a call `model(*inputs)` runs on every rank and returns rank 0's outputs
(docs/neuron-sdk-facts.md §2). The row move of continuous batching is the model's `kv_move` key; a
bundle that speculates with token trees also has the target's `kv_compact` key, which moves the
accepted path's KV slots into place within one row (`NxDModel.compact`).
Cores come from NEURON_RT_VISIBLE_CORES (the Neuron runtime reserves every visible core for one
process, so torchrun with a process per rank cannot work and is refused).

Before anything is loaded: the Neuron SDK must be importable and its versions must equal the ones the
bundle was compiled with; the logical-core setting (lnc) must match; the instance must have at least
tp_degree logical NeuronCores; each graph entry's NxD call fields must be sound (`nxd_call`), and a
tree bundle's target must have its kv_compact key.
Each failure names the fix.
"""
from __future__ import annotations

import glob
import hashlib
import io
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import Eagle3Error
from ..manifest import MANIFEST, BundleError, FileEntry, Manifest, torch_dtype
from ..reader import bundle_file
from ..speculation import all_shapes
from . import neuron_sdk
from .base import BACKEND, BAD_BUNDLE, DEVICE, Check, Graph, RuntimeBackend, TPContext, world_size
from .facts import NeuronFacts

SDK = {mod: key for mod, (key, _) in neuron_sdk.NEURON_SDK.items()}  # import name -> toolchain key
PIP_NAMES = dict(neuron_sdk.NEURON_SDK.values())  # toolchain key -> pip name
PHYSICAL_CORES_PER_DEVICE = {"trn2": 8, "trn1": 2, "inf2": 2}
DEFAULT_LNC = {"trn2": 2, "trn1": 1, "inf2": 1}

# The call contract of an NxD model, shared with the builder (eagle3_build/backends/neuron/)
NXD_FORMAT = NeuronFacts.graph_format
KV_MOVE = "kv_move"  # the key that moves one KV-cache row: inputs (src_dst int32 [2], placeholders...)
PLACEHOLDER_DTYPE = torch.int32  # zero-size inputs pad every call to the model's arity (NxDI: torch.empty(0))


def routing_signature(inputs) -> str:
    """What NxD routes a call by: the list of input shapes (spmd.py NxDModel.router)."""
    return str([list(x.shape) for x in inputs])


def padded(inputs, arity: int) -> tuple[torch.Tensor, ...]:
    return (*inputs, *[torch.zeros(0, dtype=PLACEHOLDER_DTYPE)] * (arity - len(inputs)))


def kv_move_inputs(src: int, dst: int, arity: int) -> tuple[torch.Tensor, ...]:
    return padded([torch.tensor([src, dst], dtype=torch.int32)], arity)


# The target's KV compaction after a tree verify (token trees only: a chain never moves KV). Inputs
# (row_src_dst int32 [1 + 2 * pairs], placeholders...): the row, `pairs` source slots, `pairs` destination
# slots; every source slot is read before any is written. Unused pairs repeat the last real pair (the
# same value written to the same slot again: a true no-op whatever order the scatter writes in).
# [1 + 2 * pairs] with pairs >= 2 is at least 5 long, so it never routes like kv_move's [2].
KV_COMPACT = "kv_compact"
COMPACT_FIELD = "kv_compact_pairs"  # on every target graph entry's `backend` of a tree bundle: `pairs`


def is_tree(shapes) -> bool:
    """Whether any of these speculation shapes is a token tree (a dynamic tree with topk > 1 or a static one)."""
    return any(s.topk > 1 or s.choices for s in shapes)


def compact_pairs(shapes) -> int | None:
    """The kv_compact key's pair count for these speculation shapes (the deepest path with its bonus token,
    T = depth + 1), or None where no shape is a tree."""
    shapes = list(shapes)
    return max(s.depth for s in shapes) + 1 if is_tree(shapes) else None


def kv_compact_inputs(row: int, src: list[int], dst: list[int], pairs: int, arity: int) -> tuple[torch.Tensor, ...]:
    """kv_compact's call: slots src -> dst of one row, padded to `pairs` pairs (and to the model's arity)."""
    src, dst = [int(x) for x in src], [int(x) for x in dst]
    if len(src) != len(dst) or len(src) > pairs:
        raise ValueError(f"kv_compact: {len(src)} source and {len(dst)} destination slots; the key takes at most "
                         f"{pairs} pairs")
    if len(set(dst)) != len(dst):
        raise ValueError(f"kv_compact: destination slots {dst} repeat a slot")
    s, d = (src[-1], dst[-1]) if src else (0, 0)  # (0, 0): slot 0 of the row onto itself
    pad = pairs - len(src)
    return padded([torch.tensor([row, *src, *[s] * pad, *dst, *[d] * pad], dtype=torch.int32)], arity)


# What each neuron graph entry's `backend` records about its NxD call (eagle3_build/backends/neuron/)
CALL_FIELDS = {"format": str, "key": str, "bucket_index": int, "arity": int, "n_out": int}
MAX_ARITY = 64  # inputs / outputs of one call; no graph role comes near this


@dataclass(frozen=True)
class NxDCall:
    """How one model's NxD model is called: every key padded to `arity` inputs, `n_out` outputs back."""

    arity: int
    n_out: int
    file: FileEntry  # the NxD model file (graphs/<model>.pt), shared by the model's graphs
    compact_pairs: int | None = None  # the kv_compact key's pairs (a tree bundle's target), None: no such key


def nxd_key(role: str, shape=None, context: int | None = None) -> str:
    """The ModelBuilder key a graph is traced under: its role; a menu shape's own graph (GraphEntry.shape: a
    per-shape role, another module where topk or width differ) the role and the shape's tag; a context
    bucket's (GraphEntry.context: the same inputs, fewer KV slots read) .c<slots> after them."""
    return (role if shape is None else f"{role}.{shape.tag}") + (f".c{context}" if context is not None else "")


def nxd_call(m: Manifest, name: str, where: str = MANIFEST) -> NxDCall:
    """Model `name`'s call layout from its graph entries, checked as data: a BundleError names the
    graph, the field and the fix."""
    graphs = [g for g in m.graphs if g.model == name]
    if not graphs:
        raise BundleError(f"{where}: no graphs for the {name} model; rebuild the bundle")
    g0, routes = graphs[0], {}
    for g in graphs:
        b = g.backend
        for field, kind in CALL_FIELDS.items():
            if field not in b:
                raise _bad_call(where, g.name, f"backend.{field} is missing")
            if type(b[field]) is not kind:  # (a bool is not an int here)
                raise _bad_call(where, g.name, f"backend.{field} is {b[field]!r}, not "
                                               f"{'a string' if kind is str else 'an integer'}")
        problem = None
        key = nxd_key(g.role, g.shape, g.context)
        n_key = sum(nxd_key(x.role, x.shape, x.context) == key for x in graphs)
        if b["key"] != key:  # (backend.format: checked by the manifest itself, for every backend)
            problem = f"backend.key {b['key']!r} is not the graph's key {key!r} (its role, and a menu shape's tag)"
        elif not 0 <= b["bucket_index"] < n_key:
            problem = f"backend.bucket_index {b['bucket_index']} is outside 0..{n_key - 1} ({key} buckets)"
        elif (key, b["bucket_index"]) in routes:
            problem = f"backend.bucket_index {b['bucket_index']} is also graph {routes[(key, b['bucket_index'])]}'s"
        elif not len(g.inputs) - 1 <= b["arity"] <= MAX_ARITY:  # (the rank input is a weight on Neuron)
            problem = (f"backend.arity {b['arity']} is outside {len(g.inputs) - 1}..{MAX_ARITY} (the graph takes "
                       f"{len(g.inputs) - 1} inputs besides the rank)")
        elif not len(g.outputs) <= b["n_out"] <= MAX_ARITY:
            problem = (f"backend.n_out {b['n_out']} is outside {len(g.outputs)}..{MAX_ARITY} (the graph returns "
                       f"{len(g.outputs)} outputs)")
        elif (b["arity"], b["n_out"]) != (g0.backend["arity"], g0.backend["n_out"]):
            problem = (f"backend.arity / n_out {b['arity']} / {b['n_out']} differ from graph {g0.name}'s "
                       f"{g0.backend['arity']} / {g0.backend['n_out']} (one NxD model, one call layout)")
        elif g.file != g0.file:
            problem = f"file {g.file.path} is not graph {g0.name}'s {g0.file.path} (one NxD model file per model)"
        if problem:
            raise _bad_call(where, g.name, problem)
        routes[(key, b["bucket_index"])] = g.name
    return NxDCall(g0.backend["arity"], g0.backend["n_out"], g0.file, _compact_call(m, name, graphs, where))


def _compact_call(m: Manifest, name: str, graphs, where: str) -> int | None:
    """The kv_compact pairs every graph entry of model `name` records (one value, or none at all); a tree
    bundle's target must have them, deep enough for its deepest shape."""
    need = compact_pairs(all_shapes(m.speculation, m.menu)) if name == "target" else None
    g0 = graphs[0]
    value = g0.backend.get(COMPACT_FIELD)
    for g in graphs:
        v = g.backend.get(COMPACT_FIELD)
        problem = None
        if v is not None and (type(v) is not int or not 2 <= v <= MAX_ARITY):
            problem = f"backend.{COMPACT_FIELD} is {v!r}, not an integer in 2..{MAX_ARITY}"
        elif v != value:
            problem = f"backend.{COMPACT_FIELD} {v!r} differs from graph {g0.name}'s {value!r} (one NxD model, one key)"
        elif v is not None and need is None:
            problem = (f"backend.{COMPACT_FIELD} is set, but only the target of a bundle that speculates with token "
                       "trees has a kv_compact key")
        if problem:
            raise _bad_call(where, g.name, problem)
    if need is not None and (value is None or value < need):
        have = "no kv_compact key" if value is None else f"a kv_compact key for {value} slot pairs"
        raise BundleError(f"{where}: this bundle speculates with token trees, which move the accepted path's KV "
                          f"slots after each verify, and its target model has {have} (backend.{COMPACT_FIELD} of "
                          f"its graphs; {need} needed); rebuild the bundle with `eagle3-build compile RECIPE "
                          "--backend neuron`, which compiles the target's kv_compact key")
    return value


def _bad_call(where: str, graph: str, problem: str) -> BundleError:
    return BundleError(f"{where}: graph {graph}: {problem}; rebuild the bundle with `eagle3-build compile RECIPE "
                       f"--backend neuron`, which records each graph's NxD call ({', '.join(CALL_FIELDS)})")


def check_manifest(m: Manifest, where: str = MANIFEST) -> None:
    """Every model's NxD call fields (BundleError naming the graph, the field and the fix)."""
    for name in m.models:
        nxd_call(m, name, where)


class NeuronHostError(Eagle3Error):
    pass


def installed_versions() -> dict[str, str]:
    """toolchain key -> installed version of each Neuron SDK package that is installed (not a placeholder)."""
    found = neuron_sdk.installed_versions()
    return {key: found[pip] for key, pip in PIP_NAMES.items() if pip in found}


def logical_cores(target: str, lnc: int, environ: dict, devices: list[str]) -> int:
    if environ.get("NEURON_RT_NUM_CORES"):
        return int(environ["NEURON_RT_NUM_CORES"])
    if environ.get("NEURON_RT_VISIBLE_CORES"):
        return len(visible_cores(environ["NEURON_RT_VISIBLE_CORES"]))
    return len(devices) * PHYSICAL_CORES_PER_DEVICE.get(target, 2) // max(lnc, 1)


def visible_cores(spec: str) -> list[int]:
    """NEURON_RT_VISIBLE_CORES: "0-3", "4,5", "0-1,6"."""
    out = []
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def check_host(m: Manifest, *, environ: dict | None = None, devices: list[str] | None = None,
               versions: dict[str, str] | None = None) -> None:
    """Raise NeuronHostError with the fix when this host cannot run the bundle."""
    environ = os.environ if environ is None else environ
    devices = sorted(glob.glob("/dev/neuron[0-9]*")) if devices is None else devices
    probe_imports = versions is None
    versions = installed_versions() if versions is None else versions
    tc = m.toolchain
    needed = list(SDK.values())
    missing = [PIP_NAMES[k] for k in needed if k not in versions]
    if missing and probe_imports and neuron_sdk.serving_generation() == neuron_sdk.NEFF_GENERATION:
        raise NeuronHostError(neuron_sdk.generation_refusal(neuron_sdk.NXD_GENERATION, neuron_sdk.NEFF_GENERATION))
    if missing:
        pins = ", ".join(f"{PIP_NAMES[k]}=={tc.get(k)}" for k in needed)
        raise NeuronHostError(f"this bundle's graphs are NEFFs and {', '.join(missing)} "
                              f"{'is' if len(missing) == 1 else 'are'} not installed; install the Neuron SDK it was "
                              f"built with ({pins}) from the Neuron pip repository (pip.repos.neuron.amazonaws.com) "
                              "or rebuild the recipe with backend export")
    if probe_imports:  # installed, but broken (a missing libnrt, a half-removed wheel): one line, not a traceback
        for mod, key in SDK.items():
            why = neuron_sdk.import_failure(mod)
            if why:
                raise NeuronHostError(f"{PIP_NAMES[key]} {versions[key]} is installed but `import {mod}` raised {why}; "
                                      f"reinstall it and the Neuron runtime libraries it loads (aws-neuronx-runtime-lib "
                                      "for libnrt) from the Neuron pip / apt repositories")
    release = tc.get("neuron_sdk_release")
    stack = ""
    if release not in (None, "unknown"):
        stack = (f" (the bundle was built for Neuron SDK {release}: install that release's stack, e.g. "
                 f"`pip install 'eagle3-build[neuron-{release.replace('.', '-')}]'`)")
    for key in needed:
        if tc.get(key) and versions[key] != tc[key]:
            raise NeuronHostError(f"bundle compiled with {PIP_NAMES[key]} {tc[key]}, this host has {versions[key]}; "
                                  f"rebuild it here (eagle3-build compile RECIPE --backend neuron) or install "
                                  f"{PIP_NAMES[key]}=={tc[key]}{stack}")
    target = tc.get("neuron_target", "trn2")
    lnc = int(tc.get("neuron_lnc", DEFAULT_LNC.get(target, 1)))
    host_lnc = int(environ.get("NEURON_LOGICAL_NC_CONFIG", DEFAULT_LNC.get(target, 1)))
    if host_lnc != lnc:
        raise NeuronHostError(f"bundle compiled for lnc {lnc} but the runtime uses lnc {host_lnc}; "
                              f"set NEURON_LOGICAL_NC_CONFIG={lnc} or rebuild with --lnc {host_lnc}")
    cores = logical_cores(target, lnc, environ, devices)
    if cores < m.tp_degree:
        raise NeuronHostError(f"bundle needs {m.tp_degree} logical NeuronCores (tp_degree {m.tp_degree}, lnc {lnc}, "
                              f"target {target}), this instance has {cores}; use a larger instance (or widen "
                              "NEURON_RT_VISIBLE_CORES) or rebuild with a smaller parallel.tp_degree")


def torchrun_refusal(tp: int) -> str:
    return (f"this is a neuron bundle: one process drives all {tp} NeuronCores (the Neuron runtime gives every "
            "visible core to one process), so do not start it under torchrun; run it as one process, e.g. "
            f"`NEURON_RT_VISIBLE_CORES=0-{tp - 1} eagle3-serve BUNDLE`")


class NxDModel:
    """One model of a neuron bundle on the device: its graphs (routed by input shapes), its weights
    (every rank's) and its KV cache (device state)."""

    def __init__(self, root: Path, m: Manifest, name: str, file_of):
        """`file_of(entry)` gives a FileEntry's checked path inside the bundle."""
        call = nxd_call(m, name, str(Path(root) / MANIFEST))  # (data first: before the SDK is imported)
        import neuronx_distributed  # noqa: F401  (NxDI's load path imports NxD before torch.jit.load)
        import torch_neuronx  # noqa: F401  (registers the torch.classes.neuron the saved model uses [inferred])
        from safetensors.torch import load_file

        self.arity, self.compact_pairs, self.name = call.arity, call.compact_pairs, name
        path = file_of(call.file)
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != call.file.sha256:
            raise BundleError(f"{path}: does not match its sha256 in the manifest; rebuild or re-download the bundle")
        self.module = torch.jit.load(io.BytesIO(data))
        weights = [load_file(file_of(f)) for f in m.models[name].weight_files]
        self.module.nxd_model.initialize(weights, torch.tensor([0], dtype=torch.int32))

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.module(*padded(inputs, self.arity))
        return tuple(out) if isinstance(out, (list, tuple)) else (out,)

    def move_row(self, src: int, dst: int) -> None:
        self.module(*kv_move_inputs(src, dst, self.arity))

    def compact(self, row: int, src: list[int], dst: list[int]) -> None:
        """Slots `src` -> `dst` of KV-cache row `row` (all read before any is written), on the device."""
        if self.compact_pairs is None:
            raise BundleError(f"the {self.name} model of this neuron bundle has no kv_compact key (token trees need "
                              "it); rebuild the bundle with `eagle3-build compile RECIPE --backend neuron`")
        self.module(*kv_compact_inputs(row, src, dst, self.compact_pairs, self.arity))


def graph_fn(model: NxDModel, n_outputs: int):
    """A bundle graph over its NxD model: the rank input is dropped (each rank's own is a weight),
    integer outputs come back as int64 (the engine's index dtype)."""

    def run(_weights, _kv, _rank, *inputs):
        out = model(*inputs)[:n_outputs]
        return tuple(x.to(torch.int64) if not x.dtype.is_floating_point else x for x in out)

    return run


class NeuronBackend(NeuronFacts, RuntimeBackend):
    """Every rank in this process: one NxD model per model, KV caches on the device."""

    spmd = True
    state_on_host = False
    native_code = True
    graph_kind = "an NxD model (graphs/<model>.pt)"

    @classmethod
    def host_checks(cls, m: Manifest, environ) -> list[Check]:
        try:
            check_host(m, environ=environ)
        except NeuronHostError as e:
            msg = str(e)
            return [Check("backend", False, msg, BACKEND if ("not installed" in msg or "compiled with" in msg
                                                                 or "generation" in msg)
                          else DEVICE)]
        return [Check("backend", True, f"neuron SDK {m.toolchain.get('neuronx_cc')} matches, NeuronCores available")]

    @classmethod
    def manifest_checks(cls, m: Manifest, root: Path) -> list[Check]:
        try:
            check_manifest(m, str(Path(root) / MANIFEST))
        except BundleError as e:
            return [Check("nxd calls", False, str(e), BAD_BUNDLE)]
        return [Check("nxd calls", True, f"{len(m.graphs)} graph entries name their NxD key, bucket and call layout")]

    @classmethod
    def checks_weight_headers(cls) -> bool:
        return False  # NxD's checkpoints: the traced parameter names, checked by nxd_model.initialize

    @classmethod
    def describe_model(cls, m: Manifest, model: str) -> list[str]:
        """One NxD model per model (its keys, the KV moves) and NxD's per-rank checkpoints."""
        graphs = [g for g in m.graphs if g.model == model]
        moves = KV_MOVE + (f", {KV_COMPACT}" if any(COMPACT_FIELD in g.backend for g in graphs) else "")
        f = graphs[0].file
        flags = {g.role: g.backend["compiler_args"] for g in graphs if g.backend.get("compiler_args")}
        return ([f"nxd model {f.path} ({f.size / 1e6:.1f} MB): keys {', '.join(sorted({g.role for g in graphs}))}, "
                 f"{moves}"] + [f"{w.path}  {w.size / 1e6:.2f} MB" for w in m.models[model].weight_files]
                + [f"neuronx-cc {role}: {shlex.join(args)}" for role, args in flags.items()])

    @classmethod
    def join_world(cls, m: Manifest, environ=os.environ) -> TPContext | None:
        if (world_size(environ) or 1) > 1:
            raise BundleError(torchrun_refusal(m.tp_degree))
        return None

    def __init__(self, root: Path, m: Manifest, rank: int):
        super().__init__(root, m, rank)
        check_manifest(m, str(self.root / MANIFEST))
        try:
            check_host(m)
        except NeuronHostError as e:
            raise BundleError(f"{self.root}: {e}") from e
        self.nxd = {name: NxDModel(self.root, m, name, lambda f: bundle_file(self.root, f.path)) for name in m.models}
        on_device = {s.name: torch.zeros(0, dtype=torch_dtype(s.dtype)) for s in m.state}
        self.graphs = {g.name: Graph(g, graph_fn(self.nxd[g.model], len(g.outputs)), (),
                                                 on_device[g.state], torch.zeros(1, dtype=torch.int64))
                       for g in m.graphs}

    def copy_kv_row(self, src: int, dst: int) -> None:
        for model in self.nxd.values():
            model.move_row(src, dst)

    def compact_kv(self, row: int, src: list[int], dst: list[int]) -> None:
        self.nxd["target"].compact(row, src, dst)  # (the target's kv_compact key)
