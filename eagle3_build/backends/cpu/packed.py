"""Projections that take a copy of their weights packed at load (eagle3_runtime.packing), as graph inputs.

`ProjectionLayouts` is what the aoti backend hands the per-graph path for a pair: per graph, the key fields of
its GEMM choice and, when traced, the `LinearMethod` that reads the copies with the copies' example inputs and
manifest entries. A first traced call with `Recorder` finds which projections (and row counts) packing serves.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch import nn

from eagle3_runtime.manifest import BLOCKED_FORMATS, FUSED_FORMATS, PackedWeight
from eagle3_runtime.packing import BLOCKED_DTYPES, pack_weight, packed_linear

from ...graphs import GraphSpec
from ...models.linear import UNPACKED, LinearMethod, float_rows
from ...recipe import PairRecipe
from . import gemm, inductor_internals as inductor


def weight_name(layer: nn.Module) -> str:
    """The name of a projection's weight in the traced module (linear.using names the modules)."""
    return f"{layer.__dict__['projection_name']}.weight"


def _biased(layers) -> bool:
    return any(getattr(layer, "bias", None) is not None for layer in layers)


class Recorder(LinearMethod):
    """Computes as UNPACKED, recording (weight names, rows) of every float32 projection (group) a copy could
    serve: projections of one input together when none has a bias."""

    def __init__(self):
        self.seen: set[tuple[tuple[str, ...], int]] = set()

    def apply(self, layers, x):
        if len(layers) > 1 and _biased(layers):
            return tuple(self.apply((layer,), x)[0] for layer in layers)
        if float_rows(x):
            self.seen.add((tuple(weight_name(layer) for layer in layers), float_rows(x)))
        return UNPACKED.apply(layers, x)


@dataclass(frozen=True)
class Copy:
    """One packed input of a graph: the copy of `weights` (several: concatenated along the output dim) for GEMMs
    of `rows` rows in `format`."""
    weights: tuple[str, ...]
    rows: int
    format: str


class PackedLinears(LinearMethod):
    """Each projection with a copy for the call's row count takes it (the graph inputs after the weights, in
    `copies` order); the others compute as UNPACKED."""

    def __init__(self, copies: list[Copy], threads: int):
        self.copies, self.threads = copies, threads
        self._bound: dict[tuple[str, ...], dict[int, tuple[str, torch.Tensor]]] | None = None

    @contextlib.contextmanager
    def bind(self, extra):
        if len(extra) != len(self.copies):
            raise ValueError(f"{len(self.copies)} packed copies expected after the weights, got {len(extra)}")
        self._bound = {}
        for c, t in zip(self.copies, extra):
            self._bound.setdefault(c.weights, {})[c.rows] = (c.format, t)
        try:
            yield
        finally:
            self._bound = None

    def apply(self, layers, x):
        rows = float_rows(x)
        names = tuple(weight_name(layer) for layer in layers)
        found = (self._bound or {}).get(names, {}).get(rows) if rows and not (len(layers) > 1 and _biased(layers)) \
            else None
        if found is None:  # (no copy for these rows, or a group a format does not fuse: each weight's own)
            if len(layers) > 1:
                return tuple(self.apply((layer,), x)[0] for layer in layers)
            return UNPACKED.apply(layers, x)
        fmt, copy = found
        flat = x.reshape(rows, x.shape[-1])
        if len(layers) == 1:
            (layer,) = layers
            y = packed_linear(flat, copy, layer.weight, getattr(layer, "bias", None), fmt, threads=self.threads)
            return (y.reshape(*x.shape[:-1], layer.weight.shape[0]),)
        widths = [layer.weight.shape[0] for layer in layers]
        y = packed_linear(flat, copy, None, None, fmt, n=sum(widths), threads=self.threads)
        return tuple(t.reshape(*x.shape[:-1], t.shape[-1]) for t in y.split(widths, dim=-1))


@functools.lru_cache(maxsize=None)
def _packed_meta(shape: tuple[int, ...], rows: int, fmt: str, block_n: int | None) -> tuple[tuple[int, ...], torch.dtype]:
    p = pack_weight(torch.empty(shape), rows, fmt, block_n)
    return tuple(p.shape), p.dtype


