"""recipe pair -> bundle directory.

checkpoints -> pair checks -> per-rank weights -> one graph file per (role, bucket) -> tokenizer and
configs -> manifest.json. Everything is written into a temporary sibling directory that is swapped
into place only when complete, so a failed build never leaves a half-written bundle and the old
bundle stays until the new one is whole. The destination must be new, empty or a bundle this tool
wrote (`check_out`): a build never replaces anything else. Temporary siblings carry their builder's
pid (`.NAME.tmp-<owner>-*`, `.NAME.old-<owner>`); a later build removes those of a killed one.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime as dt
import errno
import functools
import json
import math
import os
import platform
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from eagle3_runtime.manifest import (MANIFEST, SCHEMA_VERSION, GraphEntry, Manifest, ModelEntry, PackedWeight,
                                     TensorSpec, dtype_name, file_entry, kv_cache_length, kv_state_name, torch_dtype)
from eagle3_runtime.packing import pack_weight

from . import __version__
from .backends.registry import get_backend
from .checkpoints.load import DraftCheckpoint, TargetCheckpoint, load_draft, load_target
from .checkpoints.pair import build_draft, build_target, check_pair, check_target
from .checkpoints.sources import resolve
from .compile.cache import CompileCache, graph_key, owner_tag, stale, trace_key
from .compile.scheduler import (CompileFailed, GraphJob, GraphResult, Scheduler, default_jobs, split_shard,
                                static_estimate)
from .compile.tracing import tracing_process_group
from .errors import UserError
from .files import nearest_existing
from .graphs import GraphSpec, build_graph_module, plan_graphs, step_inputs
from .models.eagle3 import draft_layout
from .models.llama import llama_layout
from .models.weights import weight_tensors
from .recipe import PairRecipe
from .sharding import check_tp, tensor_plan, write_rank_files

NAME_MAX = 255  # bytes in one file name (Linux filesystems)


@dataclass
class LoadedPair:
    pair: PairRecipe
    target: TargetCheckpoint
    draft: DraftCheckpoint


def load_pair(pair: PairRecipe) -> LoadedPair:
    target = load_target(resolve(pair.target, "target"))
    check_target(target)
    draft = load_draft(resolve(pair.draft, "draft"), target)
    check_pair(target, draft)
    window = getattr(target.args, "sliding_window", None)
    if window and any(layer == "sliding_attention" for layer in target.args.layer_types) and \
            pair.speculation.num_speculative_tokens >= window:
        # (a tree node's slot and position differ; the window is applied to slots: exact while depth < window)
        raise UserError(f"speculation: depth {pair.speculation.num_speculative_tokens} must be below the target's "
                        f"sliding_window {window}; lower num_speculative_tokens")
    return LoadedPair(pair, target, draft)


def graph_plan(pair: PairRecipe) -> list[GraphSpec]:
    return plan_graphs(pair.buckets.prefill, pair.speculation.shapes)


Report = Callable[[dict], None]


def build_bundle(pair: PairRecipe, out: Path, report: Report | None = None, *, cache: CompileCache | None = None,
                 jobs: int | None = None, require_cached: bool = False) -> Manifest:
    """Build one pair into `out` (replaced atomically). Returns the manifest written.

    `report` receives progress events (dicts with an "event" key: stage | graph); `cache` defaults
    to $EAGLE3_BUILD_CACHE; `jobs` to what the cores and memory allow for the backend. Raises
    UserError when `out` may not be replaced (`check_out`), CompileFailed (after every other graph
    was compiled and cached) when any graph fails."""
    started = time.time()
    report = report or (lambda ev: None)
    backend = get_backend(pair.backend, pair.backend_options)
    cache = cache or CompileCache()
    out = Path(out)
    check_out(out, pair, keep=[("the compile cache", cache.root)])
    cache.open(keep=[("the bundle directory", out)])
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(out.parent, started)
    cache.clean_tmp(started)
    report({"event": "stage", "stage": "load"})
    lp = load_pair(pair)
    written = []

    def write(tmp: Path) -> None:
        written.append(_write_bundle(lp, tmp, backend, cache, jobs, report, require_cached))

    try:
        replace_staged(out, write)
    except OSError as e:
        if e.filename is None:  # (a write to an open file names no path: it was the bundle's)
            raise OSError(e.errno, e.strerror, str(out)) from e
        raise
    return written[0]


# ------------------------------------------------------------------ the destination

def is_bundle(d: Path) -> bool:
    """A bundle this tool wrote: a directory whose manifest.json is a JSON object with the manifest's keys."""
    try:
        raw = json.loads((d / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and {"schema_version", "digest", "graphs", "files"} <= raw.keys()


def check_out(out: Path, pair: PairRecipe, keep: Iterable[tuple[str, Path]] = ()) -> None:
    """Refuse (UserError) a bundle directory this build must not replace, before any work: one that is
    or contains the current directory, the home directory, the pair's checkpoints or a (what, path) in
    `keep` (the recipe, the cache), and anything that exists but is neither an empty directory nor a bundle."""
    real = out.resolve()
    sources = [(f"the {role} checkpoint", Path(s.path)) for role, s in (("target", pair.target), ("draft", pair.draft))
               if s.path]
    guarded = [("the current directory", Path.cwd()), ("your home directory", Path(os.path.expanduser("~"))),
               *sources, *keep]
    for what, path in guarded:
        path = Path(path).resolve()
        if real == path or real in path.parents:
            raise UserError(f"bundle directory {out} is or contains {what} ({path}); a build replaces its bundle "
                            f"directory as a whole: choose a new one (e.g. --out artifacts/{pair.name})")
    parent = nearest_existing(out.parent)
    if parent is not None and not parent.is_dir():
        raise UserError(f"bundle directory {out}: {parent} is a file, not a directory; choose another --out path")
    if len(os.fsencode(f".{out.name}.tmp-{owner_tag()}-abcd1234")) > NAME_MAX:  # (its temporary sibling's name)
        raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG), str(out))
    check_replaceable(out)


