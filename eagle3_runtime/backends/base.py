"""What every runtime backend is: one object per bundle, chosen once from `manifest.backend`
(backends/__init__.py), that checks the host, loads the graphs bound to their weights and KV caches,
moves KV rows and tree slots, joins the tensor-parallel world, and warms up (timing every graph's first
call on this host).

The engine sees only `GraphRunner`: graph(role, bucket, shape), copy_kv_row, compact_kv, warm_up. Tensor
parallelism over torchrun wraps a backend in another GraphRunner (tp.py) instead of patching it.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar

import torch

from ..errors import Eagle3Error
from ..graph_contract import BATCH_ROLES
from ..manifest import DTYPE_NAMES, BundleError, GraphEntry, Manifest, torch_dtype
from ..signature import Signature
from .facts import BackendFacts

GraphFn = Callable[..., tuple]
DTYPES = {name: torch_dtype(name) for name in DTYPE_NAMES}  # (a view of manifest.DTYPE_TABLE)

COST_REPEATS, COST_BUDGET_S = 3, 1.5  # passes over the decode-loop graphs timed for their cost; their time limit

# `eagle3-build check` verdicts (compat.py): exit codes for deploy scripts
OK, BAD_BUNDLE, SCHEMA, BACKEND, DEVICE = 0, 2, 3, 4, 5


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    code: int = OK


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
    its outputs by name: the names of its manifest entry (graph_contract.ROLES), in whatever order it lists them."""
    order = [s.name for s in graph.entry.inputs[1:]]  # [0] is the rank
    if set(inputs) != set(order):
        raise ValueError(f"{graph.entry.name}: called with inputs {sorted(inputs)}, the graph takes {order}")
    out = graph(*(inputs[n] for n in order))
    return {s.name: x for s, x in zip(graph.entry.outputs, out)}


@dataclass(frozen=True)
class TPContext:
    rank: int
    world_size: int
    ctrl: object  # the control process group

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


def world_size(environ) -> int | None:
    """$WORLD_SIZE as torchrun sets it (None when unset); anything but a positive integer is an Eagle3Error."""
    raw = environ.get("WORLD_SIZE")
    if raw is None or raw.strip() == "":
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if not 1 <= n <= 1 << 20:
        raise Eagle3Error(f"WORLD_SIZE={raw[:40]!r} is not a number of processes; unset it, or start the runtime "
                          "with torchrun, which sets it")
    return n


class GraphRunner:
    """What the engine calls: a bundle's graphs by role and bucket, and the KV moves between calls."""

    manifest: Manifest
    root: Path
    timings: dict[str, float]  # graph name -> seconds of its first call on this host (warm_up)
    costs: dict[str, float]  # graph name -> seconds per call once warm, decode-loop graphs (warm_up)
    thread_ratio: float | None = None  # one thread's decode time over all threads' (warm_up)

    graphs: dict  # graph name -> what the engine calls

    def graph(self, role: str, bucket: int, shape=None, slots: int | None = None):
        """The graph of `role` at `bucket` serving speculation shape `shape` (None: the bucket's own), of the
        smallest context bucket holding `slots` KV slots (None: the whole cache)."""
        try:
            return self.graphs[self.manifest.graph(role, bucket, shape, slots).name]
        except KeyError as e:
            raise BundleError(f"{self.root}: no {role} graph for bucket {bucket}"
                              + (f" and {shape.describe()}" if shape is not None else "")) from e

    def copy_kv_row(self, src: int, dst: int) -> None:
        """Move a sequence's KV-cache row (every cache's "rows" dim) from row `src` to row `dst`."""
        raise NotImplementedError

    def compact_kv(self, row: int, src: list[int], dst: list[int]) -> None:
        """Move the target KV of an accepted tree path into place: "positions" slots `src` -> `dst` of one
        row (all slots read before any is written)."""
        raise NotImplementedError

    @torch.inference_mode()
    def warm_up(self, repeats: int = COST_REPEATS, budget_s: float = COST_BUDGET_S) -> dict[str, float]:
        """Call every graph once on zeros (what NxDI and vLLM do before serving) and record each first
        call's time on this host in `timings`: a graph that cannot run here fails now, as one BundleError
        naming it, instead of in the middle of a request, and the first, slow call of each bucket is paid
        before the first request. Then the decode loop's whole-cache graphs (graph_contract.BATCH_ROLES) run in up to
        `repeats` interleaved passes, one at least and then as many as fit in `budget_s`: their median is `costs`,
        what a step costs on this host (adaptive.py chooses the speculation shape from it; a context bucket's
        graphs cost less in about the same ratio for every shape). The KV caches' contents do not matter (a
        row's positions are written before they are read)."""
        self.timings, self.costs = {}, {}
        inputs = {g.name: {s.name: torch.zeros(s.shape, dtype=DTYPES[s.dtype]) for s in g.inputs[1:]}
                  for g in self.manifest.graphs}
        for g in self.manifest.graphs:
            t0 = time.perf_counter()
            try:
                call_by_name(self.graphs[g.name], inputs[g.name])
            except Eagle3Error:
                raise
            except Exception as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else "no message"
                raise BundleError(f"{self.root}: graph {g.name} fails on its first call ({type(e).__name__}: "
                                  f"{first}); the bundle does not run on this host — rebuild it") from e
            self.timings[g.name] = time.perf_counter() - t0
        timed = [g for g in self.manifest.graphs if g.role in BATCH_ROLES and g.context is None]  # (whole cache)
        times: dict[str, list[float]] = {g.name: [] for g in timed}
        spent = 0.0
        for rep in range(repeats):  # interleaved passes: a moment of host noise lands on every shape's graphs alike
            t_pass = time.perf_counter()
            for g in timed:
                t0 = time.perf_counter()
                call_by_name(self.graphs[g.name], inputs[g.name])
                times[g.name].append(time.perf_counter() - t0)
            last = time.perf_counter() - t_pass
            spent += last
            if spent + last > budget_s:  # (the first pass always runs: every graph gets a warm time)
                break
        self.costs = {name: statistics.median(ts) for name, ts in times.items()}
        self.thread_ratio = self._thread_ratio(inputs)
        return self.timings

    def _thread_ratio(self, inputs: dict, repeats: int = 3) -> float | None:
        """One thread's time over all threads' for the smallest batch bucket's decode pass on this host (the
        thread governor's estimate, contention.py); None with one thread, under TP (rank 0's driver) and for
        graphs that do not run on this process's threads."""
        threads = torch.get_num_threads()
        if threads < 2 or self.manifest.tp_degree > 1 or not getattr(self, "host_threads", False):
            return None
        g = self.manifest.graph("target_decode", self.manifest.batch_buckets[0])
        times: dict[int, list[float]] = {threads: [], 1: []}
        try:
            for _ in range(repeats):
                for n in (1, threads):
                    torch.set_num_threads(n)
                    t0 = time.perf_counter()
                    call_by_name(self.graphs[g.name], inputs[g.name])
                    times[n].append(time.perf_counter() - t0)
        finally:
            torch.set_num_threads(threads)
        return max(1.0, statistics.median(times[1]) / statistics.median(times[threads]))


