"""recipe pair -> bundle directory.

checkpoints -> pair checks -> per-rank weights -> one graph file per (role, bucket) -> tokenizer and
configs -> manifest.json. Everything is written into a temporary sibling directory that is renamed
into place only when complete, so a failed build never leaves a half-written bundle.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from eagle3_runtime.manifest import (MANIFEST, SCHEMA_VERSION, GraphEntry, Manifest, ModelEntry,
                                     TensorSpec, file_entry)

from . import __version__
from .backends import get_backend
from .buckets import kv_cache_length
from .cache import CompileCache, graph_key, trace_key
from .checkpoints import (DraftCheckpoint, TargetCheckpoint, load_draft, load_target, resolve)
from .compiler import (CompileFailed, GraphJob, GraphResult, Scheduler, default_jobs, split_shard,
                       static_estimate)
from .errors import UserError
from .graphs import OUTPUT_NAMES, GraphSpec, build_graph_module, plan_graphs, step_inputs
from .graphs import model_weight_names
from .models.eagle3 import draft_layout
from .models.llama import llama_layout
from .pair import build_draft, build_target, check_pair, check_target
from .recipe import PairRecipe
from .sharding import check_tp, tensor_plan, write_rank_files

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


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
    return LoadedPair(pair, target, draft)


def graph_plan(pair: PairRecipe) -> list[GraphSpec]:
    return plan_graphs(pair.buckets.prefill, pair.buckets.batch)


Report = Callable[[dict], None]


def build_bundle(pair: PairRecipe, out: Path, report: Report | None = None, *, cache: CompileCache | None = None,
                 jobs: int | None = None, require_cached: bool = False) -> Manifest:
    """Build one pair into `out` (replaced atomically). Returns the manifest written.

    `report` receives progress events (dicts with an "event" key: stage | graph); `cache` defaults
    to $EAGLE3_BUILD_CACHE; `jobs` to what the cores and memory allow for the backend. Raises
    CompileFailed (after every other graph was compiled and cached) when any graph fails."""
    report = report or (lambda ev: None)
    backend = get_backend(pair.backend, pair.backend_options)
    cache = cache or CompileCache()
    report({"event": "stage", "stage": "load"})
    lp = load_pair(pair)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        manifest = _write_bundle(lp, tmp, backend, cache, jobs, report, require_cached)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _replace_dir(tmp: Path, out: Path) -> None:
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


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
    dtype = DTYPES[pair.dtype]
    K = pair.speculation.num_speculative_tokens
    B, L = pair.serving.max_num_seqs, pair.serving.max_model_len
    t_layout, d_layout = layouts(pair, t, d)
    target_model = build_target(t, d.args.aux_layer_ids, t_layout)
    draft_model = build_draft(d, d_layout)
    models = {"target": (target_model, t, t_layout), "draft": (draft_model, d, d_layout)}
    bindings, weight_shapes = {}, {}
    for name, (model, ckpt, _) in models.items():
        pnames = model_weight_names(model)
        own = {n for n in pnames if n in ckpt.tensors}
        bindings[name] = {n: (f"{name}/{n}" if n in own else f"target/{n}") for n in pnames}
        local = dict(model.named_parameters()) | dict(model.named_buffers())
        for n in pnames:
            if n in own:
                weight_shapes[f"{name}/{n}"] = (list(local[n].shape),
                                                dtype if local[n].dtype.is_floating_point else local[n].dtype)
    # KV caches (rank-local heads); K scratch positions past max_model_len take the writes of rows
    # that ride along in a verify batch after their speculation cutoff
    S = kv_cache_length(L, K)
    state = {
        "target": TensorSpec(name="target_kv", shape=target_model.kv_shape(B, S), dtype=dtype_name(dtype)),
        "draft": TensorSpec(name="draft_kv", shape=draft_model.kv_shape(B, S), dtype=dtype_name(dtype)),
    }
    return BuildModels(lp, models, bindings, weight_shapes, state)


def tokens_per_call(spec: GraphSpec, K: int) -> int:
    if spec.role in ("target_prefill", "draft_prefill"):
        return spec.bucket
    return spec.bucket * (K + 1 if spec.role in ("target_verify", "draft_catchup") else 1)


@dataclass
class TracedGraph:
    spec: GraphSpec
    job: GraphJob
    weights: list[str]  # qualified names in call order
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]


def trace_graphs(bm: BuildModels, backend, cache: CompileCache, specs: list[GraphSpec] | None = None):
    """Key every graph; yields TracedGraph in plan order. A graph is torch.export-ed (weights as inputs,
    empty stand-ins: no memory touched) unless the trace memo already maps its trace inputs to a
    cached compile. With tp > 1 collectives trace against a fake process group."""
    pair = bm.lp.pair
    dtype = DTYPES[pair.dtype]
    K = pair.speculation.num_speculative_tokens
    t_layout, d_layout = bm.models["target"][2], bm.models["draft"][2]
    fields = backend.key_fields()
    common = {"backend": fields, "dtype": pair.dtype, "K": K, "B": pair.serving.max_num_seqs,
              "L": pair.serving.max_model_len, "state": {k: v.model_dump() for k, v in bm.state.items()},
              "models": {n: {"args": dataclasses.asdict(c.args), "layout": lay.to_dict(), "class": type(m).__name__}
                         for n, (m, c, lay) in bm.models.items()},
              "aux": list(bm.lp.draft.args.aux_layer_ids)}
    for spec in (specs if specs is not None else graph_plan(pair)):
        model = bm.models[spec.model][0]
        module, pnames = build_graph_module(spec, model)
        qnames = [bm.bindings[spec.model][n] for n in pnames]
        ins = step_inputs(spec, K=K, target_hidden=t_layout.padded_hidden, draft_hidden=d_layout.padded_hidden,
                          dtype=dtype)
        inputs = [TensorSpec(name=n, shape=s, dtype=dtype_name(x)) for n, s, x in ins]
        tkey = trace_key({**common, "role": spec.role, "bucket": spec.bucket,
                          "weights": [bm.weight_shapes[q][0] for q in qnames if q in bm.weight_shapes]})
        memo = cache.get_trace(tkey)
        hit = cache.get(memo["key"]) if memo is not None else None
        if hit is not None:
            job = GraphJob(spec.name, spec.role, spec.bucket, tokens_per_call(spec, K), memo["key"], None, hit=hit)
            yield TracedGraph(spec, job, qnames, inputs, [TensorSpec(**o) for o in memo["outputs"]])
            continue
        weights = tuple(torch.empty(bm.weight_shapes[q][0], dtype=bm.weight_shapes[q][1]) for q in qnames)
        kv = torch.zeros(bm.state[spec.model].shape, dtype=dtype)
        example = tuple(torch.zeros(shape, dtype=dt_) for _, shape, dt_ in ins)
        args = (weights, kv, *example)
        outs = backend.output_specs(module, args)
        ep = torch.export.export(module, args, strict=False)
        key = graph_key(ep, fields)
        outputs = [TensorSpec(name=n, shape=s, dtype=dtype_name(x)) for n, (s, x) in zip(OUTPUT_NAMES[spec.role], outs)]
        cache.put_trace(tkey, {"key": key, "outputs": [o.model_dump() for o in outputs]})
        job = GraphJob(spec.name, spec.role, spec.bucket, tokens_per_call(spec, K), key, ep)
        yield TracedGraph(spec, job, qnames, inputs, outputs)


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
    K = pair.speculation.num_speculative_tokens
    specs = graph_plan(pair)
    mine = split_shard([(s.name, static_estimate(pair.backend, s.role, tokens_per_call(s, K))) for s in specs],
                       index, count)
    return [s for s in specs if s.name in mine]


def compile_shard(pair: PairRecipe, index: int, count: int, report: Report | None = None, *,
                  cache: CompileCache | None = None, jobs: int | None = None) -> list[GraphResult]:
    """Compile one shard of a pair's graphs into the cache; writes no bundle. Raises CompileFailed."""
    report = report or (lambda ev: None)
    backend = get_backend(pair.backend, pair.backend_options)
    cache = cache or CompileCache()
    report({"event": "stage", "stage": "load"})
    bm = build_models(load_pair(pair))
    specs = shard_specs(pair, index, count)
    report({"event": "shard", "index": index, "count": count, "graphs": [s.name for s in specs]})
    return compile_graphs(bm, backend, cache, jobs, report, specs)[1]


