"""The per-graph backends' path (export, aoti): every (role, bucket) traced with torch.export, keyed,
compiled in parallel workers through the compile cache (or fetched from it) into its own graph file,
and the weights padded, sharded and written one file per rank."""
from __future__ import annotations

import abc
import contextlib
import dataclasses
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3_runtime.manifest import GraphEntry, ModelEntry, PackedWeight, TensorSpec, dtype_name, file_entry, torch_dtype

from ..compile.cache import FETCH_TRIES, CompileCache, graph_key, trace_key, vanishing
from ..compile.scheduler import (CompileFailed, GraphJob, GraphResult, Scheduler, default_jobs, split_shard,
                                 static_estimate)
from ..compile.tracing import tracing_process_group
from ..graphs import GraphSpec, build_graph_module, step_inputs
from ..pair import BuildModels, Report, build_models, contract_outputs, graph_plan, load_pair, model_entry
from ..recipe import PairRecipe
from ..sharding import tensor_plan, write_rank_files
from .base import Backend, Written


@dataclass
class TracedGraph:
    spec: GraphSpec
    job: GraphJob
    weights: list[str]  # qualified names in call order
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    packed: list[PackedWeight] = dataclasses.field(default_factory=list)


def trace_graphs(bm: BuildModels, backend, cache: CompileCache, layouts, specs: list[GraphSpec] | None = None):
    """Key every graph; yields TracedGraph in plan order. A graph is torch.export-ed (weights as inputs,
    empty stand-ins: no memory touched) unless the trace memo already maps its trace inputs to a
    cached compile. `layouts`: the backend's projection_layouts. With tp > 1 collectives trace against a fake
    process group."""
    pair = bm.lp.pair
    dtype = torch_dtype(pair.dtype)
    t_layout, d_layout = bm.models["target"][2], bm.models["draft"][2]
    common = {"dtype": pair.dtype, "B": pair.serving.max_num_seqs,
              "L": pair.serving.max_model_len, "state": {k: v.model_dump() for k, v in bm.state.items()},
              "models": {n: {"args": dataclasses.asdict(c.args), "layout": lay.to_dict(), "class": type(m).__name__}
                         for n, (m, c, lay) in bm.models.items()},
              "aux": list(bm.lp.draft.args.aux_layer_ids)}
    for spec in (specs if specs is not None else graph_plan(pair)):
        layout = layouts.for_graph(spec) if layouts is not None else None
        fields = {**backend.key_fields(spec.role), **(layout.key_fields() if layout else {})}
        module, pnames = build_graph_module(spec, bm.models[spec.model][0])
        qnames = [bm.bindings[spec.model][n] for n in pnames]
        ins = step_inputs(spec, target_hidden=t_layout.padded_hidden, draft_hidden=d_layout.padded_hidden,
                          dtype=dtype)
        inputs = [TensorSpec(name=n, shape=s, dtype=dtype_name(x)) for n, s, x in ins]
        tkey = trace_key({**common, "backend": fields, "role": spec.role, "bucket": spec.bucket, "accept": spec.accept,
                          "shape": spec.shape.model_dump(), **({"context": spec.context} if spec.context else {}),
                          "weights": [bm.weight_shapes[q][0] for q in qnames if q in bm.weight_shapes]})
        memo = cache.get_trace(tkey)
        hit = cache.get(memo["key"]) if memo is not None else None
        outputs = contract_outputs(bm, spec)
        if hit is not None:
            job = GraphJob(spec.name, spec.role, spec.bucket, spec.tokens_per_call(), memo["key"], None, hit=hit)
            packed = [PackedWeight.model_validate(p) for p in memo.get("packed", [])]
            yield TracedGraph(spec, job, qnames, inputs, outputs, packed)
            continue
        weights = tuple(torch.empty(bm.weight_shapes[q][0], dtype=bm.weight_shapes[q][1]) for q in qnames)
        kv = torch.zeros(bm.state[spec.model].shape, dtype=dtype)
        example = tuple(torch.zeros(shape, dtype=dt_) for _, shape, dt_ in ins)
        if layout:  # (a first call finds which projections the layout serves)
            module.method = recorder = layout.recorder()
        traced = [[s, dtype_name(x)] for s, x in backend.output_specs(module, (weights, kv, *example))]
        if traced != [[o.shape, o.dtype] for o in outputs]:  # the role module strayed from manifest.ROLES
            raise RuntimeError(f"graph {spec.name} returns {traced}, the contract table says "
                               f"{[[o.shape, o.dtype] for o in outputs]}")
        packed = []
        if layout:  # the projections a layout serves take their copy as an extra input
            module.method, copies, packed = layout.plan(recorder, module.weight_names, qnames, weights, spec.name)
            weights += copies
        ep = torch.export.export(module, (weights, kv, *example), strict=False)
        key = graph_key(ep, fields)
        cache.put_trace(tkey, {"key": key, "outputs": [o.model_dump() for o in outputs],
                               "packed": [p.model_dump() for p in packed]})
        job = GraphJob(spec.name, spec.role, spec.bucket, spec.tokens_per_call(), key, ep)
        yield TracedGraph(spec, job, qnames, inputs, outputs, packed)