def check_replaceable(out: Path) -> None:
    """Refuse (UserError) to replace anything at `out` but an empty directory or a bundle this tool wrote."""
    if out.is_symlink():
        raise UserError(f"bundle directory {out} is a symbolic link; give the directory it points to, "
                        "or remove the link yourself")
    if not out.exists():
        return
    if not out.is_dir():
        raise UserError(f"bundle directory {out} is an existing file; choose another --out path or remove "
                        "the file yourself")
    if any(out.iterdir()) and not is_bundle(out):
        raise UserError(f"bundle directory {out} exists and is not a bundle written by eagle3-build (no valid "
                        f"{MANIFEST}); nothing was touched: choose another --out path or remove it yourself")


def replace_staged(dest: Path, fill: Callable[[Path], None]) -> None:
    """Fill a new sibling of `dest` named after this builder (`.NAME.tmp-<owner>-*`), then swap it in
    (`replace_dir`); on any failure the sibling goes (after the swap: the old tree) and `dest` stays."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-{owner_tag()}-", dir=dest.parent))
    try:
        fill(tmp)
        replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_dir(tmp: Path, out: Path) -> None:
    """Put the finished bundle `tmp` at `out`. Every state in between has the old or the new bundle at
    `out` (an atomic swap), or, where the filesystem cannot swap, the old one at `.NAME.old-<owner>`
    for the instant between two renames (`clean_leftovers` puts it back if the build dies there)."""
    check_replaceable(out)  # (again: it may have changed during the build)
    try:
        _exchange(tmp, out)  # out: the new bundle; tmp: the old one, removed by the caller or a later build
    except FileNotFoundError:  # nothing at out
        os.rename(tmp, out)
        return
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
            raise
        old = out.with_name(f".{out.name}.old-{owner_tag()}")
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(old, out)  # the old bundle goes back
            raise
        tmp = old
    shutil.rmtree(tmp, ignore_errors=True)


def _exchange(a: Path, b: Path) -> None:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); OSError ENOSYS where unavailable."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a), None, str(b))


_LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)-(?P<host>[0-9a-f]{8})(?:-[a-z0-9_]+)?")


def clean_leftovers(parent: Path, before: float) -> None:
    """Remove what killed builds left next to their bundles in `parent` (see `stale`): `.NAME.tmp-*` (an
    unfinished bundle, or an old one after the swap) and `.NAME.old-*` (an old bundle between two
    renames: put back at NAME when nothing is there, else removed). Nothing else is touched."""
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for d in entries:
        m = _LEFTOVER.fullmatch(d.name)
        if m is None or d.is_symlink() or not d.is_dir() or not stale(d, int(m["pid"]), m["host"], before):
            continue
        if m["kind"] == "old" and not os.path.lexists(d.with_name(m["name"])):
            with contextlib.suppress(OSError):  # (another build may have put it back first)
                os.rename(d, d.with_name(m["name"]))
            continue
        shutil.rmtree(d, ignore_errors=True)


def layouts(pair: PairRecipe, t: TargetCheckpoint, d: DraftCheckpoint):
    """Target and draft layouts for the recipe's tp degree and hidden padding (refusing what cannot fit)."""
    tp, Hp = pair.parallel.tp_degree, pair.parallel.padded_hidden_size
    check_tp("target", t.args.num_heads, t.args.num_kv_heads, tp)
    check_tp("draft", d.args.num_heads, d.args.num_kv_heads, tp)
    if Hp is not None:
        if Hp < t.args.hidden_size:
            raise UserError(f"parallel.padded_hidden_size {Hp} is smaller than the target hidden size "
                            f"{t.args.hidden_size}")
        if d.args.hidden_size != t.args.hidden_size:
            raise UserError(f"parallel.padded_hidden_size needs draft hidden == target hidden "
                            f"({d.args.hidden_size} != {t.args.hidden_size})")
    return llama_layout(t.args, tp, Hp), draft_layout(d.args, tp, Hp, Hp)