def _write_bundle(lp: LoadedPair, root: Path, backend, cache: CompileCache, jobs: int | None,
                  report: Report, require_cached: bool = False) -> Manifest:
    t0 = time.perf_counter()
    pair, t, d = lp.pair, lp.target, lp.draft
    K = pair.speculation.num_speculative_tokens
    B, L = pair.serving.max_num_seqs, pair.serving.max_model_len
    bm = build_models(lp)

    # --- graphs first (the long, fallible part): traced, keyed, compiled or fetched from the cache
    traced, results = compile_graphs(bm, backend, cache, jobs, report, require_cached=require_cached)
    (root / "graphs").mkdir()
    graph_entries, extra_files = [], []
    for tg, res in zip(traced, results):
        info = dict(res.entry.meta["info"])
        main = None
        for fname in res.entry.files:
            dest = root / "graphs" / (tg.spec.name + fname[len("graph"):])
            shutil.copyfile(res.entry.path / fname, dest)
            if fname == f"graph{backend.SUFFIX}":
                main = dest
            else:
                extra_files.append(dest)
                if info.get("neff") == fname:
                    info["neff"] = dest.name
        graph_entries.append(GraphEntry(
            name=tg.spec.name, role=tg.spec.role, model=tg.spec.model, bucket=tg.spec.bucket,
            file=file_entry(root, main), weights=tg.weights, state=bm.state[tg.spec.model].name,
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
        model_entries[name] = ModelEntry(
            name=name, architecture=t.args.ARCH if name == "target" else f"eagle3-{d.format}",
            config=_jsonable(dataclasses.asdict(ckpt.args)), layout=layout.to_dict(),
            weight_files=[file_entry(root, f) for f in files], tensors=tensors)

    # --- tokenizer and configs
    report({"event": "stage", "stage": "tokenizer"})
    files = _write_tokenizer(t, root / "tokenizer") + extra_files
    (root / "configs").mkdir()
    for name, ckpt in (("target", t), ("draft", d)):
        p = root / "configs" / f"{name}_config.json"
        p.write_text(json.dumps(ckpt.config, indent=2, sort_keys=True, default=str))
        files.append(p)

    counts = {s: sum(r.status == s for r in results) for s in ("compiled", "cached")}
    manifest = Manifest(
        schema_version=SCHEMA_VERSION, name=pair.name,
        created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        backend=pair.backend, dtype=pair.dtype, tp_degree=pair.parallel.tp_degree, num_speculative_tokens=K,
        max_num_seqs=B, max_model_len=L, prefill_buckets=list(pair.buckets.prefill),
        batch_buckets=list(pair.buckets.batch), aux_layer_ids=list(d.args.aux_layer_ids),
        vocab_size=t.args.vocab_size, eos_token_ids=t.eos_token_ids, bos_token_id=t.bos_token_id,
        draft_format=d.format, recipe=pair.model_dump(mode="json"),
        sources={"target": t.source.record(), "draft": d.source.record()},
        toolchain=toolchain(backend), models=model_entries, state=[bm.state["target"], bm.state["draft"]],
        graphs=graph_entries, files=[file_entry(root, f) for f in sorted(files)], notes=d.notes,
        build={**counts, "seconds": round(time.perf_counter() - t0, 2), "host": platform.node(),
               "graphs": {r.job.name: {"status": r.status, "seconds": round(r.seconds, 2)} for r in results}})
    manifest.digest = manifest.compute_digest()
    (root / MANIFEST).write_text(manifest.model_dump_json(indent=2))
    return manifest


@contextlib.contextmanager
def tracing_process_group(tp: int):
    """A fake world of `tp` ranks so in-graph collectives trace with the right shapes; nothing runs."""
    if tp == 1:
        yield
        return
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise UserError("a torch.distributed process group is already initialised in the build process; "
                        "run eagle3-build compile as a plain process (not under torchrun)")
    dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def toolchain(backend) -> dict[str, str]:
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "eagle3_build": __version__,
            "backend": backend.NAME, "backend_version": backend.version()}
    if hasattr(backend, "toolchain"):
        info |= backend.toolchain()
    return info


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
        raise UserError(f"target {src.spec.uri}: cannot load its tokenizer with transformers: {e}") from None
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
