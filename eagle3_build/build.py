"""recipe pair -> bundle directory, as a sentence: check the destination, load the pair, let the backend
compile (or fetch from the cache) and write its graphs and weights, add the tokenizer and configs, write
the manifest with its digest — all into a temporary sibling swapped into place only when whole
(output.py). Nothing here knows which backend it drives (backends/)."""
from __future__ import annotations

import datetime as dt
import json
import platform
import time
from pathlib import Path

import torch

from eagle3_runtime.graph_contract import KV_DIMS
from eagle3_runtime.manifest import MANIFEST, SCHEMA_VERSION, Manifest, file_entry

from . import __version__
from .backends.base import Written
from .backends.registry import get_backend
from .checkpoints.tokenizer_export import export_tokenizer
from .compile.cache import CompileCache
from .compile.scheduler import GraphResult
from .output import check_out, clean_leftovers, replace_staged
from .pair import BuildModels, LoadedPair, Report, build_models, check_limits, load_pair
from .recipe import PairRecipe


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
    for note in backend.notes():
        report({"event": "warning", "message": note})
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


def compile_shard(pair: PairRecipe, index: int, count: int, report: Report | None = None, *,
                  cache: CompileCache | None = None, jobs: int | None = None) -> list[GraphResult]:
    """Compile one shard of a pair's graphs into the cache; writes no bundle. Raises CompileFailed."""
    backend = get_backend(pair.backend, pair.backend_options)
    cache = (cache or CompileCache()).open()
    cache.clean_tmp(time.time())
    return backend.compile_shard(pair, index, count, cache, jobs, report or (lambda ev: None))


def _write_bundle(lp: LoadedPair, root: Path, backend, cache: CompileCache, jobs: int | None,
                  report: Report, require_cached: bool = False) -> Manifest:
    """Graphs and weights first (the long, fallible part: the backend's), then what every bundle shares."""
    t0 = time.perf_counter()
    bm = build_models(lp)
    check_limits(lp, None if require_cached else bm)  # (--require-cached traces nothing)
    (root / "graphs").mkdir()
    written = backend.write_graphs(bm, root, cache, jobs, report, require_cached)
    written.build["seconds"] = round(time.perf_counter() - t0, 2)
    return _finish_bundle(bm, root, backend, report, written)


def _finish_bundle(bm: BuildModels, root: Path, backend, report: Report, written: Written) -> Manifest:
    """Tokenizer, configs and the manifest (with its digest): the part every backend shares."""
    pair, t, d = bm.lp.pair, bm.lp.target, bm.lp.draft
    report({"event": "stage", "stage": "tokenizer"})
    files = export_tokenizer(t, root / "tokenizer") + written.files
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
        menu=pair.speculation.menu, accept=pair.speculation.accept, unroll_draft=pair.speculation.unroll_draft,
        max_num_seqs=pair.serving.max_num_seqs, max_model_len=pair.serving.max_model_len,
        prefill_buckets=list(pair.buckets.prefill), batch_buckets=list(pair.buckets.batch),
        context_buckets=list(pair.buckets.context),
        aux_layer_ids=list(d.args.aux_layer_ids), vocab_size=t.args.vocab_size, eos_token_ids=t.eos_token_ids,
        bos_token_id=t.bos_token_id, draft_format=d.format, recipe=pair.model_dump(mode="json"),
        sources={"target": t.source.record(), "draft": d.source.record()},
        toolchain=toolchain(backend), models=written.models, state=[bm.state["target"], bm.state["draft"]],
        kv_layout=list(KV_DIMS), graphs=written.graphs, files=[file_entry(root, f) for f in sorted(files)],
        notes=d.notes + backend.notes(),
        build={**written.build, "host": platform.node()})
    manifest.digest = manifest.compute_digest()
    (root / MANIFEST).write_text(manifest.model_dump_json(indent=2))
    return manifest


def toolchain(backend) -> dict[str, str]:
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "eagle3_build": __version__,
            "backend": backend.NAME, "backend_version": backend.version()}
    return info | backend.toolchain()