@dataclass
class BuildModels:
    """The pair's rank-local models on the meta device and everything tracing needs."""

    lp: LoadedPair
    models: dict  # "target"/"draft" -> (model, checkpoint, layout)
    bindings: dict[str, dict[str, str]]  # model -> {param name -> qualified weight name}
    weight_shapes: dict[str, tuple[list[int], torch.dtype]]  # qualified name -> (shape, dtype)
    state: dict[str, TensorSpec]  # KV caches


def build_models(lp: LoadedPair) -> BuildModels:
    pair, t, d = lp.pair, lp.target, lp.draft
    dtype = torch_dtype(pair.dtype)
    B, L = pair.serving.max_num_seqs, pair.serving.max_model_len
    t_layout, d_layout = layouts(pair, t, d)
    target_model = build_target(t, d.args.aux_layer_ids, t_layout)
    draft_model = build_draft(d, d_layout)
    models = {"target": (target_model, t, t_layout), "draft": (draft_model, d, d_layout)}
    bindings, weight_shapes = {}, {}
    for name, (model, ckpt, _) in models.items():
        local = weight_tensors(model)
        own = {n for n in local if n in ckpt.tensors}
        bindings[name] = {n: (f"{name}/{n}" if n in own else f"target/{n}") for n in local}
        for n, x in local.items():
            if n in own:
                weight_shapes[f"{name}/{n}"] = (list(x.shape), dtype if x.dtype.is_floating_point else x.dtype)
    # KV caches (rank-local heads), with the scratch positions of manifest.kv_cache_length
    S = kv_cache_length(L, pair.speculation.scratch())
    state = {
        "target": TensorSpec(name=kv_state_name("target"), shape=target_model.kv_shape(B, S), dtype=dtype_name(dtype)),
        "draft": TensorSpec(name=kv_state_name("draft"), shape=draft_model.kv_shape(B, S), dtype=dtype_name(dtype)),
    }
    return BuildModels(lp, models, bindings, weight_shapes, state)


def contract_outputs(bm: BuildModels, spec: GraphSpec) -> list[TensorSpec]:
    """A graph's outputs as the runtime returns them, from the contract table (manifest.ROLES)."""
    pair = bm.lp.pair
    outs = spec.contract.output_specs(spec.bucket, spec.shape,
                                      target_hidden=bm.models["target"][2].padded_hidden,
                                      draft_hidden=bm.models["draft"][2].padded_hidden,
                                      vocab=bm.lp.target.args.vocab_size, dtype=pair.dtype)
    return [TensorSpec(name=n, shape=sh, dtype=x) for n, sh, x in outs]


