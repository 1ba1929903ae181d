"""The neuron backend's bundle: one NxD model per model (every role, bucket and rank, compiled SPMD by its
ModelBuilder: model.py) and NxD's per-rank checkpoints, keyed by the traced parameter names plus the rank
weight; what `plan` says each ModelBuilder gets."""
from __future__ import annotations

import dataclasses
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3_runtime.backends.neuron_sdk import NEFF_GENERATION
from eagle3_runtime.manifest import GraphEntry, TensorSpec, dtype_name, file_entry, torch_dtype

from ...compile.cache import FETCH_TRIES, CompileCache, trace_key, vanishing
from ...compile.scheduler import CompileFailed, GraphJob, GraphResult
from ...errors import UserError
from ...graphs import step_inputs
from ...host import available_memory_gb, host_cores
from ...models.weights import weight_tensors
from ...pair import BuildModels, Report, contract_outputs, graph_plan, jsonable, model_entry
from ...sharding import tensor_plan, write_rank_files
from ..base import Written
from . import neff
from .memory import BuilderMemory, build_jobs, job_memory_gb
from .model import (INDEX_DTYPE, RANK_WEIGHT, ModelGraphs, compiler_args, key_role, priority_key, spec_key,
                    rank_weights, shard_file, weight_dtype, weight_key)


@dataclass
class SpmdModel:
    """One model of a neuron bundle as its ModelBuilder sees it, with its cache key and manifest inputs."""

    graphs: object  # backends.neuron.ModelGraphs
    key: str
    inputs: dict[str, list[TensorSpec]]  # graph name -> manifest inputs (the rank first)
    names: list[str]  # canonical weight names, in file order

    def shard_bytes(self) -> int:
        """Tensor bytes of one rank's NxD checkpoint (its weights plus the int32 rank weight)."""
        return sum(math.prod(sh) * x.itemsize for sh, x in self.graphs.weights.values()) + 4

    def memory(self) -> BuilderMemory:
        mg = self.graphs
        buckets = {k: sum(spec_key(sp) == k for sp, _ in mg.graphs) or 1 for k in mg.keys()}
        shape, dtype = mg.state
        return BuilderMemory(mg.name, self.shard_bytes(), math.prod(shape) * dtype.itemsize, len(buckets),
                             sum(n > 1 for n in buckets.values()), sum(buckets.values()))


def spmd_models(bm: BuildModels, backend=None) -> dict[str, SpmdModel]:
    """What each model's ModelBuilder gets (shared by the build and `plan`; `backend` None: no SDK, no key)."""
    pair = bm.lp.pair
    dtype, tp = torch_dtype(pair.dtype), pair.parallel.tp_degree
    t_layout, d_layout = bm.models["target"][2], bm.models["draft"][2]
    out = {}
    for name, (model, ckpt, layout) in bm.models.items():
        local = weight_tensors(model)
        names = list(local)
        shapes = {n: (list(x.shape), weight_dtype(dtype if x.dtype.is_floating_point else x.dtype))
                  for n, x in local.items()}
        graphs, inputs = [], {}
        for spec in (sp for sp in graph_plan(pair) if sp.model == name):
            ins = step_inputs(spec, target_hidden=t_layout.padded_hidden, draft_hidden=d_layout.padded_hidden,
                              dtype=dtype, index_dtype=INDEX_DTYPE)
            graphs.append((spec, ins[1:]))
            inputs[spec.name] = [TensorSpec(name=n, shape=sh, dtype=dtype_name(x)) for n, sh, x in ins]
        state = bm.state[name]
        mg = ModelGraphs(name, model, shapes, (state.shape, torch_dtype(state.dtype)), graphs,
                         n_out=max(sp.n_outputs() for sp, _ in graphs))
        key = "" if backend is None else trace_key({
            "spmd_model": name, "dtype": pair.dtype, "B": pair.serving.max_num_seqs,
            "state": state.model_dump(), "tp": tp, "class": type(model).__name__,
            "args": jsonable(dataclasses.asdict(ckpt.args)), "layout": layout.to_dict(),
            "graphs": [[spec_key(sp), sp.bucket, sp.shape.model_dump(), sp.accept, [[n, sh, str(x)] for n, sh, x in ins]]
                       for sp, ins in graphs],
            "weights": {n: [sh, str(x)] for n, (sh, x) in shapes.items()},
            "backend": {k: backend.key_fields(key_role(k)) for k in mg.keys()}})
        out[name] = SpmdModel(mg, key, inputs, names)
    return out


