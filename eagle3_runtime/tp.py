"""Tensor parallelism at run time where a backend runs one process per rank under torchrun (gloo on
CPU; backends/host.py joins the world). An SPMD backend (Neuron) drives every rank from one process and
joins no world here.

Rank 0 (the driver) owns tokenization, scheduling and output. Before every graph call it broadcasts
the call (graph index, then each input tensor, shapes known from the manifest) on a dedicated control
group; every rank then runs the same graph on its own weights, and the collectives inside the graph
use the default group. Control traffic and in-graph collectives never share a gloo group (mixing
them deadlocks: a broadcast and a graph's all-reduce can pair up across ranks).

This module also decides how many torch CPU threads each process uses (`set_threads`, both CLIs).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from .backends.registry import backend_for
from .backends.base import DTYPES, GraphRunner, TPContext
from .bundle import Bundle
from .errors import Eagle3Error, whole_number
from .host import available_cores
from .reader import read_manifest
from .tokenizer import load_text

STOP = -1
COPY_ROW = -2
COMPACT = -3  # header [COMPACT, row, n], then int64 [2, n]: source and destination slots

THREADS_ENV = "EAGLE3_NUM_THREADS"


def default_threads() -> int:
    """available_cores(), shared evenly among the local ranks when torchrun starts several on this host
    (LOCAL_WORLD_SIZE); at least 1."""
    cores = available_cores()
    try:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    except ValueError:
        local_ranks = 1
    return max(1, cores // max(1, local_ranks))


def num_threads(n: int | None = None) -> int:
    """torch CPU threads for this process: `n` (--threads), else $EAGLE3_NUM_THREADS, else default_threads(),
    at most available_cores() (more threads than cores only contend; a huge count would exhaust memory).
    OMP_NUM_THREADS is not read: torchrun sets it to 1 for every rank it starts."""
    if n is None:
        raw = os.environ.get(THREADS_ENV, "").strip()
        if not raw:
            return default_threads()
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise Eagle3Error(f"{THREADS_ENV}={raw!r} is not a positive whole number of threads; "
                              f"set it to one (e.g. {THREADS_ENV}=2) or unset it for the default")
    return max(1, min(n, available_cores()))


def set_threads(n: int | None = None) -> int:
    """Set torch's intra-op threads as num_threads(n) says; returns the count."""
    n = num_threads(n)
    torch.set_num_threads(n)
    return n


_positive_int = whole_number(1, 1 << 16, "a positive whole number")


def add_threads_arg(ap) -> None:
    """The --threads flag of eagle3-run and eagle3-serve (argparse)."""
    ap.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                    help=f"torch CPU threads per process (default: ${THREADS_ENV} if set, else the cores this "
                         "process may run on, len(os.sched_getaffinity(0)), divided by the local ranks under "
                         "torchrun, LOCAL_WORLD_SIZE; at least 1)")


class DriverGraph:
    """Rank 0's view of a graph: announce the call to the workers, then run it locally."""

    def __init__(self, graph, index: int, ctx: TPContext):
        self.graph, self.index, self.ctx = graph, index, ctx
        self.entry = graph.entry

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # in the graph's dtypes: the workers receive into tensors of the manifest's specs
        inputs = tuple(x.to(DTYPES[s.dtype]).contiguous() for s, x in zip(self.entry.inputs[1:], inputs))
        dist.broadcast(torch.tensor([self.index, 0, 0], dtype=torch.int64), src=0, group=self.ctx.ctrl)
        for x in inputs:
            dist.broadcast(x, src=0, group=self.ctx.ctrl)
        return self.graph(*inputs)


class Driver(GraphRunner):
    """Rank 0's backend under torchrun: every graph call and KV move is announced to the workers
    (worker_loop), then done on rank 0's own backend."""

    def __init__(self, local: GraphRunner, ctx: TPContext):
        self.local, self.ctx = local, ctx
        self.manifest, self.root, self.timings, self.costs = local.manifest, local.root, {}, {}
        self.graphs = {g.name: DriverGraph(local.graphs[g.name], i, ctx) for i, g in enumerate(local.manifest.graphs)}

    def _announce(self, *header: int) -> None:
        dist.broadcast(torch.tensor(header, dtype=torch.int64), src=0, group=self.ctx.ctrl)

    def copy_kv_row(self, src: int, dst: int) -> None:
        self._announce(COPY_ROW, src, dst)
        self.local.copy_kv_row(src, dst)

    def compact_kv(self, row: int, src: list[int], dst: list[int]) -> None:
        self._announce(COMPACT, row, len(src))
        dist.broadcast(torch.tensor([src, dst], dtype=torch.int64), src=0, group=self.ctx.ctrl)
        self.local.compact_kv(row, src, dst)


