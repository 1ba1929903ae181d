"""`eagle3-build plan`: every graph of a recipe with its shapes, cache status, estimated compile time
and the per-rank weight size — from configs (and safetensors headers) only, never weights.

Where the configs come from:
  * local directories / GGUF files: the checkpoint itself (safetensors headers give exact tensor
    names, so graph keys — and with them cache hits — are exact);
  * hf://org/model@rev: config.json from the local Hugging Face cache if present, else the
    toolchain's bundled planning copy for well-known seed models (eagle3_build/known_configs), so
    the 8B and 120B recipes plan on a laptop with no network. Cache status is then "unknown".
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eagle3_runtime.manifest import dtype_name, torch_dtype

from .checkpoints.load import TARGET_ARGS, TargetCheckpoint, draft_checkpoint, eos_token_ids, read_config
from .checkpoints.pair_checks import build_draft, build_target
from .checkpoints.sources import ResolvedSource, TensorSource
from .compile.cache import CompileCache
from .compile.scheduler import default_jobs, static_estimate
from .errors import UserError
from .models.weights import weight_tensors
from .pair import LoadedPair, build_models, check_limits, graph_plan, kv_memory_problem, load_pair
from .recipe import PairRecipe, check_target_limits

KNOWN = Path(__file__).resolve().parent / "known_configs"


@dataclass
class PlannedGraph:
    name: str
    role: str
    model: str
    bucket: int
    tokens_per_call: int
    inputs: list[dict]
    cache: str  # hit | miss | unknown
    key: str | None
    estimate_s: float | None
    artifact: str | None = None
    compiler_command: str | None = None


@dataclass
class PairPlan:
    pair: str
    backend: str
    tp_degree: int
    num_speculative_tokens: int
    config_source: str
    weight_bytes_per_rank: dict[str, int]
    graphs: list[PlannedGraph]
    jobs: int | None
    estimate_s: float | None  # wall time of the misses at `jobs` parallel jobs
    notes: list[str] = field(default_factory=list)
    speculation: dict[int, str] = field(default_factory=dict)  # batch bucket -> its speculation shape
    details: dict = field(default_factory=dict)  # the backend's own fields (Backend.plan_details)

    def to_dict(self) -> dict:
        """The plan as JSON data, the backend's own fields beside the generic ones."""
        out = asdict(self)
        return {**out, **out.pop("details")}


# ------------------------------------------------------------------ configs only

def _names_only(shapes: dict[str, list[int]], origin: str) -> TensorSource:
    def unavailable(n):
        raise UserError(f"plan reads configs only; tensor {n} is not loaded")

    return TensorSource({n: (lambda n=n: unavailable(n)) for n in shapes}, dict(shapes), origin)


def _config_dir(spec, role: str) -> tuple[Path, dict, str]:
    """(directory, config, where it came from) for an hf:// source, without downloading weights."""
    from huggingface_hub import snapshot_download

    try:
        d = Path(snapshot_download(spec.repo_id, revision=spec.revision, allow_patterns=["*.json"],
                                   local_files_only=True))
    except Exception:  # not cached: fall back to the bundled copy
        d = None
    if d is not None and (d / "config.json").exists():
        return d, {"config": read_config(d, role)}, "hub cache"  # (type-checked like any checkpoint's)
    known = KNOWN / f"{spec.repo_id.replace('/', '--')}.json"
    if known.exists():
        return KNOWN, json.loads(known.read_text()), "bundled planning copy"
    raise UserError(f"{role} {spec.uri}: plan needs its config.json, which is neither in the local Hugging Face "
                    f"cache nor bundled; run `hf download {spec.repo_id} config.json` once (no weights needed)")


def config_only_pair(pair: PairRecipe) -> tuple[LoadedPair, str]:
    """Target and draft checkpoints with every tensor name the models need but no tensor data."""
    t_dir, t_raw, origin = _config_dir(pair.target, "target")
    cfg = t_raw["config"]
    mtype = cfg.get("model_type")
    if mtype not in TARGET_ARGS:
        raise UserError(f"target {pair.target.uri}: model_type {mtype!r} is not supported")
    args = TARGET_ARGS[mtype](cfg, "target")
    target = TargetCheckpoint(ResolvedSource(pair.target, t_dir), cfg, args, _names_only({}, "config"),
                              eos_token_ids(cfg), cfg.get("bos_token_id"))
    d_dir, d_raw, d_origin = _config_dir(pair.draft, "draft")
    dcfg = d_raw["config"]
    fmt_origin = "config.bin" if d_raw.get("weights_format") == "bin" else "config"
    dvocab = dcfg.get("draft_vocab_size") or (dcfg.get("transformer_layer_config") or {}).get("draft_vocab_size")
    vocab = dcfg.get("vocab_size") or (dcfg.get("transformer_layer_config") or {}).get("vocab_size")
    hints = {"d2t": [dvocab]} if dvocab and vocab and dvocab != vocab else {}
    if dcfg.get("norm_before_fc"):
        hints["input_norm.weight"] = [1]
    draft = draft_checkpoint(ResolvedSource(pair.draft, d_dir), dcfg, _names_only(hints, fmt_origin), target)
    # every parameter of the models is "in the checkpoint" (the draft shares the target's embedding)
    t_model, d_model = build_target(target, draft.args.aux_layer_ids), build_draft(draft)
    target.tensors = _names_only({n: list(p.shape) for n, p in weight_tensors(t_model).items()}, "config")
    draft.tensors = _names_only({n: list(p.shape) for n, p in weight_tensors(d_model).items()
                                 if not n.startswith("embed_tokens")}, "config")
    return LoadedPair(pair, target, draft), origin if origin == d_origin else f"{origin} / {d_origin}"