def write_graphs(bm: BuildModels, root: Path, backend, cache: CompileCache, jobs: int | None, report: Report,
                 require_cached: bool) -> Written:
    """Neuron: one NxD model per model (every role, bucket and rank; model.py) and NxD's
    per-rank checkpoints, keyed by the traced parameter names plus the rank weight."""
    pair, t0 = bm.lp.pair, time.perf_counter()
    tp = pair.parallel.tp_degree
    graph_entries, extra_files, model_entries, timings, status = [], [], {}, {}, {}
    models = spmd_models(bm, backend)
    neff_gen = backend.generation == NEFF_GENERATION  # (one NEFF per graph: nothing routed by shapes)
    for sm in models.values():  # before anything compiles
        if not neff_gen:
            sm.graphs.check_routing()
            priority_key(sm.graphs, tp)
    misses = [sm.memory() for sm in models.values() if cache.get(sm.key, check=False) is None]
    jobs = build_jobs(misses, jobs, available_memory_gb(), backend.job_memory_gb, pair.name)
    report({"event": "stage", "stage": "graphs", "total": len(graph_plan(pair)), "jobs": jobs})
    for name, sm in models.items():
        model, ckpt, layout = bm.models[name]
        mg, key, names, graphs = sm.graphs, sm.key, sm.names, sm.graphs.graphs
        shapes, entries_in, state = mg.weights, sm.inputs, bm.state[name]
        t_model = time.perf_counter()
        entry, status[name] = _fetch_model(sm, name, backend, cache, tp, jobs, report, require_cached,
                                           root / "graphs")
        info = entry.meta["info"]
        graph_neffs = {info[sp.name].get("neff") for sp, _ in graphs} if neff_gen else set()
        extra_files += [root / "graphs" / fname for fname in entry.files
                        if fname.endswith((".neff", ".hlo")) and fname not in graph_neffs]
        model_file = None if neff_gen else file_entry(root, root / "graphs" / f"{name}{backend.SUFFIX}")
        qualified = [f"{name}/{weight_key(n)}" for n in names] + [f"{name}/{RANK_WEIGHT}"]
        for sp, _ in graphs:
            gi = dict(info[sp.name])
            if neff_gen:
                gi = neff.entry_fields(info, sp.name, entries_in[sp.name], contract_outputs(bm, sp), "graphs/")
            elif "neff" in gi:
                gi["neff"] = f"graphs/{gi['neff']}"
            graph_entries.append(GraphEntry(
                name=sp.name, role=sp.role, model=name, bucket=sp.bucket, shape=sp.variant, context=sp.context,
                file=file_entry(root, root / gi["neff"]) if neff_gen else model_file,
                weights=qualified,
                state=state.name, inputs=entries_in[sp.name], outputs=contract_outputs(bm, sp),
                backend=gi, key=key))
            timings[sp.name] = {"status": status[name], "seconds": round(time.perf_counter() - t_model, 2)}
            report({"event": "graph", "graph": sp.name, "role": sp.role, "bucket": sp.bucket, "key": key,
                    "status": status[name], "estimate": 0.0})

        report({"event": "stage", "stage": f"weights ({name})"})
        sources = {n: bm.lp.target.tensors for n, q in bm.bindings[name].items() if q != f"{name}/{n}"}
        files = write_rank_files(name, ckpt.tensors, names, shapes, layout, root / "weights" / name,
                                 file_name=shard_file, key=weight_key, sources=sources, extra=rank_weights)
        tensors = {weight_key(n): TensorSpec(name=weight_key(n), shape=shapes[n][0], dtype=dtype_name(shapes[n][1]),
                                             pad=tensor_plan(name, n).pad, shard=tensor_plan(name, n).shard)
                   for n in names}
        tensors[RANK_WEIGHT] = TensorSpec(name=RANK_WEIGHT, shape=[1], dtype="int32", shard="rank")
        model_entries[name] = model_entry(bm, name, root, files, tensors)
    counts = {st: sum(v == st for v in status.values()) for st in ("compiled", "cached")}
    return Written(graph_entries, model_entries, extra_files,
                   {**counts, "unit": "model", "seconds": round(time.perf_counter() - t0, 2), "graphs": timings})