def worker_loop(bundle: Bundle, ctx: TPContext) -> None:
    """Ranks > 0: run whatever graph the driver announces until it says stop."""
    graphs = [bundle.backend.graphs[g.name] for g in bundle.manifest.graphs]
    header = torch.zeros(3, dtype=torch.int64)
    with torch.inference_mode():
        while True:
            dist.broadcast(header, src=0, group=ctx.ctrl)
            idx, a, b = header.tolist()
            if idx == STOP:
                return
            if idx == COPY_ROW:
                bundle.copy_kv_row(a, b)
                continue
            if idx == COMPACT:
                slots = torch.empty(2, b, dtype=torch.int64)
                dist.broadcast(slots, src=0, group=ctx.ctrl)
                bundle.compact_kv(a, slots[0].tolist(), slots[1].tolist())
                continue
            g = graphs[idx]
            inputs = [torch.empty(s.shape, dtype=DTYPES[s.dtype]) for s in g.entry.inputs[1:]]  # [0] is rank
            for x in inputs:
                dist.broadcast(x, src=0, group=ctx.ctrl)
            g(*inputs)


def stop_workers(ctx: TPContext) -> None:
    dist.broadcast(torch.tensor([STOP, 0, 0], dtype=torch.int64), src=0, group=ctx.ctrl)


def shutdown(ctx: TPContext | None, barrier: bool = True) -> None:
    if ctx is not None and dist.is_initialized():
        if barrier:
            dist.barrier(group=ctx.ctrl)
        dist.destroy_process_group()


def open_bundle(ref: str | Path, expect_digest: str | None = None, public_key: str | None = None,
                trust_remote_code: bool = False) -> tuple[Bundle | None, TPContext | None]:
    """Load this process's rank of a bundle, joining the torchrun world when the bundle is TP.

    Rank 0 gets (bundle, ctx) with its graphs announcing every call to the workers, every graph run
    once (Bundle.warm_up), and `bundle.text` = (tokenizer, chat template or None), checked before the
    graphs are loaded (tokenizer.load_text); ranks > 0 run the worker loop here until the driver stops
    them and get (None, ctx). `ref` may also be a
    reference (hf://org/repo@rev, file:///dir@rev): fetched and verified first (remote.py);
    `expect_digest` / `public_key` (or a `#sha256=` on the reference) pin it (trust.py)."""
    from .remote import is_remote, resolve_bundle
    from .trust import pins

    ref, p = pins(str(ref), expect_digest, public_key)
    path = resolve_bundle(ref, p, trust_remote_code)  # a remote bundle: every file verified here
    manifest = read_manifest(Path(path), p)
    text = load_text(Path(path)) if os.environ.get("RANK", "0") == "0" else None  # (before the slow part)
    try:
        ctx = backend_for(manifest).join_world(manifest, os.environ)
    except BaseException:
        _close_text(text)
        raise
    try:
        bundle = Bundle(path, rank=ctx.rank if ctx else 0, pins=p, verify=not is_remote(ref))
    except BaseException:
        _close_text(text)
        shutdown(ctx, barrier=False)
        raise
    bundle.text = text
    if ctx is not None and not ctx.is_driver:
        worker_loop(bundle, ctx)
        return None, ctx
    if ctx is not None:
        bundle.backend = Driver(bundle.backend, ctx)
    try:
        bundle.warm_up()  # (under TP through the driver: every rank runs each graph once)
    except BaseException:
        _close_text(text)
        if ctx is not None:
            stop_workers(ctx)
            shutdown(ctx, barrier=False)
        raise
    return bundle, ctx


def _close_text(text) -> None:
    if text is not None and text[1] is not None:
        text[1].close()
