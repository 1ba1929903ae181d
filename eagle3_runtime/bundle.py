"""Load and validate a bundle: manifest as data, digest, pins, paths confined, every file's sha256,
graphs loaded without unpickling anything, weights bound per graph."""
from __future__ import annotations

import contextlib
import hashlib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .compat import backend_checks
from .errors import Eagle3Error
from .manifest import DTYPE_NAMES, KV_POS_DIM, KV_ROW_DIM, kv_state_name, BundleError, GraphEntry, Manifest, PackedWeight, torch_dtype
from .packing import pack_weight
from .reader import bundle_file, check_contents, read_manifest, verify_files
from .trust import Pins

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
    for c in backend_checks(manifest, {}):
        if not c.ok:
            raise BundleError(c.detail)


def load_graph_aoti(path: Path, entry: GraphEntry, weights: tuple[torch.Tensor, ...]) -> GraphFn:
    """An AOTInductor package: native code, weights passed as inputs on every call (nothing copied).
    The low-level loader skips aoti_load_package's first-call CPU checks (~17 s measured)."""
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


def call_by_name(graph, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Call a graph (a Graph, or anything with its `entry` and call) with its inputs by name and get
    its outputs by name: the names of its manifest entry (manifest.ROLES), in whatever order it lists them."""
    order = [s.name for s in graph.entry.inputs[1:]]  # [0] is the rank
    if set(inputs) != set(order):
        raise ValueError(f"{graph.entry.name}: called with inputs {sorted(inputs)}, the graph takes {order}")
    out = graph(*(inputs[n] for n in order))
    return {s.name: x for s, x in zip(graph.entry.outputs, out)}


DTYPES = {name: torch_dtype(name) for name in DTYPE_NAMES}  # (a view of manifest.DTYPE_TABLE)


class Bundle:
    """A validated bundle with its graphs loaded and weights bound (one rank)."""

    text: tuple | None = None  # (BundleTokenizer, ChatTemplate | None) when opened to serve (tp.open_bundle)

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
        else:  # (a remote bundle: every file's sha256 was verified when it was fetched)
            check_contents(self.root, m, None if spmd else rank)
        if m.backend not in SERVABLE:
            raise BundleError(f"{self.root}: backend {m.backend!r} cannot be served by this runtime "
                              f"(available: {', '.join(SERVABLE)})")
        self.rank = rank
        try:
            self._load(m, rank, spmd)
        except Eagle3Error:
            raise
        except Exception as e:  # whatever a loader raises on a file it cannot take: one line, the cause kept
            raise BundleError(f"{self.root}: cannot load this bundle ({type(e).__name__}: {e}); rebuild it with "
                              "this runtime's eagle3-build") from e

    def _load(self, m: Manifest, rank: int, spmd: bool) -> None:
        if m.backend == "aoti":
            check_aoti_host(m)
        if spmd:
            from .neuron import NeuronHostError, check_host

            try:
                check_host(m)
            except NeuronHostError as e:
                raise BundleError(f"{self.root}: {e}") from e
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
        self.packed: dict[tuple[str, int, str], torch.Tensor] = {}
        loader = LOADERS[m.backend]
        self.graphs: dict[tuple[str, int], Graph] = {}
        for g in m.graphs:
            weights = tuple(self.weights[w] for w in g.weights) + tuple(self._packed(p) for p in g.packed)
            self.graphs[(g.role, g.bucket)] = Graph(g, loader(bundle_file(self.root, g.file.path), g, weights), weights,
                                                    self.state[g.state], torch.tensor([rank], dtype=torch.int64))

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Call every graph once on zeros (what NxDI and vLLM do before serving): a graph that cannot run
        here fails now, as one BundleError naming it, instead of in the middle of a request; the first,
        slow call of each bucket is paid before the first request. The KV caches' contents do not matter
        (a row's positions are written before they are read)."""
        for g in self.manifest.graphs:
            inputs = {s.name: torch.zeros(s.shape, dtype=DTYPES[s.dtype]) for s in g.inputs[1:]}
            try:
                call_by_name(self.graph(g.role, g.bucket), inputs)
            except Eagle3Error:
                raise
            except Exception as e:
                raise BundleError(f"{self.root}: graph {g.name} fails on its first call ({type(e).__name__}: "
                                  f"{str(e).strip().splitlines()[0] if str(e).strip() else 'no message'}); the bundle "
                                  "does not run on this host — rebuild it") from e

    def _packed(self, p: PackedWeight) -> torch.Tensor:
        """A packed copy made once per (weight, rows, format) and shared by every graph that takes it."""
        key = (p.weight, p.rows, p.format)
        if key not in self.packed:
            self.packed[key] = pack_weight(self.weights[p.weight], p.rows, p.format)
        return self.packed[key]

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
            kv.select(KV_ROW_DIM, dst).copy_(kv.select(KV_ROW_DIM, src))

    def compact_kv(self, row: int, src: list[int], dst: list[int]) -> None:
        """Move the target KV of an accepted tree path into place: slots `src` -> `dst` of one row
        (all slots read before any is written)."""
        if getattr(self, "nxd", None):  # the target's kv_compact key, on the device (runtime/neuron.py)
            self.nxd["target"].compact(row, src, dst)
            return
        kv = self.state[kv_state_name("target")].select(KV_ROW_DIM, row)  # (positions: one dim down)
        pos = KV_POS_DIM - 1
        kv.index_copy_(pos, torch.tensor(dst), kv.index_select(pos, torch.tensor(src)))

    def graph(self, role: str, bucket: int) -> Graph:
        try:
            return self.graphs[(role, bucket)]
        except KeyError as e:
            raise BundleError(f"{self.root}: no {role} graph for bucket {bucket}") from e