@dataclass
class TracedGraph:
    spec: GraphSpec
    job: GraphJob
    weights: list[str]  # qualified names in call order
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    packed: list[PackedWeight] = dataclasses.field(default_factory=list)


@functools.lru_cache(maxsize=None)
def packed_shape(shape: tuple[int, ...], rows: int, fmt: str) -> list[int]:
    """The shape of a packed copy (what the runtime's pack_weight makes on this host)."""
    return list(pack_weight(torch.empty(shape), rows, fmt).shape)


def trace_graphs(bm: BuildModels, backend, cache: CompileCache, specs: list[GraphSpec] | None = None):
    """Key every graph; yields TracedGraph in plan order. A graph is torch.export-ed (weights as inputs,
    empty stand-ins: no memory touched) unless the trace memo already maps its trace inputs to a
    cached compile. With tp > 1 collectives trace against a fake process group."""
    pair = bm.lp.pair
    dtype = torch_dtype(pair.dtype)
    t_layout, d_layout = bm.models["target"][2], bm.models["draft"][2]
    common = {"dtype": pair.dtype, "B": pair.serving.max_num_seqs,
              "L": pair.serving.max_model_len, "state": {k: v.model_dump() for k, v in bm.state.items()},
              "models": {n: {"args": dataclasses.asdict(c.args), "layout": lay.to_dict(), "class": type(m).__name__}
                         for n, (m, c, lay) in bm.models.items()},
              "aux": list(bm.lp.draft.args.aux_layer_ids)}
    for spec in (specs if specs is not None else graph_plan(pair)):
        model = bm.models[spec.model][0]
        fields = backend.key_fields(spec.role)
        module, pnames = build_graph_module(spec, model)
        qnames = [bm.bindings[spec.model][n] for n in pnames]
        ins = step_inputs(spec, target_hidden=t_layout.padded_hidden, draft_hidden=d_layout.padded_hidden,
                          dtype=dtype)
        inputs = [TensorSpec(name=n, shape=s, dtype=dtype_name(x)) for n, s, x in ins]
        tkey = trace_key({**common, "backend": fields, "role": spec.role, "bucket": spec.bucket,
                          "shape": spec.shape.model_dump(),
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
        fmt = backend.pack_format(pair.dtype)
        module.packable = [] if fmt else None
        traced = [[s, dtype_name(x)] for s, x in backend.output_specs(module, (weights, kv, *example))]
        if traced != [[o.shape, o.dtype] for o in outputs]:  # the role module strayed from manifest.ROLES
            raise RuntimeError(f"graph {spec.name} returns {traced}, the contract table says "
                               f"{[[o.shape, o.dtype] for o in outputs]}")
        packed = []
        if fmt:  # the projections that packing serves take their packed copy as an extra input
            module.packed, module.packable = module.packable, None
            weights += tuple(torch.empty(packed_shape(tuple(weights[i].shape), rows, fmt)) for i, rows in module.packed)
            packed = [PackedWeight(weight=qnames[i], rows=rows, format=fmt) for i, rows in module.packed]
        ep = torch.export.export(module, (weights, kv, *example), strict=False)
        key = graph_key(ep, fields)
        cache.put_trace(tkey, {"key": key, "outputs": [o.model_dump() for o in outputs],
                               "packed": [p.model_dump() for p in packed]})
        job = GraphJob(spec.name, spec.role, spec.bucket, spec.tokens_per_call(), key, ep)
        yield TracedGraph(spec, job, qnames, inputs, outputs, packed)


def compile_graphs(bm: BuildModels, backend, cache: CompileCache, jobs: int | None, report: Report,
                   specs: list[GraphSpec] | None = None, require_cached: bool = False
                   ) -> tuple[list[TracedGraph], list[GraphResult]]:
    """Trace, key and compile (or fetch from the cache) every graph; raises CompileFailed at the end
    if any failed (the others are compiled and cached regardless)."""
    pair = bm.lp.pair
    specs = specs if specs is not None else graph_plan(pair)
    n_jobs = jobs or default_jobs(backend, len(specs))
    sched = Scheduler(backend, pair.backend_options, cache, n_jobs, report, tp=pair.parallel.tp_degree,
                      require_cached=require_cached)
    report({"event": "stage", "stage": "graphs", "total": len(specs), "jobs": n_jobs})
    traced = []
    with tracing_process_group(pair.parallel.tp_degree):
        try:
            for tg in trace_graphs(bm, backend, cache, specs):
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


def shard_specs(pair: PairRecipe, index: int, count: int) -> list[GraphSpec]:
    """This builder's share of the graphs for `compile --shard index/count` (same split everywhere)."""
    specs = graph_plan(pair)
    mine = split_shard([(s.name, static_estimate(pair.backend, s.role, s.tokens_per_call())) for s in specs],
                       index, count)
    return [s for s in specs if s.name in mine]


def compile_shard(pair: PairRecipe, index: int, count: int, report: Report | None = None, *,
                  cache: CompileCache | None = None, jobs: int | None = None) -> list[GraphResult]:
    """Compile one shard of a pair's graphs into the cache; writes no bundle. Raises CompileFailed."""
    report = report or (lambda ev: None)
    backend = get_backend(pair.backend, pair.backend_options)
    if backend.SPMD:
        raise UserError("compile --shard splits a bundle's graphs across builders; a neuron bundle compiles per model "
                        "through NxD's ModelBuilder (which runs its buckets' neuronx-cc jobs in parallel itself): "
                        "run `eagle3-build compile RECIPE` without --shard")
    cache = (cache or CompileCache()).open()
    cache.clean_tmp(time.time())
    report({"event": "stage", "stage": "load"})
    bm = build_models(load_pair(pair))
    specs = shard_specs(pair, index, count)
    report({"event": "shard", "index": index, "count": count, "graphs": [s.name for s in specs]})
    return compile_graphs(bm, backend, cache, jobs, report, specs)[1]


FETCH_TRIES = 3  # a cache entry removed (`cache prune`, `cache clear`) before its copy is fetched again


def fetch_graphs(bm: BuildModels, backend, cache: CompileCache, jobs: int | None, report: Report,
                 require_cached: bool, into: Path) -> list[tuple[TracedGraph, GraphResult]]:
    """Compile or fetch every graph (`compile_graphs`) and copy its cache entry's files into `into`. An entry
    that a concurrent `cache prune` / `clear` removed before its copy is a miss: compiled again."""
    done: dict[str, tuple[TracedGraph, GraphResult]] = {}
    specs = None
    for _ in range(FETCH_TRIES):
        traced, results = compile_graphs(bm, backend, cache, jobs, report, specs, require_cached=require_cached)
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


def vanishing(cache: CompileCache, names: list[str]) -> UserError:
    return UserError(f"compile cache {cache.root}: the entries of {', '.join(names)} were removed {FETCH_TRIES} "
                     "times while this build copied them; stop the `cache prune` / `cache clear` running on that "
                     "cache and build again")


def _write_bundle(lp: LoadedPair, root: Path, backend, cache: CompileCache, jobs: int | None,
                  report: Report, require_cached: bool = False) -> Manifest:
    t0 = time.perf_counter()
    bm = build_models(lp)

    # --- graphs first (the long, fallible part): traced, keyed, compiled or fetched from the cache
    (root / "graphs").mkdir()
    if backend.SPMD:
        return _write_spmd_bundle(bm, root, backend, cache, report, require_cached, t0)
    fetched = fetch_graphs(bm, backend, cache, jobs, report, require_cached, root / "graphs")
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
            name=tg.spec.name, role=tg.spec.role, model=tg.spec.model, bucket=tg.spec.bucket,
            file=file_entry(root, main), weights=tg.weights, packed=tg.packed, state=bm.state[tg.spec.model].name,
            inputs=tg.inputs, outputs=tg.outputs, backend=info, key=tg.job.key))

    # --- weights: padded + sharded, streamed tensor by tensor into one file per rank
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
        model_entries[name] = _model_entry(bm, name, root, files, tensors)

    results = [res for _, res in fetched]
    counts = {st: sum(r.status == st for r in results) for st in ("compiled", "cached")}
    timings = {r.job.name: {"status": r.status, "seconds": round(r.seconds, 2)} for r in results}
    return _finish_bundle(bm, root, backend, report, model_entries, graph_entries, extra_files,
                          {**counts, "seconds": round(time.perf_counter() - t0, 2), "graphs": timings})