def _fetch_model(sm: SpmdModel, name: str, backend, cache: CompileCache, tp: int, jobs: int, report: Report,
                 require_cached: bool, into: Path) -> tuple:
    """`_spmd_entry`, its files copied into `into`; an entry a concurrent `cache prune` / `clear` removed
    before its copy is a miss: compiled again."""
    for _ in range(FETCH_TRIES):
        entry, status = _spmd_entry(sm, name, backend, cache, tp, jobs, report, require_cached)
        try:
            for fname in entry.files:
                shutil.copyfile(entry.path / fname, into / fname)
        except FileNotFoundError:
            continue
        return entry, status
    raise vanishing(cache, [name])


def _spmd_entry(sm: SpmdModel, name: str, backend, cache: CompileCache, tp: int, jobs: int, report: Report,
                require_cached: bool) -> tuple:
    """One model's cache entry, compiled (through its ModelBuilder) on a miss -> (entry, "cached" | "compiled")."""
    entry, t_model = cache.get(sm.key), time.perf_counter()
    if entry is not None:
        return entry, "cached"
    for sp, _ in sm.graphs.graphs:
        report({"event": "graph", "graph": sp.name, "role": sp.role, "bucket": sp.bucket, "key": sm.key,
                "status": "compiling", "estimate": 0.0})
    if require_cached:
        raise CompileFailed([GraphResult(GraphJob(name, name, 0, 0, sm.key, None), "failed",
                                         error="not in the compile cache (--require-cached)")])
    staged = cache.staging_dir()
    try:
        info = backend.compile_model(sm.graphs, tp, staged, jobs)
    except UserError:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    except Exception as e:  # one failure for the model's builder, with its log, as for any graph
        shutil.rmtree(staged, ignore_errors=True)
        import traceback

        error = f"{type(e).__name__}: {e}"
        log = cache.record_failure(sm.key, {"graph": name, "backend": backend.NAME, "error": error},
                                   traceback.format_exc())
        raise CompileFailed([GraphResult(GraphJob(f"{name} (ModelBuilder)", name, 0, 0, sm.key, None), "failed",
                                         error=error, log=log)]) from e
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    entry = cache.put(sm.key, staged, {"backend": backend.NAME, "graph": name, "role": name, "bucket": 0, "tokens": 0,
                                       "compile_seconds": round(time.perf_counter() - t_model, 3), "info": info})
    return entry, "compiled"


def plan_builders(bm, backend, cache: CompileCache, cc_args: dict) -> list[dict]:
    """Neuron: what each model's ModelBuilder gets — keys (roles + kv_move) with their buckets, the
    priority bucket, flags, the NEFFs — the per-rank NxD checkpoint files it is served with, and what it
    asks of this host's memory."""
    out = []
    pair = bm.lp.pair
    tp = pair.parallel.tp_degree
    models = spmd_models(bm, backend)
    job_gb, available = job_memory_gb(pair.backend_options), available_memory_gb()
    fit = min(sm.memory().jobs_that_fit(available, job_gb) for sm in models.values())
    jobs = max(1, min(host_cores(), fit))
    for name, sm in models.items():
        keys, priority = [], priority_key(sm.graphs, tp)
        for key in sm.graphs.keys():
            specs = [sp for sp, _ in sm.graphs.graphs if spec_key(sp) == key]
            keys.append({"key": key, "buckets": [sp.bucket for sp in specs] or [1],
                         "priority_bucket": 0 if key == priority else None,
                         "compiler_args": cc_args.get(key_role(key)) or compiler_args(pair.backend_options,
                                                                                       key_role(key)),
                         "neffs": [f"graphs/{sp.name}.neff" for sp in specs] or [f"graphs/{name}_{key}.neff"]})
        status = "unknown" if not sm.key else ("hit" if cache.get(sm.key, check=False) else "miss")
        out.append({"model": name, "artifact": f"graphs/{name}.pt", "tp_degree": tp, "arity": sm.graphs.arity,
                    "cache": status, "key": sm.key or None, "keys": keys,
                    "shard_files": [{"path": f"weights/{name}/{shard_file(r)}", "bytes": sm.shard_bytes()}
                                    for r in range(tp)],
                    "memory": sm.memory().to_dict(jobs, job_gb) | {"job_memory_gb": job_gb,
                                                                    "host_available_gb": round(available, 1)},
                    "describe_memory": sm.memory().describe(jobs, job_gb)})
    return out