class RuntimeBackend(GraphRunner, BackendFacts):
    """One backend's whole runtime side: its facts (facts.py), class-level checks that need nothing loaded
    (`check`); an instance is one process's loaded share of a bundle."""

    spmd: ClassVar[bool] = False  # one process drives every rank (else: one process per rank, torchrun)
    state_on_host: ClassVar[bool] = True  # the KV caches are host tensors (counted against host memory)
    graph_kind: ClassVar[str] = ""  # what its graph files are, for messages
    native_code: ClassVar[bool] = False  # its graph files are machine code: a remote one is trusted only by a pin

    # ---- before anything is loaded
    @classmethod
    def host_checks(cls, m: Manifest, environ) -> list[Check]:
        """Whether this host can run the bundle's graphs (toolchain, ISA, devices)."""
        raise NotImplementedError

    @classmethod
    def manifest_checks(cls, m: Manifest, root: Path) -> list[Check]:
        """Backend fields of the graph entries, checked as data."""
        return []

    @classmethod
    def read_signature(cls, path: Path) -> Signature | None:
        """What a graph file says it takes and returns (signature.py); None where the files are not read."""
        return None

    @classmethod
    def check_graph_file(cls, data: bytes, name: str) -> None:
        """Refuse a graph file that holds more than a graph (before it is loaded)."""

    @classmethod
    def checks_weight_headers(cls) -> bool:
        """Whether the weight files are the manifest's per-rank safetensors (their headers checked)."""
        return True

    @classmethod
    def ranks_held(cls, rank: int) -> int | None:
        """The rank whose weight files this process reads (None: every rank's, SPMD)."""
        return None if cls.spmd else rank

    @classmethod
    def describe_bundle(cls, m: Manifest) -> list[str]:
        """Lines `eagle3-build inspect` adds after the graph table (what this backend makes at load)."""
        return []

    @classmethod
    def describe_model(cls, m: Manifest, model: str) -> list[str]:
        """Lines `eagle3-build inspect` adds for one model (its artifacts, as this backend lays them out)."""
        return []

    @classmethod
    def join_world(cls, m: Manifest, environ) -> TPContext | None:
        """This process's place in the tensor-parallel world (None: it holds the whole bundle)."""
        raise NotImplementedError

    def __init__(self, root: Path, m: Manifest, rank: int):
        self.root, self.manifest, self.rank, self.timings, self.costs = Path(root), m, rank, {}, {}
        self.weights: dict[str, torch.Tensor] = {}  # "model/tensor" -> host tensor (where the host holds them)
        self.graphs: dict[str, Graph] = {}