def _finish_bundle(bm: BuildModels, root: Path, backend, report: Report, model_entries: dict, graph_entries: list,
                   extra_files: list[Path], build: dict) -> Manifest:
    """Tokenizer, configs and the manifest (with its digest): the part every backend shares."""
    pair, t, d = bm.lp.pair, bm.lp.target, bm.lp.draft
    report({"event": "stage", "stage": "tokenizer"})
    files = _write_tokenizer(t, root / "tokenizer") + extra_files
    (root / "configs").mkdir()
    for name, ckpt in (("target", t), ("draft", d)):
        p = root / "configs" / f"{name}_config.json"
        p.write_text(json.dumps(ckpt.config, indent=2, sort_keys=True, default=str))
        files.append(p)
    manifest = Manifest(
        schema_version=SCHEMA_VERSION, name=pair.name,
        created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        backend=pair.backend, dtype=pair.dtype, tp_degree=pair.parallel.tp_degree,
        num_speculative_tokens=pair.speculation.num_speculative_tokens, speculation=pair.speculation.shapes,
        max_num_seqs=pair.serving.max_num_seqs, max_model_len=pair.serving.max_model_len,
        prefill_buckets=list(pair.buckets.prefill), batch_buckets=list(pair.buckets.batch),
        aux_layer_ids=list(d.args.aux_layer_ids), vocab_size=t.args.vocab_size, eos_token_ids=t.eos_token_ids,
        bos_token_id=t.bos_token_id, draft_format=d.format, recipe=pair.model_dump(mode="json"),
        sources={"target": t.source.record(), "draft": d.source.record()},
        toolchain=toolchain(backend), models=model_entries, state=[bm.state["target"], bm.state["draft"]],
        graphs=graph_entries, files=[file_entry(root, f) for f in sorted(files)], notes=d.notes,
        build={**build, "host": platform.node()})
    manifest.digest = manifest.compute_digest()
    (root / MANIFEST).write_text(manifest.model_dump_json(indent=2))
    return manifest


