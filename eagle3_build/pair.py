"""A recipe pair loaded for building: its checkpoints checked against each other, its models built
rank-local on the meta device with their layouts, weight bindings and KV caches, and the graph plan.
What every backend's bundle writer starts from."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from eagle3_runtime.graph_contract import kv_cache_length, kv_state_name
from eagle3_runtime.manifest import ModelEntry, TensorSpec, dtype_name, file_entry, torch_dtype

from .checkpoints.load import DraftCheckpoint, TargetCheckpoint, load_draft, load_target
from .checkpoints.pair_checks import build_draft, build_target, check_pair, check_target
from .checkpoints.sources import resolve
from .errors import UserError
from .graphs import GraphSpec, plan_graphs
from .models.eagle3 import draft_layout
from .models.llama import llama_layout
from .models.weights import weight_tensors
from .host import available_memory_bytes
from .recipe import PairRecipe, RecipeError, check_target_limits, issue_at
from .sharding import check_tp

Report = Callable[[dict], None]  # progress events (dicts with an "event" key: stage | graph | shard)


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
    return plan_graphs(pair.buckets.prefill, pair.speculation.shapes, pair.speculation.menu, pair.buckets.context,
                       pair.speculation.accept, pair.speculation.unroll_draft)


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
    # KV caches (rank-local heads), with the scratch positions of graph_contract.kv_cache_length
    S = kv_cache_length(L, pair.speculation.scratch())
    state = {
        "target": TensorSpec(name=kv_state_name("target"), shape=target_model.kv_shape(B, S), dtype=dtype_name(dtype)),
        "draft": TensorSpec(name=kv_state_name("draft"), shape=draft_model.kv_shape(B, S), dtype=dtype_name(dtype)),
    }
    return BuildModels(lp, models, bindings, weight_shapes, state)


def contract_outputs(bm: BuildModels, spec: GraphSpec) -> list[TensorSpec]:
    """A graph's outputs as the runtime returns them, from the contract table (graph_contract.ROLES)."""
    pair = bm.lp.pair
    outs = spec.contract.output_specs(spec.bucket, spec.shape,
                                      target_hidden=bm.models["target"][2].padded_hidden,
                                      draft_hidden=bm.models["draft"][2].padded_hidden,
                                      vocab=bm.lp.target.args.vocab_size, dtype=pair.dtype, accept=spec.accept)
    return [TensorSpec(name=n, shape=sh, dtype=x) for n, sh, x in outs]


def model_entry(bm: BuildModels, name: str, root: Path, files: list[Path], tensors: dict[str, TensorSpec]) -> ModelEntry:
    model, ckpt, layout = bm.models[name]
    d = bm.lp.draft
    return ModelEntry(name=name, architecture=bm.lp.target.args.ARCH if name == "target" else f"eagle3-{d.format}",
                      config=jsonable(dataclasses.asdict(ckpt.args)), layout=layout.to_dict(),
                      weight_files=[file_entry(root, f) for f in files], tensors=tensors)


def jsonable(x):
    return json.loads(json.dumps(x, default=list))


# ------------------------------------------------------------------ sizes, before anything is allocated

def kv_cache_bytes(bm: BuildModels) -> dict[str, int]:
    """Bytes of each model's KV cache on one rank (from its shape: nothing allocated)."""
    return {m: math.prod(t.shape) * torch.empty((), dtype=torch_dtype(t.dtype)).element_size()
            for m, t in bm.state.items()}


def kv_memory_problem(pair: PairRecipe, bm: BuildModels) -> RecipeError | None:
    """A KV cache larger than this host's available memory (tracing allocates one): the problem at the serving
    key to lower (max_model_len where one sequence alone does not fit, else max_num_seqs); None where it fits."""
    kv, free = kv_cache_bytes(bm), available_memory_bytes()
    total = sum(kv.values())
    if free is None or total <= free:
        return None
    B, L = pair.serving.max_num_seqs, pair.serving.max_model_len
    key = ("serving", "max_model_len") if total // B > free or B == 1 else ("serving", "max_num_seqs")
    return issue_at(pair, key, f"{B} sequence(s) x {L} positions make a KV cache of {_bytes(total)} per rank "
                               f"(target {_bytes(kv['target'])} + draft {_bytes(kv['draft'])}, {pair.dtype}), more "
                               f"than the {_bytes(free)} of memory available on this host; lower serving.{key[1]} "
                               "(or spread the cache over more ranks: parallel.tp_degree)")


def _bytes(n: int) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 1e3:.1f} kB"


def check_limits(lp: LoadedPair, bm: BuildModels | None = None) -> None:
    """serving.max_model_len against the target's config and, given the models (`bm`), the KV cache a trace
    allocates against this host's memory: a RecipeError at the recipe's line, before anything is sized."""
    check_target_limits(lp.pair, lp.target.config)
    problem = None if bm is None else kv_memory_problem(lp.pair, bm)
    if problem is not None:
        raise problem