def compile_graphs(bm: BuildModels, backend, cache: CompileCache, layouts, jobs: int | None,
                   report: Report, specs: list[GraphSpec] | None = None, require_cached: bool = False
                   ) -> tuple[list[TracedGraph], list[GraphResult]]:
    """Trace, key and compile (or fetch from the cache) every graph; raises CompileFailed at the end
    if any failed (the others are compiled and cached regardless). `layouts`: the backend's projection_layouts,
    made before the compile workers start sharing the CPU."""
    pair = bm.lp.pair
    specs = specs if specs is not None else graph_plan(pair)
    n_jobs = jobs or default_jobs(backend, len(specs))
    sched = Scheduler(backend, pair.backend_options, cache, n_jobs, report, tp=pair.parallel.tp_degree,
                      require_cached=require_cached)
    report({"event": "stage", "stage": "graphs", "total": len(specs), "jobs": n_jobs})
    traced = []
    with tracing_process_group(pair.parallel.tp_degree):
        try:
            for tg in trace_graphs(bm, backend, cache, layouts, specs):
                traced.append(tg)
                sched.submit(tg.job)
        except BaseException:
            sched.abort()
            raise
        results = sched.finish()
    failed = [r for r in results if r.status == "failed"]
    if failed:
        raise CompileFailed(failed)
    by_name = {r.job.name: r for r in results}
    return traced, [by_name[tg.spec.name] for tg in traced]


def shard_specs(pair: PairRecipe, backend, index: int, count: int) -> list[GraphSpec]:
    """This builder's share of the graphs for `compile --shard index/count` (same split everywhere)."""
    specs = graph_plan(pair)
    mine = split_shard([(s.name, static_estimate(backend, s.role, s.tokens_per_call())) for s in specs],
                       index, count)
    return [s for s in specs if s.name in mine]


def fetch_graphs(bm: BuildModels, backend, cache: CompileCache, layouts, jobs: int | None,
                 report: Report, require_cached: bool, into: Path) -> list[tuple[TracedGraph, GraphResult]]:
    """Compile or fetch every graph (`compile_graphs`) and copy its cache entry's files into `into`. An entry
    that a concurrent `cache prune` / `clear` removed before its copy is a miss: compiled again."""
    done: dict[str, tuple[TracedGraph, GraphResult]] = {}
    specs = None
    for _ in range(FETCH_TRIES):
        traced, results = compile_graphs(bm, backend, cache, layouts, jobs, report, specs, require_cached=require_cached)
        specs = []
        for tg, res in zip(traced, results):
            try:
                for fname in res.entry.files:
                    shutil.copyfile(res.entry.path / fname, into / graph_file(tg.spec.name, fname))
            except FileNotFoundError:
                specs.append(tg.spec)
            else:
                done[tg.spec.name] = (tg, res)
        if not specs:
            return [done[spec.name] for spec in graph_plan(bm.lp.pair)]
    raise vanishing(cache, [spec.name for spec in specs])


def graph_file(graph: str, fname: str) -> str:
    """A cache entry's file as the bundle names it: graph.pt2 -> <graph>.pt2, graph.neff -> <graph>.neff."""
    return graph + fname[len("graph"):]