def _model_entry(bm: BuildModels, name: str, root: Path, files: list[Path], tensors: dict[str, TensorSpec]) -> ModelEntry:
    model, ckpt, layout = bm.models[name]
    d = bm.lp.draft
    return ModelEntry(name=name, architecture=bm.lp.target.args.ARCH if name == "target" else f"eagle3-{d.format}",
                      config=_jsonable(dataclasses.asdict(ckpt.args)), layout=layout.to_dict(),
                      weight_files=[file_entry(root, f) for f in files], tensors=tensors)


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


def spmd_models(bm: BuildModels, backend=None) -> dict[str, SpmdModel]:
    """What each model's ModelBuilder gets (shared by the build and `plan`; `backend` None: no SDK, no key)."""
    from .backends.neuron import INDEX_DTYPE, ModelGraphs, weight_dtype

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
                         n_out=max(len(sp.contract.outputs) for sp, _ in graphs))
        key = "" if backend is None else trace_key({
            "spmd_model": name, "dtype": pair.dtype, "B": pair.serving.max_num_seqs,
            "state": state.model_dump(), "tp": tp, "class": type(model).__name__,
            "args": _jsonable(dataclasses.asdict(ckpt.args)), "layout": layout.to_dict(),
            "graphs": [[sp.role, sp.bucket, sp.shape.model_dump(), [[n, sh, str(x)] for n, sh, x in ins]]
                       for sp, ins in graphs],
            "weights": {n: [sh, str(x)] for n, (sh, x) in shapes.items()},
            "backend": {k: backend.key_fields(k) for k in mg.keys()}})
        out[name] = SpmdModel(mg, key, inputs, names)
    return out


