"""Load and validate a bundle: schema version, every file's sha256, weights bound per graph."""
from __future__ import annotations

import contextlib
import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from .manifest import MANIFEST, SCHEMA_VERSION, GraphEntry, Manifest, sha256_file


class BundleError(Exception):
    """The bundle cannot be served; the message names the file and the fix."""


def read_manifest(root: Path) -> Manifest:
    path = root / MANIFEST
    if not path.exists():
        raise BundleError(f"{root}: no {MANIFEST}; not a bundle (build one with `eagle3-build compile RECIPE`)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise BundleError(f"{path}: not valid JSON ({e}); the bundle is corrupt, rebuild it") from None
    version = raw.get("schema_version") if isinstance(raw, dict) else None
    if version != SCHEMA_VERSION:
        raise BundleError(f"{path}: manifest schema version {version!r}, this runtime reads version "
                          f"{SCHEMA_VERSION}; rebuild the bundle with a matching eagle3-build or use a "
                          "matching runtime")
    try:
        return Manifest.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise BundleError(f"{path}: invalid manifest at {loc}: {first['msg']}; rebuild the bundle") from None


def verify_files(root: Path, manifest: Manifest, rank: int | None = None) -> None:
    """sha256 of every file (of one rank's weights only, when `rank` is given)."""
    if manifest.digest and manifest.compute_digest() != manifest.digest:
        raise BundleError(f"{root}: {MANIFEST} was modified after the build (its content no longer matches the "
                          f"bundle digest {manifest.digest[:12]}…); rebuild or re-download the bundle")
    others = set()
    if rank is not None:
        others = {f.path for m in manifest.models.values() for r, f in enumerate(m.weight_files) if r != rank}
    for entry in manifest.all_files():
        if entry.path in others:
            continue
        path = root / entry.path
        if not path.is_file():
            raise BundleError(f"{root}: {entry.path} is missing; the bundle is incomplete — rebuild or re-download it")
        got = sha256_file(path)
        if got != entry.sha256:
            raise BundleError(f"{root}: {entry.path} is corrupt (sha256 {got[:12]}…, manifest says "
                              f"{entry.sha256[:12]}…); rebuild or re-download the bundle")


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
    with _cached_type_hints():
        ep = torch.export.load(str(path))
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


def load_graph_neuron(path: Path, entry: GraphEntry, weights: tuple[torch.Tensor, ...]) -> GraphFn:
    from .neuron import load_graph

    return load_graph(path, entry, weights)


LOADERS: dict[str, Callable[[Path, GraphEntry, tuple], GraphFn]] = {
    "export": load_graph_export, "aoti": load_graph_aoti, "neuron": load_graph_neuron}


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
        out = self.fn(self.weights, self.kv, *inputs)
        return out if isinstance(out, tuple) else tuple(out)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}


class Bundle:
    """A validated bundle with its graphs loaded and weights bound (one rank)."""

    def __init__(self, root: str | Path, *, rank: int = 0, verify: bool = True):
        self.root = Path(root)
        if not self.root.is_dir():
            raise BundleError(f"{self.root}: no such bundle directory")
        self.manifest = m = read_manifest(self.root)
        if not 0 <= rank < m.tp_degree:
            raise BundleError(f"{self.root}: rank {rank} outside this bundle's tp_degree {m.tp_degree}")
        if verify:
            verify_files(self.root, m, rank)
        if m.backend not in LOADERS:
            raise BundleError(f"{self.root}: backend {m.backend!r} cannot be served by this runtime "
                              f"(available: {', '.join(LOADERS)})")
        if m.backend == "aoti":
            check_aoti_host(m)
        if m.backend == "neuron":
            from .neuron import NeuronHostError, check_host

            try:
                check_host(m)
            except NeuronHostError as e:
                raise BundleError(f"{self.root}: {e}") from None
        self.rank = rank
        self.weights: dict[str, torch.Tensor] = {}
        for name, model in m.models.items():
            for k, v in load_file(self.root / model.weight_files[rank].path).items():
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
            self.graphs[(g.role, g.bucket)] = Graph(g, loader(self.root / g.file.path, g, weights), weights,
                                                    self.state[g.state], torch.tensor([rank], dtype=torch.int64))

    def copy_kv_row(self, src: int, dst: int) -> None:
        """Move a sequence's KV-cache row (dim 2 of every cache) from row `src` to row `dst`."""
        for kv in self.state.values():
            kv[:, :, dst].copy_(kv[:, :, src])

    def graph(self, role: str, bucket: int) -> Graph:
        try:
            return self.graphs[(role, bucket)]
        except KeyError:
            raise BundleError(f"{self.root}: no {role} graph for bucket {bucket}") from None