class PerGraphBackend(Backend):
    """A backend that compiles one exported graph at a time (in the scheduler's worker processes)."""

    @abc.abstractmethod
    def compile_exported(self, ep, out: Path, key: str, role: str) -> dict:
        """Compile one graph to `out`; returns the info recorded in the manifest's graph entry."""

    def codegen(self) -> contextlib.AbstractContextManager:
        """Inside: what the compiler is set to generate code for (the aoti backend's CPU vector ISA)."""
        return contextlib.nullcontext()

    def write_graphs(self, bm: BuildModels, root: Path, cache: CompileCache, jobs: int | None, report: Report,
                     require_cached: bool) -> Written:
        return write_graphs(bm, root, self, cache, jobs, report, require_cached)

    def compile_shard(self, pair: PairRecipe, index: int, count: int, cache: CompileCache, jobs: int | None,
                      report: Report) -> list[GraphResult]:
        report({"event": "stage", "stage": "load"})
        bm = build_models(load_pair(pair))
        specs = shard_specs(pair, self, index, count)
        report({"event": "shard", "index": index, "count": count, "graphs": [s.name for s in specs]})
        return compile_graphs(bm, self, cache, self.projection_layouts(bm, cache, report), jobs, report, specs)[1]

    @classmethod
    def plan_keys(cls, bm: BuildModels, backend: Backend | None, cache: CompileCache) -> dict[str, str]:
        if backend is None:
            return {}
        with tracing_process_group(bm.lp.pair.parallel.tp_degree):
            layouts = backend.projection_layouts(bm, cache)
            return {tg.spec.name: tg.job.key for tg in trace_graphs(bm, backend, cache, layouts)}


def write_graphs(bm: BuildModels, root: Path, backend, cache: CompileCache, jobs: int | None, report: Report,
                 require_cached: bool) -> Written:
    """One graph file per (role, bucket) under root/graphs, then one weight file per rank and model."""
    t0 = time.perf_counter()
    layouts = backend.projection_layouts(bm, cache, report)
    fetched = fetch_graphs(bm, backend, cache, layouts, jobs, report, require_cached, root / "graphs")
    graph_entries, extra_files = [], []
    for tg, res in fetched:
        info = dict(res.entry.meta["info"])
        main = None
        for fname in res.entry.files:
            dest = root / "graphs" / graph_file(tg.spec.name, fname)
            if fname == f"graph{backend.SUFFIX}":
                main = dest
            else:
                extra_files.append(dest)
                if info.get("neff") == fname:
                    info["neff"] = dest.name
        graph_entries.append(GraphEntry(
            name=tg.spec.name, role=tg.spec.role, model=tg.spec.model, bucket=tg.spec.bucket, shape=tg.spec.variant,
            context=tg.spec.context,
            file=file_entry(root, main), weights=tg.weights, packed=tg.packed, state=bm.state[tg.spec.model].name,
            inputs=tg.inputs, outputs=tg.outputs, backend=info, key=tg.job.key))

    # weights: padded + sharded, streamed tensor by tensor into one file per rank
    model_entries: dict[str, ModelEntry] = {}
    for name, (model, ckpt, layout) in bm.models.items():
        report({"event": "stage", "stage": f"weights ({name})"})
        own = [n for n, q in bm.bindings[name].items() if q == f"{name}/{n}"]
        shapes = {n: bm.weight_shapes[f"{name}/{n}"] for n in own}
        files = write_rank_files(name, ckpt.tensors, own, shapes, layout, root / "weights" / name)
        tensors = {}
        for n in own:
            plan = tensor_plan(name, n)
            tensors[n] = TensorSpec(name=n, shape=shapes[n][0], dtype=dtype_name(shapes[n][1]),
                                    pad=plan.pad, shard=plan.shard)
        model_entries[name] = model_entry(bm, name, root, files, tensors)

    results = [res for _, res in fetched]
    counts = {st: sum(r.status == st for r in results) for st in ("compiled", "cached")}
    timings = {r.job.name: {"status": r.status, "seconds": round(r.seconds, 2)} for r in results}
    build = {**counts, "seconds": round(time.perf_counter() - t0, 2), "graphs": timings}
    return Written(graph_entries, model_entries, extra_files, {**build, "gemm": layouts.record} if layouts else build)