def _write_spmd_bundle(bm: BuildModels, root: Path, backend, cache: CompileCache, report: Report,
                       require_cached: bool, t0: float) -> Manifest:
    """Neuron: one NxD model per model (every role, bucket and rank; backends/neuron.py) and NxD's
    per-rank checkpoints, keyed by the traced parameter names plus the rank weight."""
    from .backends.neuron import RANK_WEIGHT, rank_weights, shard_file, weight_key

    pair = bm.lp.pair
    tp = pair.parallel.tp_degree
    report({"event": "stage", "stage": "graphs", "total": len(graph_plan(pair)), "jobs": 1})
    graph_entries, extra_files, model_entries, timings, status = [], [], {}, {}, {}
    models = spmd_models(bm, backend)
    for sm in models.values():  # before anything compiles
        sm.graphs.check_routing()
    for name, sm in models.items():
        model, ckpt, layout = bm.models[name]
        mg, key, names, graphs = sm.graphs, sm.key, sm.names, sm.graphs.graphs
        shapes, entries_in, state = mg.weights, sm.inputs, bm.state[name]
        t_model = time.perf_counter()
        entry, status[name] = _fetch_model(sm, name, backend, cache, tp, report, require_cached, root / "graphs")
        info = entry.meta["info"]
        extra_files += [root / "graphs" / fname for fname in entry.files if fname.endswith(".neff")]
        model_file = file_entry(root, root / "graphs" / f"{name}{backend.SUFFIX}")
        qualified = [f"{name}/{weight_key(n)}" for n in names] + [f"{name}/{RANK_WEIGHT}"]
        for sp, _ in graphs:
            gi = dict(info[sp.name])
            if "neff" in gi:
                gi["neff"] = f"graphs/{gi['neff']}"
            graph_entries.append(GraphEntry(
                name=sp.name, role=sp.role, model=name, bucket=sp.bucket, file=model_file, weights=qualified,
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
        model_entries[name] = _model_entry(bm, name, root, files, tensors)
    counts = {st: sum(v == st for v in status.values()) for st in ("compiled", "cached")}
    return _finish_bundle(bm, root, backend, report, model_entries, graph_entries, extra_files,
                          {**counts, "unit": "model", "seconds": round(time.perf_counter() - t0, 2), "graphs": timings})


def _fetch_model(sm: SpmdModel, name: str, backend, cache: CompileCache, tp: int, report: Report,
                 require_cached: bool, into: Path) -> tuple:
    """`_spmd_entry`, its files copied into `into`; an entry a concurrent `cache prune` / `clear` removed
    before its copy is a miss: compiled again."""
    for _ in range(FETCH_TRIES):
        entry, status = _spmd_entry(sm, name, backend, cache, tp, report, require_cached)
        try:
            for fname in entry.files:
                shutil.copyfile(entry.path / fname, into / fname)
        except FileNotFoundError:
            continue
        return entry, status
    raise vanishing(cache, [name])


def _spmd_entry(sm: SpmdModel, name: str, backend, cache: CompileCache, tp: int, report: Report,
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
        info = backend.compile_model(sm.graphs, tp, staged)
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


def toolchain(backend) -> dict[str, str]:
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "eagle3_build": __version__,
            "backend": backend.NAME, "backend_version": backend.version()}
    return info | backend.toolchain()


def _jsonable(x):
    return json.loads(json.dumps(x, default=list))


def _write_tokenizer(t: TargetCheckpoint, out: Path) -> list[Path]:
    """Save the target's tokenizer as transformers configures it, and prove the runtime's plain
    `tokenizers` load encodes exactly like it (special tokens included)."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    src = t.source
    try:
        if src.gguf_file:
            tok = AutoTokenizer.from_pretrained(src.directory, gguf_file=src.gguf_file)
        else:
            tok = AutoTokenizer.from_pretrained(src.directory)
    except Exception as e:
        raise UserError(f"target {src.spec.uri}: cannot load its tokenizer with transformers: {e}") from e
    if not getattr(tok, "is_fast", False):
        raise UserError(f"target {src.spec.uri}: only a slow tokenizer is available; the runtime needs "
                        "tokenizer.json (a fast tokenizer)")
    out.mkdir(parents=True)
    tok.save_pretrained(out)
    plain = Tokenizer.from_file(str(out / "tokenizer.json"))
    for s in TOKENIZER_PROBES:
        if plain.encode(s).ids != tok(s)["input_ids"]:
            raise UserError(f"target {src.spec.uri}: tokenizer.json encodes {s!r} differently from transformers; "
                            "the runtime could not reproduce the target's tokenization")
    return sorted(p for p in out.rglob("*") if p.is_file())


TOKENIZER_PROBES = ["Hello, world!", "  The quick brown fox\njumps over 12345 lazy dogs.", "ünïcödé ✓ 中文"]
