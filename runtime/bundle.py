"""Load and validate a bundle: manifest as data, digest, pins, paths confined, every file's sha256,
graphs loaded without unpickling anything, weights bound per graph."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from pydantic import ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file

from .manifest import (DTYPE_NAMES, MANIFEST, SCHEMA_VERSION, BundleError, FileEntry, GraphEntry, Manifest,
                       SchemaError, bundle_relpath, sha256_file)
from .trust import Pins, check_pins

MAX_MANIFEST_BYTES = 64 << 20


def allowed_roots(root: Path) -> list[Path]:
    """Where a bundle's files may really live: inside the bundle, or, for a huggingface_hub snapshot
    (<cache>/models--org--repo/snapshots/<commit>/, whose files are links to ../../blobs/), that repo's blobs."""
    real = Path(os.path.realpath(root))
    out = [real]
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        out.append(Path(os.path.realpath(root.parent.parent / "blobs")))
    return out


def bundle_file(root: Path, rel: str) -> Path:
    """`root/rel`, refused unless `rel` is a plain relative path that resolves (links followed) inside the bundle."""
    try:
        bundle_relpath(rel)
    except ValueError as e:
        raise BundleError(f"{root}: manifest entry {rel!r} points outside the bundle; refusing it") from e
    path = Path(root) / rel
    real = Path(os.path.realpath(path))
    if not any(real.is_relative_to(a) for a in allowed_roots(Path(root))):
        raise BundleError(f"{root}: {rel} is a link that leaves the bundle (to {real}); refusing it")
    return path


def read_manifest(root: Path, pins: Pins = Pins()) -> Manifest:
    """The manifest, validated as data, its digest checked, and the user's pins (digest, signature) checked."""
    root = Path(root)
    path = bundle_file(root, MANIFEST)
    if not path.is_file():
        raise BundleError(f"{root}: no {MANIFEST}; not a bundle (build one with `eagle3-build compile RECIPE`)")
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise BundleError(f"{path}: {path.stat().st_size} bytes, more than any manifest ({MAX_MANIFEST_BYTES}); "
                          "not a bundle")
    try:
        raw = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:
        raise BundleError(f"{path}: not valid JSON ({type(e).__name__}); the bundle is corrupt, rebuild it") from e
    version = raw.get("schema_version") if isinstance(raw, dict) else None
    if version != SCHEMA_VERSION:
        raise SchemaError(f"{path}: manifest schema version {version!r}, this runtime reads version "
                          f"{SCHEMA_VERSION}; rebuild the bundle with a matching eagle3-build or use a "
                          "matching runtime")
    try:
        m = Manifest.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise BundleError(f"{path}: invalid manifest{' at ' + loc if loc else ''}: {first['msg']}; "
                          "rebuild the bundle") from e
    if not m.digest:
        raise BundleError(f"{path}: the manifest has no digest; every bundle eagle3-build writes has one — "
                          "rebuild it")
    if m.compute_digest() != m.digest:
        raise BundleError(f"{root}: {MANIFEST} was modified after the build (its content no longer matches the "
                          f"bundle digest {m.digest[:12]}…); rebuild or re-download the bundle")
    check_pins(root, m.digest, pins)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if m.backend != "neuron" and m.state_bytes() > memory:  # (Neuron: the caches live on the device)
        raise BundleError(f"{path}: the KV caches need {m.state_bytes() / 2**30:.1f} GiB, more than this host's "
                          f"{memory / 2**30:.1f} GiB; rebuild with a smaller max_model_len / max_num_seqs")
    return m


def check_file(root: Path, entry: FileEntry) -> Path:
    """Present, confined, with the recorded size and sha256."""
    path = bundle_file(root, entry.path)
    if not path.is_file():
        raise BundleError(f"{root}: {entry.path} is missing; the bundle is incomplete — rebuild or re-download it")
    if path.stat().st_size != entry.size or sha256_file(path) != entry.sha256:
        raise BundleError(f"{root}: {entry.path} is corrupt (does not match the sha256 and size in the manifest); "
                          "rebuild or re-download the bundle")
    return path