def packed_example(shape: tuple[int, ...], rows: int, fmt: str, block_n: int | None = None) -> torch.Tensor:
    """A stand-in of a packed copy: the shape and dtype the runtime's pack_weight makes on this host."""
    shape_, dtype = _packed_meta(shape, rows, fmt, block_n)
    return torch.empty(shape_, dtype=dtype)


def graph_rows(pair: PairRecipe, spec: GraphSpec) -> set[int]:
    """The token row counts a graph's projections may use: its tokens per call, and 1 or a batch bucket up
    to that (the rows that leave a graph for the lm_head); its key names the GEMM choice of these only."""
    n = spec.tokens_per_call()
    return {n} | {r for r in (1, *pair.buckets.batch) if r <= n}


def plan_rows(pair: PairRecipe, specs: list[GraphSpec]) -> list[int]:
    return sorted(set().union(*(graph_rows(pair, s) for s in specs)))


@dataclass
class GraphLayout:
    """One graph's projections: the GEMM format per row count it uses (`formats`), keyed into the graph's key."""
    formats: dict[int, str]
    threads: int
    rows: set[int]
    codegen: object  # the backend's codegen(): the ISA blocked copies are made for

    def key_fields(self) -> dict:
        blocked = set(BLOCKED_FORMATS) & {gemm.format_parts(f)[0] for f in self.formats.values()}
        return {"gemm": {str(r): f for r, f in self.formats.items()}, **({"gemm_threads": self.threads} if blocked else {})}

    @staticmethod
    def recorder() -> Recorder:
        return Recorder()

    def plan(self, recorder: Recorder, names: list[str], qnames: list[str], weights: tuple[torch.Tensor, ...],
             graph: str) -> tuple[LinearMethod, tuple[torch.Tensor, ...], list[PackedWeight]]:
        """After a traced call with `recorder`: the method that reads the copies, the copies' example inputs and
        their manifest entries (`names`: the traced module's weight names, `qnames`: the bundle's)."""
        if not {r for _, r in recorder.seen} <= self.rows:  # (the key would not name a choice it uses)
            raise RuntimeError(f"graph {graph} projects {sorted({r for _, r in recorder.seen})} token rows, "
                               f"graph_rows says {sorted(self.rows)}")
        index = {n: i for i, n in enumerate(names)}
        formats = {r: gemm.format_parts(f) for r, f in self.formats.items()}  # rows -> (format, register blocking)
        seen = sorted(((tuple(index[n] for n in group), rows) for group, rows in recorder.seen
                       if all(n in index for n in group)))  # (in weight order)
        copies = [Copy(group, rows, formats[rows][0]) for idx, rows in seen if rows in formats
                  for group in ([tuple(names[i] for i in idx)] if formats[rows][0] in FUSED_FORMATS
                                else [(names[i],) for i in idx])]
        shapes = [(sum(weights[index[n]].shape[0] for n in c.weights), weights[index[c.weights[0]]].shape[1])
                  for c in copies]
        with self.codegen():  # (the micro-kernel of the ISA the graph is compiled for)
            blocks = [inductor.block_n(c.rows, *shape, self.threads, formats[c.rows][1], BLOCKED_DTYPES[c.format])
                      if c.format in BLOCKED_FORMATS else None for shape, c in zip(shapes, copies)]
        examples = tuple(packed_example(shape, c.rows, c.format, bn) for shape, c, bn in zip(shapes, copies, blocks))
        entries = [PackedWeight(weight=qnames[index[c.weights[0]]], fused=[qnames[index[n]] for n in c.weights[1:]],
                                rows=c.rows, format=c.format, block_n=bn) for c, bn in zip(copies, blocks)]
        return PackedLinears(copies, self.threads), examples, entries


@dataclass
class ProjectionLayouts:
    """A pair's GEMM choice (gemm.choose's record: the build record's "gemm") and the graphs' share of it."""
    record: dict
    pair: PairRecipe
    codegen: object

    def for_graph(self, spec: GraphSpec) -> GraphLayout | None:
        rows = graph_rows(self.pair, spec)
        chosen = gemm.format_per_rows(self.record if spec.model == "target" else self.record.get("draft"))
        formats = {r: f for r, f in chosen.items() if r in rows}
        # (threads: what the measured GEMMs ran on; blocked ones are generated for it)
        return GraphLayout(formats, self.record.get("threads", 1), rows, self.codegen) if formats else None