# ------------------------------------------------------------------ sizes, before anything is allocated

def check_sizes(pair: PairRecipe, *, memory: bool = True) -> None:
    """pair.check_limits before a build, from configs and safetensors headers only. An hf:// pair whose config
    is not on this host yet passes here (the build checks it once it has downloaded it)."""
    if pair.target.kind == "hf" or pair.draft.kind == "hf":
        try:
            lp, _ = config_only_pair(pair)
        except UserError:
            return
    else:
        lp = load_pair(pair)
    check_limits(lp, build_models(lp) if memory else None)


# ------------------------------------------------------------------ plan

def plan_pair(pair: PairRecipe, cache: CompileCache, *, keys: bool = True) -> PairPlan:
    from .backends.registry import backend_class, get_backend, preflight

    exact = pair.target.kind != "hf" and pair.draft.kind != "hf"
    notes = []
    if exact:
        lp, origin = load_pair(pair), "checkpoint (headers only)"
    else:
        lp, origin = config_only_pair(pair)
    check_target_limits(pair, lp.target.config)
    bm = build_models(lp)  # (shapes on the meta device: nothing allocated)
    too_big = kv_memory_problem(pair, bm)
    if too_big is not None and exact and keys:  # (tracing the graphs for their keys allocates the KV cache)
        raise too_big
    if too_big is not None:
        notes.append(f"a build on this host would be refused: {too_big}")
    sizes = {"target": 0, "draft": 0}
    for q, (shape, dt) in bm.weight_shapes.items():
        sizes[q.split("/")[0]] += math.prod(shape) * (torch.empty((), dtype=dt).element_size())
    sizes["total"] = sizes["target"] + sizes["draft"]

    backend = None
    try:
        preflight(pair.backend)
        backend = get_backend(pair.backend, pair.backend_options)
    except UserError as e:
        notes.append(f"cache status and compile estimates unknown: backend {pair.backend} is not usable on this "
                     f"host ({str(e).split(':')[0]})")
    if backend is not None and not exact:
        notes.append("cache status unknown: configs come from a planning copy, not the checkpoint")
    cls = backend_class(pair.backend)  # what the backend would build, asked whether its SDK is here or not
    graph_keys = cls.plan_keys(bm, backend if exact and keys else None, cache)
    cc_args = cls.plan_compiler_args(pair)
    dtype = torch_dtype(pair.dtype)
    from .graphs import step_inputs

    graphs = []
    for spec in graph_plan(pair):
        ins = step_inputs(spec, target_hidden=bm.models["target"][2].padded_hidden,
                          draft_hidden=bm.models["draft"][2].padded_hidden, dtype=dtype)
        key = graph_keys.get(spec.name)
        status = "unknown" if key is None else ("hit" if cache.get(key, check=False) else "miss")
        est = None
        if status == "hit":
            est = 0.0
        elif backend is not None:
            learned = cache.estimate(pair.backend, spec.role, spec.tokens_per_call())
            est = learned if learned is not None else static_estimate(cls, spec.role,
                                                                      spec.tokens_per_call())
        g = PlannedGraph(spec.name, spec.role, spec.model, spec.bucket, spec.tokens_per_call(),
                         [{"name": n, "shape": s, "dtype": dtype_name(x)} for n, s, x in ins],
                         status, key, None if est is None else round(est, 1), **cls.plan_graph(spec, cc_args))
        graphs.append(g)
    details = cls.plan_details(bm, backend if exact and keys else None, cache, cc_args)
    jobs = default_jobs(backend, sum(g.cache != "hit" for g in graphs)) if backend is not None else None
    total = None
    if backend is not None:
        total = round(sum(g.estimate_s or 0.0 for g in graphs) / max(1, jobs or 1), 1)
    return PairPlan(pair.name, pair.backend, pair.parallel.tp_degree, pair.speculation.num_speculative_tokens, origin,
                    sizes, graphs, jobs, total, notes,
                    {b: s.describe() + (f" (menu: {', '.join(x.tag for x in pair.speculation.menu[b])})"
                                        if pair.speculation.menu.get(b) else "")
                     for b, s in pair.speculation.shapes.items()}, details)