def verify_files(root: Path, manifest: Manifest, rank: int | None = None) -> None:
    """Every file (of one rank's weights only, when `rank` is given) against the manifest; export graphs are
    also checked to hold nothing but a static operator graph (runtime/safe_pt2.py)."""
    from .safe_pt2 import UnsafeArchive, check_archive

    others = set()
    if rank is not None:
        others = {f.path for m in manifest.models.values() for r, f in enumerate(m.weight_files) if r != rank}
    graphs = {g.file.path for g in manifest.graphs} if manifest.backend == "export" else set()
    for entry in manifest.all_files():
        if entry.path in others:
            continue
        path = check_file(root, entry)
        if entry.path in graphs:
            try:
                check_archive(path.read_bytes(), f"{root}/{entry.path}")
            except UnsafeArchive as e:
                raise BundleError(f"{e}; refusing to load it") from e


GraphFn = Callable[..., tuple]


@contextlib.contextmanager
def _cached_type_hints():
    """torch.export's deserializer calls typing.get_type_hints once per JSON object (~15k per
    graph), which dominates load time; the hints of its schema classes never change, so memoise them
    for the duration of our load (measured: 4 graphs 5.3 s -> 2.0 s). No-op if torch's internals differ."""
    try:
        import torch._export.serde.serialize as ser
    except ImportError:
        yield
        return
    real = getattr(ser, "typing", None)
    if real is not typing:
        yield
        return
    cache: dict = {}

    def get_type_hints(cls, globalns=None):
        hints = cache.get(cls)
        if hints is None:
            hints = cache[cls] = typing.get_type_hints(cls, globalns=globalns)
        return hints

    shim = types.SimpleNamespace(**{k: getattr(typing, k) for k in dir(typing) if not k.startswith("__")})
    shim.get_type_hints = get_type_hints
    ser.typing = shim
    try:
        yield
    finally:
        ser.typing = real


def load_graph_export(path: Path, entry: GraphEntry, weights: tuple[torch.Tensor, ...]) -> GraphFn:
    """Read once, check those bytes (sha256, archive contents), deserialize those same bytes."""
    from .safe_pt2 import UnsafeArchive, load_exported

    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != entry.file.sha256:
        raise BundleError(f"{path}: does not match its sha256 in the manifest; rebuild or re-download the bundle")
    try:
        with _cached_type_hints():
            ep = load_exported(data, str(path))
    except UnsafeArchive as e:
        raise BundleError(f"{e}; refusing to load it") from e
    except Exception as e:  # torch's deserializer on a well-formed but broken program
        raise BundleError(f"{path}: cannot load this export graph ({type(e).__name__}: {e}); rebuild the bundle") from e
    return ep.module()


def check_aoti_host(manifest: Manifest) -> None:
    """AOTI packages are native code for one torch ABI and one ISA/device: refuse before loading."""
    from .compat import backend_checks

    for c in backend_checks(manifest, {}):
        if not c.ok:
            raise BundleError(c.detail)


def load_graph_aoti(path: Path, entry: GraphEntry, weights: tuple[torch.Tensor, ...]) -> GraphFn:
    """An AOTInductor package: native code, weights passed as inputs on every call (nothing copied).
    The low-level loader avoids aoti_load_package's ~17 s first-call CPU checks (REFERENCE §7)."""
    loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)

    def run(ws, kv, *inputs):
        return tuple(loader.boxed_run([*ws, kv, *inputs]))

    return run


LOADERS: dict[str, Callable[[Path, GraphEntry, tuple], GraphFn]] = {
    "export": load_graph_export, "aoti": load_graph_aoti}  # (neuron: one NxD model per model, Bundle._load_neuron)
SERVABLE = (*LOADERS, "neuron")


@dataclass
class Graph:
    """One compiled graph bound to this rank's weights, KV cache and rank tensor."""

    entry: GraphEntry
    fn: GraphFn
    weights: tuple[torch.Tensor, ...]
    kv: torch.Tensor
    rank: torch.Tensor

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inputs = (self.rank, *inputs)
        if len(inputs) != len(self.entry.inputs):
            raise ValueError(f"{self.entry.name}: {len(inputs)} inputs, the graph takes {len(self.entry.inputs)}")
        for spec, x in zip(self.entry.inputs, inputs):
            if list(x.shape) != spec.shape:
                raise ValueError(f"{self.entry.name}: input {spec.name} has shape {list(x.shape)}, "
                                 f"the graph was built for {spec.shape}")
        inputs = tuple(x if x.dtype == DTYPES[s.dtype] else x.to(DTYPES[s.dtype])  # (int32 indices on Neuron)
                       for s, x in zip(self.entry.inputs, inputs))
        out = self.fn(self.weights, self.kv, *inputs)
        return out if isinstance(out, tuple) else tuple(out)


DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


class Bundle:
    """A validated bundle with its graphs loaded and weights bound (one rank)."""

    def __init__(self, root: str | Path, *, rank: int = 0, verify: bool = True, pins: Pins = Pins()):
        self.root = Path(root)
        if not self.root.is_dir():
            raise BundleError(f"{self.root}: no such bundle directory")
        self.manifest = m = read_manifest(self.root, pins)
        if not 0 <= rank < m.tp_degree:
            raise BundleError(f"{self.root}: rank {rank} outside this bundle's tp_degree {m.tp_degree}")
        spmd = m.backend == "neuron"  # one process holds every rank
        if verify:
            verify_files(self.root, m, None if spmd else rank)
        if m.backend not in SERVABLE:
            raise BundleError(f"{self.root}: backend {m.backend!r} cannot be served by this runtime "
                              f"(available: {', '.join(SERVABLE)})")
        if m.backend == "aoti":
            check_aoti_host(m)
        if m.backend == "neuron":
            from .neuron import NeuronHostError, check_host

            try:
                check_host(m)
            except NeuronHostError as e:
                raise BundleError(f"{self.root}: {e}") from e
        self.rank = rank
        if spmd:
            self._load_neuron(m)
            return
        self.weights: dict[str, torch.Tensor] = {}
        for name, model in m.models.items():
            path = bundle_file(self.root, model.weight_files[rank].path)
            try:
                tensors = load_file(path)
            except (SafetensorError, OSError) as e:
                raise BundleError(f"{path}: not a readable safetensors file ({e}); rebuild the bundle") from e
            for k, v in tensors.items():
                self.weights[f"{name}/{k}"] = v
        self.state = {s.name: torch.zeros(s.shape, dtype=DTYPES[s.dtype]) for s in m.state}
        loader = LOADERS[m.backend]
        self.graphs: dict[tuple[str, int], Graph] = {}
        for g in m.graphs:
            missing = [w for w in g.weights if w not in self.weights]
            if missing:
                raise BundleError(f"{self.root}: graph {g.name} needs weights {missing[:3]} that no weight file "
                                  "holds; the bundle is inconsistent — rebuild it")
            weights = tuple(self.weights[w] for w in g.weights)
            self.graphs[(g.role, g.bucket)] = Graph(g, loader(bundle_file(self.root, g.file.path), g, weights), weights,
                                                    self.state[g.state], torch.tensor([rank], dtype=torch.int64))

    def _load_neuron(self, m: Manifest) -> None:
        """Every rank in this process: one NxD model per model, KV caches on the device (runtime/neuron.py)."""
        from .neuron import NxDModel, graph_fn

        self.weights = {}
        self.state = {s.name: torch.zeros(0, dtype=DTYPES[s.dtype]) for s in m.state}  # (on the device)
        self.nxd = {name: NxDModel(self.root, m, name, lambda f: bundle_file(self.root, f.path)) for name in m.models}
        self.graphs = {(g.role, g.bucket): Graph(g, graph_fn(self.nxd[g.model], len(g.outputs)), (),
                                                 self.state[g.state], torch.zeros(1, dtype=torch.int64))
                       for g in m.graphs}

    def copy_kv_row(self, src: int, dst: int) -> None:
        """Move a sequence's KV-cache row (dim 2 of every cache) from row `src` to row `dst`."""
        if getattr(self, "nxd", None):
            for model in self.nxd.values():
                model.move_row(src, dst)
            return
        for kv in self.state.values():
            kv[:, :, dst].copy_(kv[:, :, src])

    def graph(self, role: str, bucket: int) -> Graph:
        try:
            return self.graphs[(role, bucket)]
        except KeyError as e:
            raise BundleError(f"{self.root}: no {role} graph for bucket {bucket}") from e
