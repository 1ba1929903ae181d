"""manifest.json: the only contract between the builder and the runtime.

The builder imports these models to write a manifest; the runtime reads it back and trusts nothing
else about a bundle. Besides the schema this module holds the rules both sides share, each defined
once: the dtype names, the backends, the graph roles (`ROLES`: model, bucket kind, inputs, outputs,
tokens per call), the KV scratch rule and the Neuron SDK's package names. It imports no torch.
Bump SCHEMA_VERSION on any incompatible change.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from .errors import Eagle3Error

SCHEMA_VERSION = 9  # 2: graph keys, bundle digest, build record; 3: speculation shapes per batch bucket;
# 4: weights packed at load (GraphEntry.packed); 5: aoti graph files carry their signature (graph_signature);
# 6: the KV caches' layout named (kv_layout); 7: weights packed for oneDNN (PackedWeight.format "onednn");
# 8: a menu of speculation shapes per batch bucket (Manifest.menu, GraphEntry.shape); 9: context buckets
# (Manifest.context_buckets, GraphEntry.context)
MANIFEST = "manifest.json"

BACKENDS = ("export", "aoti", "neuron")

# ------------------------------------------------------------------ dtypes

# every dtype a manifest may name (torch's name without "torch.") -> (bytes per element, safetensors code)
DTYPE_TABLE = {"float32": (4, "F32"), "bfloat16": (2, "BF16"), "float16": (2, "F16"), "int64": (8, "I64"),
               "int32": (4, "I32"), "bool": (1, "BOOL")}
DTYPE_NAMES = tuple(DTYPE_TABLE)
DTYPE_BYTES = {name: nbytes for name, (nbytes, _) in DTYPE_TABLE.items()}
SAFETENSORS_CODES = {name: code for name, (_, code) in DTYPE_TABLE.items()}
MODEL_DTYPES = ("float32", "bfloat16", "float16")  # what a bundle's weights, KV caches and activations may be


def torch_dtype(name: str):
    """The torch.dtype of a manifest dtype name (torch is imported only here: the builder reads this
    module before it may import torch)."""
    import torch

    if name not in DTYPE_TABLE:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPE_NAMES)}")
    return getattr(torch, name)


def dtype_name(dtype) -> str:
    """A torch.dtype's manifest name ("torch.bfloat16" -> "bfloat16")."""
    return str(dtype).removeprefix("torch.")


# ------------------------------------------------------------------ speculation shapes
#
# Every batch bucket has one speculation shape (what `--speculation always` runs) and may have a menu of
# more, compiled alongside it (`--speculation auto` serves whichever is fastest on the host). A
# speculative round drafts a tree rooted at the
# pending token: the root's children are the draft's top-k at the pending position; each of
# `depth - 1` draft steps expands `width` frontier nodes by their top-k children; `num_nodes` nodes
# (the root included) are verified in one target pass. Dynamic trees (SGLang's --speculative-eagle-topk /
# --speculative-num-draft-tokens) keep the best `width` new nodes as the frontier and verify the
# num_nodes - 1 best drafted nodes by cumulative draft log-probability; static trees (TensorRT-LLM's
# eagle_choices) fix the nodes as paths of child ranks. A chain of K is the tree (K, 1, 1, K + 1).
MAX_DEPTH = 16
MAX_NODES = 128


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _at_most(n: int):
    """A size cap checked on the raw value, before pydantic validates any element (its own max_length
    counts after validating them all)."""
    def check(v):
        if isinstance(v, (list, dict, str)) and len(v) > n:
            raise ValueError(f"has {len(v)} items, at most {n} are allowed")
        return v
    return BeforeValidator(check)


def Capped(tp, n: int):
    return Annotated[tp, _at_most(n)]


class SpecShape(_Strict):
    depth: Annotated[int, Field(ge=0, le=MAX_DEPTH)]  # draft tokens on the longest path; 0 = no speculation
    topk: Annotated[int, Field(ge=1, le=MAX_NODES)] = 1  # children per expanded node
    width: Annotated[int, Field(ge=1, le=MAX_NODES)] = 1  # nodes expanded per draft step
    num_nodes: Annotated[int, Field(ge=1, le=MAX_NODES)] = 1  # nodes per verify pass, the root included
    choices: Capped(list[Capped(list[Annotated[int, Field(ge=0, le=MAX_NODES)]], MAX_DEPTH)],
                    MAX_NODES - 1) | None = None  # static tree: paths of ranks

    @model_validator(mode="after")
    def _valid(self) -> "SpecShape":
        if self.depth == 0:
            if (self.topk, self.width, self.num_nodes, self.choices) != (1, 1, 1, None):
                raise ValueError("a shape without speculation (depth 0) has topk 1, width 1, num_nodes 1, no choices")
        elif self.choices is not None:
            if self != static_tree(self.choices):
                raise ValueError("topk / width / num_nodes / depth do not match the static tree's choices")
        elif self.width > self.topk:
            raise ValueError(f"width {self.width} exceeds topk {self.topk}")
        else:
            problems = tree_problems(self.depth, self.topk, self.num_nodes)
            if problems:
                key, message = problems[0]
                raise ValueError(f"{key}: {message}")
        return self

    @property
    def kind(self) -> str:
        return "none" if self.depth == 0 else "static" if self.choices is not None else (
            "chain" if self.topk == 1 else "dynamic")

    @property
    def speculates(self) -> bool:
        return self.depth > 0

    @property
    def scratch(self) -> int:
        """KV positions past a row's pending one that a round writes: the verify's nodes (target) and
        the draft steps' frontier nodes (draft)."""
        return max(self.num_nodes - 1, (self.depth - 1) * self.width)

    @property
    def tag(self) -> str:
        """A short name for flags and graph names: none, chain3, tree4x2x8 (depth x topk x nodes), static
        trees by depth x nodes and a digest of their paths."""
        if self.kind == "static":
            paths = hashlib.sha256(json.dumps(self.choices).encode()).hexdigest()[:6]
            return f"static{self.depth}x{self.num_nodes}-{paths}"
        return {"none": "none", "chain": f"chain{self.depth}",
                "dynamic": f"tree{self.depth}x{self.topk}x{self.num_nodes}"}[self.kind]

    def describe(self) -> str:
        return {"none": "no speculation", "chain": f"chain K {self.depth}",
                "dynamic": f"tree depth {self.depth} topk {self.topk} nodes {self.num_nodes}",
                "static": f"static tree depth {self.depth} nodes {self.num_nodes}"}[self.kind]

    def dims(self) -> dict[str, int]:
        """The shape symbols of the role table."""
        return {"N": self.num_nodes, "T": self.depth + 1, "W": self.width, "k": self.topk,
                "M": max(1, (self.depth - 1) * self.width)}


NO_SPECULATION = SpecShape(depth=0)


def chain(K: int) -> SpecShape:
    return SpecShape(depth=K, num_nodes=K + 1) if K else NO_SPECULATION


def max_tree_nodes(depth: int, topk: int) -> int:
    """The most nodes a dynamic tree can verify: the root, its topk children, then topk**2 candidates per
    further draft step."""
    return 1 + topk + (depth - 1) * topk * topk if depth else 1


# The speculation-shape rules, each stated once with the recipe key it is about: the recipe places every
# problem at its line (recipe/checks.py), a manifest raises the first.

def tree_problems(depth: int, topk: int, num_nodes: int) -> list[tuple[str, str]]:
    """A dynamic tree of `depth` draft steps, `topk` children per expanded node and `num_nodes` nodes per
    verify pass (the root included), each within its own bounds: [(recipe key, message)]."""
    if depth == 0:
        return [("num_speculative_tokens", "must be >= 1 with a tree (a tree drafts at least one step); for no "
                                           "speculation at this batch bucket drop tree")]
    most = max_tree_nodes(depth, topk)
    bounds = f"[{depth + 1}, {min(most, MAX_NODES)}]"
    if num_nodes < depth + 1:
        return [("num_draft_tokens", f"must be in {bounds}, got {num_nodes}: it counts the root too, so {depth} draft "
                                     f"steps verify at least num_speculative_tokens + 1 = {depth + 1} nodes; raise "
                                     "num_draft_tokens or lower num_speculative_tokens")]
    if num_nodes > most:
        return [("num_draft_tokens", f"must be in {bounds}, got {num_nodes}: {depth} steps of topk {topk} children "
                                     f"can grow at most {most} nodes (the root included); lower num_draft_tokens or "
                                     "raise topk or num_speculative_tokens")]
    return []


def choices_problems(choices: list[list[int]]) -> list[tuple[int | None, str]]:
    """A static tree's paths of child ranks (TensorRT-LLM eagle_choices), each rank below MAX_NODES:
    [(index of the bad path, or None for the list, message)]."""
    if not choices:
        return [(None, "must not be empty: give paths of child ranks such as [[0], [1], [0, 0]] (the root is "
                       "implied)")]
    out: list[tuple[int | None, str]] = []
    given = {tuple(c) for c in choices}
    first: dict[tuple, int] = {}
    too_deep = False
    for i, c in enumerate(choices):
        t = tuple(c)
        if not t:
            out.append((i, "an empty path [] (the root is implied); remove it"))
        elif t in first:
            out.append((i, f"{list(t)} appears twice (first as choices[{first[t]}]); each path names one node, "
                           "remove one"))
        else:
            first[t] = i
            if len(t) > 1 and t[:-1] not in given:
                out.append((i, f"{list(t)} has no parent {list(t[:-1])} (the paths must be prefix-closed); add "
                               f"{list(t[:-1])} or remove {list(t)}"))
            if len(t) > MAX_DEPTH and not too_deep:
                out.append((i, f"{list(t)} is {len(t)} deep; a tree has at most {MAX_DEPTH} draft steps (the "
                               "runtime's MAX_DEPTH); shorten the paths"))
                too_deep = True
    if len(choices) + 1 > MAX_NODES:
        out.append((None, f"{len(choices)} paths, at most {MAX_NODES - 1}: a verify pass holds at most {MAX_NODES} "
                          "nodes (the runtime's MAX_NODES), the root included; remove paths"))
    return out


def dynamic_tree(depth: int, topk: int, num_nodes: int) -> SpecShape:
    return SpecShape(depth=depth, topk=topk, width=topk, num_nodes=num_nodes) if topk > 1 else chain(depth)


def static_tree(choices: list[list[int]]) -> SpecShape:
    """The shape of a static tree given as TensorRT-LLM's eagle_choices: each path of child ranks names
    one node; the set must be prefix-closed. Raises ValueError naming the first bad path (choices_problems)."""
    problems = choices_problems(choices)
    if problems:
        where, message = problems[0]
        raise ValueError(f"choices{'' if where is None else f'[{where}]'}: {message}")
    paths = [tuple(c) for c in choices]
    depth = max(len(c) for c in paths)
    parents = {c[:-1] for c in paths if len(c) > 1}
    width = max([sum(len(p) == m for p in parents) for m in range(1, depth)] or [1])
    return SpecShape.model_construct(depth=depth, topk=max(c[-1] for c in paths) + 1, width=width,
                                     num_nodes=len(paths) + 1, choices=sorted_choices(paths))


def sorted_choices(choices) -> list[list[int]]:
    """Static-tree paths in node order: by depth, then by ranks (parents before children)."""
    return [list(c) for c in sorted(map(tuple, choices), key=lambda c: (len(c), c))]


# ------------------------------------------------------------------ the graph contract
#
# One graph per (role, bucket), called as
#     graph(weights: tuple[Tensor, ...], kv: Tensor, rank: Tensor[1], *inputs) -> tuple[Tensor, ...]
# weights in the order GraphEntry.weights lists them, then GraphEntry.packed (copies made at load),
# `kv` the model's static KV cache (mutated in place), the rank as an int64 tensor (one graph serves
# every rank), then the role's inputs below.
# Shape symbols: n the bucket (prefill length S or batch size b); from the bucket's SpecShape N (nodes
# per verify), T = depth + 1 (the longest accepted path with its bonus token), W (nodes per draft
# step), k (children per node; prefill: the largest k of any bucket), M (draft-step scratch); A = 3 x the
# padded target hidden (aux states), Hd the padded draft hidden, V the target vocab.
# Dtypes: a manifest dtype, "model" (the bundle dtype) or "index" (int64; int32 where the backend
# asks: Neuron). Outputs are what the runtime returns (integer outputs int64 on every backend).
#
# Tree inputs: node i of a row sits at KV slot start + i (verify) or at `slots` (draft step) and at RoPE
# position `positions`; it sees every committed slot < start and the scratch slots start + j with
# tree_mask[i, j] != 0 (its ancestors and itself; an index dtype: Neuron takes no bool inputs).
#
# Context buckets (NxDI's token-generation buckets): a per-context role also has one graph per entry c of
# Manifest.context_buckets that reads only KV slots 0..c-1 (same inputs and outputs; attention over the
# cache costs in proportion to the slots read). The engine calls the smallest one whose slots hold every
# slot the call's rows write (pick_context); the graph without a context reads the whole cache.


@dataclass(frozen=True)
class Port:
    """One input or output of a role: name, shape in the symbols above, dtype."""

    name: str
    shape: tuple[str | int, ...]
    dtype: str


@dataclass(frozen=True)
class Role:
    name: str
    model: str  # target | draft
    bucket_kind: str  # prefill (one sequence of S tokens) | batch (b rows)
    inputs: tuple[Port, ...]  # after the rank, in call order
    outputs: tuple[Port, ...]
    token_input: str  # the input whose size is the tokens one call processes
    needs_depth: int = 0  # compiled for a bucket whose shape has at least this depth
    per_shape: bool = False  # one graph per shape of the bucket's menu (else one per bucket: merged_shape)
    per_context: bool = False  # also one graph per context bucket (attends over that many KV slots only)

    def graph_name(self, bucket: int, variant: SpecShape | None = None, context: int | None = None) -> str:
        """<role>_b<bucket> (prefill: _s<length>); a menu shape's own graph adds _<tag>, a context bucket's
        _c<slots>."""
        return f"{self.name}_{'s' if self.bucket_kind == 'prefill' else 'b'}{bucket}" + (
            f"_{variant.tag}" if variant is not None else "") + (f"_c{context}" if context is not None else "")

    def input_specs(self, bucket: int, shape: SpecShape, *, target_hidden: int, draft_hidden: int, dtype: str,
                    index_dtype: str = "int64") -> list[tuple[str, list[int], str]]:
        """(name, shape, dtype name) of every input in call order, the rank first."""
        dims = _dims(bucket, shape, target_hidden, draft_hidden, 0)
        return [(RANK.name, list(RANK.shape), RANK.dtype)] + [_resolve(p, dims, dtype, index_dtype) for p in self.inputs]

    def output_specs(self, bucket: int, shape: SpecShape, *, target_hidden: int, draft_hidden: int, vocab: int,
                     dtype: str) -> list[tuple[str, list[int], str]]:
        dims = _dims(bucket, shape, target_hidden, draft_hidden, vocab)
        return [_resolve(p, dims, dtype, "int64") for p in self.outputs]

    def tokens_per_call(self, bucket: int, shape: SpecShape) -> int:
        (port,) = [p for p in self.inputs if p.name == self.token_input]
        dims = _dims(bucket, shape, 0, 0, 0)
        return math.prod(dims[d] if isinstance(d, str) else d for d in port.shape)


RANK = Port("rank", (1,), "int64")  # always int64: a portable graph's input, Neuron's per-rank weight


def _dims(n: int, shape: SpecShape, target_hidden: int, draft_hidden: int, vocab: int) -> dict[str, int]:
    return {"n": n, **shape.dims(), "A": 3 * target_hidden, "Hd": draft_hidden, "V": vocab}


def _resolve(p: Port, dims: dict[str, int], dtype: str, index_dtype: str) -> tuple[str, list[int], str]:
    shape = [dims[d] if isinstance(d, str) else d for d in p.shape]
    return p.name, shape, {"model": dtype, "index": index_dtype}.get(p.dtype, p.dtype)


def _ports(*specs: str) -> tuple[Port, ...]:
    """"tokens[1,n]:index" -> Port("tokens", (1, "n"), "index")."""
    out = []
    for spec in specs:
        head, dtype = spec.split(":")
        name, dims = head.rstrip("]").split("[")
        out.append(Port(name, tuple(int(d) if d.isdigit() else d for d in dims.split(",")), dtype))
    return tuple(out)


ROLES: dict[str, Role] = {r.name: r for r in (
    Role("target_prefill", "target", "prefill", _ports("tokens[1,n]:index", "slot[1]:index", "last[1]:index"),
         _ports("logits[1,V]:float32", "aux[1,n,A]:model"), "tokens"),
    Role("target_verify", "target", "batch",
         _ports("tokens[n,N]:index", "positions[n,N]:index", "start[n]:index", "tree_mask[n,N,N]:index"),
         _ports("logits[n,N,V]:float32", "aux[n,N,A]:model"), "tokens", needs_depth=1, per_shape=True,
         per_context=True),
    Role("target_decode", "target", "batch", _ports("tokens[n]:index", "pos[n]:index"),
         _ports("logits[n,V]:float32", "aux[n,A]:model"), "tokens", per_context=True),
    Role("draft_prefill", "draft", "prefill",
         _ports("aux[1,n,A]:model", "next_tokens[1,n]:index", "slot[1]:index", "last[1]:index"),
         _ports("token[1,k]:int64", "logprob[1,k]:float32", "hidden[1,Hd]:model"), "next_tokens", needs_depth=1),
    Role("draft_catchup", "draft", "batch",
         _ports("aux[n,T,A]:model", "next_tokens[n,T]:index", "start[n]:index", "last[n]:index"),
         _ports("token[n,k]:int64", "logprob[n,k]:float32", "hidden[n,Hd]:model"), "next_tokens", needs_depth=1),
    Role("draft_step", "draft", "batch",
         _ports("hidden[n,W,Hd]:model", "tokens[n,W]:index", "positions[n,W]:index", "slots[n,W]:index",
                "start[n]:index", "tree_mask[n,W,M]:index"),
         _ports("token[n,W,k]:int64", "logprob[n,W,k]:float32", "hidden[n,W,Hd]:model"), "tokens", needs_depth=2,
         per_shape=True),
)}
# derived views
PREFILL_ROLES = tuple(r.name for r in ROLES.values() if r.bucket_kind == "prefill")
BATCH_ROLES = tuple(r.name for r in ROLES.values() if r.bucket_kind == "batch")
ROLE_MODEL = {r.name: r.model for r in ROLES.values()}


MAX_MENU = 16  # shapes on one batch bucket's menu besides its own


def merged_shape(shapes) -> SpecShape:
    """What a graph shared by several shapes is built for: the deepest, with the largest topk of any (the
    prefill graphs over every shape of the bundle, a bucket's draft_catchup over its menu: they propose
    the root's children for whichever shape drafts next, and catch up on its longest accepted path)."""
    shapes = list(shapes)
    deepest = max(shapes, key=lambda s: (s.depth, s.topk))
    k = max(s.topk for s in shapes)
    return deepest if deepest.topk == k else deepest.model_copy(update={"topk": k})


def bucket_shapes(speculation: dict[int, SpecShape], menu: dict[int, list[SpecShape]] | None,
                  bucket: int) -> list[SpecShape]:
    """A batch bucket's shapes: its own first, then its menu."""
    return [speculation[bucket], *(menu or {}).get(bucket, [])]


def all_shapes(speculation: dict[int, SpecShape], menu: dict[int, list[SpecShape]] | None) -> list[SpecShape]:
    return [s for b in speculation for s in bucket_shapes(speculation, menu, b)]


PlannedRole = tuple[str, int, SpecShape | None, int | None]


def plan_roles(prefill_buckets: list[int], speculation: dict[int, SpecShape],
               menu: dict[int, list[SpecShape]] | None = None, contexts: list[int] | tuple[int, ...] = ()
               ) -> list[PlannedRole]:
    """Every (role, bucket, variant, context) a bundle has, in build order: the prefill roles per prefill
    bucket (draft_prefill if any shape speculates), then per batch bucket the roles its shapes need
    (target_decode always: the plain round and the speculation-cutoff fallback); variant is the menu shape a
    per-shape role's graph is for (None: the bucket's own shape, or a graph every shape of the bucket
    shares); context the KV slots a per-context role's graph reads (None: the whole cache), the whole-cache
    graph first."""
    depth = max(s.depth for s in all_shapes(speculation, menu))
    out: list[PlannedRole] = [
        (r, s, None, None) for s in prefill_buckets for r in PREFILL_ROLES if depth >= ROLES[r].needs_depth]
    for b, own in speculation.items():
        shapes = bucket_shapes(speculation, menu, b)
        for r in BATCH_ROLES:
            role = ROLES[r]
            if not role.per_shape:
                variants = [None] if max(s.depth for s in shapes) >= role.needs_depth else []
            else:
                variants = [None if s == own else s for s in shapes if s.depth >= role.needs_depth]
            for c in [None, *contexts] if role.per_context else [None]:
                out += [(r, b, v, c) for v in variants]
    return out


def pick_context(contexts: list[int], slots: int) -> int | None:
    """The smallest context bucket holding `slots` KV slots (None: the whole cache)."""
    return next((c for c in contexts if c >= slots), None)


def graph_shape(role: str, bucket: int, speculation: dict[int, SpecShape],
                menu: dict[int, list[SpecShape]] | None = None, variant: SpecShape | None = None) -> SpecShape:
    """The speculation shape one graph is built for."""
    if role in PREFILL_ROLES:
        return merged_shape(all_shapes(speculation, menu))
    if ROLES[role].per_shape:
        return variant or speculation[bucket]
    return merged_shape(bucket_shapes(speculation, menu, bucket))


# ------------------------------------------------------------------ the KV scratch rule
#
# A row at pending position p speculates while p + depth <= max_model_len - 1 (its accepted tokens
# stay inside max_model_len); a row past that cutoff still rides along in a verify batch, which writes
# N positions from p, and in the draft steps. So every KV-cache row has the largest shape's scratch
# positions past max_model_len, rounded up to KV_ALIGN so that the cache (and every graph but verify /
# catch-up / step) keeps its shape when only the speculation shape changes.
KV_ALIGN = 64


def can_speculate(pos: int, depth: int, max_model_len: int) -> bool:
    return pos + depth <= max_model_len - 1


def min_max_model_len(depth: int) -> int:
    """The smallest max_model_len for `depth` speculative tokens, depth + 2: the pending token sits at
    p >= 1 (a prompt has a token) and can_speculate needs p + depth <= max_model_len - 1. Also the smallest
    context bucket: the slots a verify at the first speculating position writes."""
    return int(depth) + 2


def kv_cache_length(max_model_len: int, scratch: int) -> int:
    """Positions per KV-cache row: max_model_len + the scratch positions, rounded up to KV_ALIGN."""
    need = max_model_len + scratch
    return -(-need // KV_ALIGN) * KV_ALIGN


MAX_DIM = 1 << 40  # no real tensor dimension comes near this; a manifest that says so is refused
Dim = Annotated[int, Field(ge=0, le=MAX_DIM)]
Count = Annotated[int, Field(ge=1, le=1 << 24)]
DIGEST_RE = re.compile(r"[0-9a-f]{64}")


def bundle_relpath(path: str) -> str:
    """The one rule for paths in a manifest: relative, POSIX, normalised, inside the bundle."""
    p = PurePosixPath(path)
    if (not path or "\\" in path or "\0" in path or p.is_absolute() or path != p.as_posix()
            or any(part in ("", ".", "..") for part in path.split("/"))):
        raise ValueError(f"path {path!r} is not a plain relative path inside the bundle")
    return path


class BundleError(Eagle3Error):
    """The bundle cannot be served; the message names the file and the fix."""


class SchemaError(BundleError):
    """A manifest schema version this runtime cannot read."""


class TensorSpec(_Strict):
    name: str
    shape: Capped(list[Dim], 16)
    dtype: Literal[DTYPE_NAMES]  # type: ignore[valid-type]
    pad: str | None = None  # weights: how the tensor was padded (see eagle3_build.sharding)
    shard: str | None = None  # weights: replicate | column | row | kv | vocab

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


class FileEntry(_Strict):
    path: Capped(str, 4096)  # relative to the bundle root, POSIX separators
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    size: Annotated[int, Field(ge=0)]

    @field_validator("path")
    @classmethod
    def _inside(cls, v: str) -> str:
        return bundle_relpath(v)


# oneDNN's packed formats: one copy may hold several weights (PackedWeight.fused), and one copy of a weight serves
# every row count (eagle3_runtime.packing)
ONEDNN_FORMATS = ("onednn", "onednn_bf16")
BLOCKED = "blocked"  # Inductor's CPU GEMM template's weight layout: also fuses, one copy per block_n
BLOCKED_BF16 = "blocked_bf16"  # the same layout in bfloat16 (draft projections only)
BLOCKED_FORMATS = (BLOCKED, BLOCKED_BF16)
FUSED_FORMATS = (*ONEDNN_FORMATS, *BLOCKED_FORMATS)


class PackedWeight(_Strict):
    """A graph input made at load time from one of its weights (eagle3_runtime.packing)."""
    weight: str  # qualified name, one of the graph's weights
    # more of them, concatenated after `weight` along the output dim into one copy (FUSED_FORMATS only)
    fused: Capped(list[str], 8) = []
    rows: Count  # the GEMM row count the packing is for
    format: Literal["mkl_sgemm", "onednn", "onednn_bf16", "blocked", "blocked_bf16"]  # (packing.FORMATS)
    block_n: Annotated[int, Field(ge=1, le=1024)] | None = None  # the blocked formats' (and only theirs)

    @model_validator(mode="after")
    def _block_n(self):
        if (self.format in BLOCKED_FORMATS) != (self.block_n is not None):
            raise ValueError(f"packed weight {self.weight!r}: block_n goes with the blocked formats and only with them")
        return self


MAX_WEIGHTS = 1 << 16  # tensors of one model / weights of one graph (a 64-layer MoE has a few thousand)
MAX_FILES = 1 << 16
MAX_PORTS = 32


class GraphEntry(_Strict):
    name: str
    role: Literal[tuple(ROLE_MODEL)]  # type: ignore[valid-type]
    model: Literal["target", "draft"]
    bucket: Count
    file: FileEntry
    weights: Capped(list[str], MAX_WEIGHTS)  # qualified "<model>/<tensor>" names, in call order
    packed: Capped(list[PackedWeight], MAX_WEIGHTS) = []  # passed after the weights, in this order
    state: str  # name of the KV cache tensor the graph mutates
    inputs: Capped(list[TensorSpec], MAX_PORTS)
    outputs: Capped(list[TensorSpec], MAX_PORTS)
    backend: dict[str, Any] = {}
    key: str = ""  # compile-cache key (eagle3_build.compile.cache)
    shape: SpecShape | None = None  # a per-shape role's graph for a menu shape (None: the bucket's own shape)
    context: Count | None = None  # a per-context role's graph for a context bucket (None: the whole cache)

    def input(self, name: str) -> TensorSpec:
        for spec in self.inputs:
            if spec.name == name:
                return spec
        raise KeyError(f"graph {self.name} has no input {name!r}")


class ModelEntry(_Strict):
    name: Literal["target", "draft"]
    architecture: str
    config: dict[str, Any]  # the canonical args the graphs were traced with
    layout: dict[str, Any]  # tp degree, padded hidden and the per-rank sizes
    weight_files: Capped(list[FileEntry], 1 << 12)  # one per rank
    tensors: Capped(dict[str, TensorSpec], MAX_WEIGHTS)  # what each rank file holds (rank 0 shapes)

    def layout_int(self, key: str) -> int:
        v = self.layout.get(key)
        if type(v) is not int or not 1 <= v <= MAX_DIM:
            raise ValueError(f"models.{self.name}.layout.{key} must be a positive integer, got {v!r}")
        return v


class Manifest(_Strict):
    schema_version: int
    name: str
    created_at: str
    backend: str
    dtype: Literal[MODEL_DTYPES]  # type: ignore[valid-type]
    tp_degree: Count
    num_speculative_tokens: Annotated[int, Field(ge=0, le=MAX_DEPTH)]  # the deepest shape's depth (menus too)
    speculation: Capped(dict[Count, SpecShape], 64)  # per batch bucket: what --speculation always serves
    menu: Capped(dict[Count, Capped(list[SpecShape], MAX_MENU)], 64) = {}  # per batch bucket: more shapes
    max_num_seqs: Count
    max_model_len: Count
    prefill_buckets: Capped(list[Count], 64) = Field(min_length=1)
    batch_buckets: Capped(list[Count], 64) = Field(min_length=1)
    context_buckets: Capped(list[Count], 64) = []  # KV slots the per-context roles' extra graphs read
    aux_layer_ids: Capped(list[int], 64)
    vocab_size: Count
    eos_token_ids: Capped(list[int], 1024)
    bos_token_id: int | None
    draft_format: str
    recipe: dict[str, Any]
    sources: dict[str, Any]
    toolchain: dict[str, str]
    models: Capped(dict[str, ModelEntry], 2)
    state: Capped(list[TensorSpec], 16)  # KV caches the runtime allocates (zeros)
    kv_layout: Capped(list[str], 8)  # the KV caches' dims by name, in order: a permutation of KV_DIMS
    graphs: Capped(list[GraphEntry], 1024)
    files: Capped(list[FileEntry], MAX_FILES)  # tokenizer, configs, everything else
    notes: Capped(list[str], 1024) = []
    build: dict[str, Any] = {}  # timings, cache hits, host: excluded from the digest
    digest: str = ""  # sha256 over everything above except created_at and build

    @model_validator(mode="after")
    def _consistent(self) -> "Manifest":
        """What the runtime relies on, checked as data before anything is allocated or loaded; every
        check is linear in the manifest's size."""
        _check_buckets(self)
        _check_speculation(self)
        _check_serving(self)
        _check_graph_table(self)
        states = _check_states(self)
        weights: dict[str, list[str]] = {}
        for g in self.graphs:
            if g.model != ROLE_MODEL[g.role] or states.get(g.model) != g.state:
                raise ValueError(f"graph {g.name}: model {g.model!r} / state {g.state!r} do not match its role "
                                 f"({ROLE_MODEL[g.role]}, state {states.get(ROLE_MODEL[g.role])!r})")
            fmt = g.backend.get("format")
            if fmt != GRAPH_FORMATS.get(self.backend, fmt):
                raise ValueError(f"graph {g.name}: its file is a {fmt!r} graph, a {self.backend} bundle's graphs are "
                                 f"{GRAPH_FORMATS[self.backend]!r}")
            _check_ports(self, g)
            _check_weights(self, g, weights.setdefault(g.model, g.weights))
        if self.digest and not DIGEST_RE.fullmatch(self.digest):
            raise ValueError("digest must be 64 lowercase hex digits (sha256)")
        return self

    def scratch(self) -> int:
        return max(s.scratch for s in all_shapes(self.speculation, self.menu))

    def longest_prompt(self) -> int:
        """The most prompt tokens a request may have: max_model_len - 1 where every batch bucket has a verify
        graph to continue a prompt past its first prefill chunk (the engine's prefill plan), else the largest
        prefill bucket."""
        if all(any(s.speculates for s in self.shapes(b)) for b in self.batch_buckets):
            return self.max_model_len - 1
        return min(self.prefill_buckets[-1], self.max_model_len - 1)

    def shapes(self, bucket: int) -> list[SpecShape]:
        """A batch bucket's speculation shapes: its own, then its menu."""
        return bucket_shapes(self.speculation, self.menu, bucket)

    def state_bytes(self) -> int:
        return sum(s.nbytes for s in self.state)

    def compute_digest(self) -> str:
        """Same artifact <=> same digest: covers every file's sha256, the graph keys, shapes, recipe,
        sources and toolchain, but not when or how fast it was built."""
        return digest_of(self.model_dump(mode="json"))

    def kv_dim(self, name: str) -> int:
        """Where dim `name` of KV_DIMS ("rows": a sequence's slot, "positions": a token's) is in every KV cache."""
        return self.kv_layout.index(name)

    def state_of(self, model: str) -> str:
        """The name of model `model`'s KV cache (what its graphs mutate)."""
        return next(g.state for g in self.graphs if g.model == model)

    def graph(self, role: str, bucket: int, shape: SpecShape | None = None, slots: int | None = None
              ) -> GraphEntry:
        """The graph of `role` at `bucket` that serves `shape` (None: the bucket's own shape) and reads the
        fewest KV slots holding `slots` (None: the whole-cache graph)."""
        variant = shape if shape is not None and ROLES[role].per_shape and shape != self.speculation.get(bucket) \
            else None
        context = pick_context(self.context_buckets, slots) if slots is not None and ROLES[role].per_context \
            else None
        for g in self.graphs:
            if g.role == role and g.bucket == bucket and g.shape == variant and g.context == context:
                return g
        raise KeyError(f"bundle has no {role} graph for bucket {bucket}" + (f" and {variant.describe()}" if variant
                                                                               else ""))

    def all_files(self) -> list[FileEntry]:
        """Every file once (a neuron bundle's graphs of one model share that model's file)."""
        out = [g.file for g in self.graphs] + list(self.files)
        for m in self.models.values():
            out += m.weight_files
        return list({f.path: f for f in out}.values())


def digest_of(raw: dict) -> str:
    """The bundle digest of a manifest as JSON data (the builder's model dump, or the raw file the
    runtime reads before validating anything): sha256 of its canonical JSON without created_at, build
    and the digest itself."""
    body = {k: v for k, v in raw.items() if k not in ("created_at", "build", "digest")}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ------------------------------------------------------------------ manifest facts the runtime relies on

# what each backend's graph files are (GraphEntry.backend["format"])
GRAPH_FORMATS = {"export": "torch.export", "aoti": "aotinductor", "neuron": "nxd-model"}
PACKING_BACKENDS = ("aoti",)  # graphs that may take weights packed at load (GraphEntry.packed)

# KV caches: one state tensor per model with these dims, in the order the manifest's kv_layout names:
# layers, 2 (k, v), rows (max_num_seqs), KV heads per rank, positions (kv_cache_length), head_dim; a row is
# a sequence slot, a position a token's KV slot
KV_DIMS = ("layers", "kv", "rows", "heads", "positions", "head_dim")


def kv_state_name(model: str) -> str:
    return f"{model}_kv"


def index_dtype(backend: str) -> str:
    """The dtype of token / position / index inputs: int32 on Neuron (NxDI's), int64 elsewhere."""
    return "int32" if backend == "neuron" else "int64"


def kv_state_shape(model: ModelEntry, max_num_seqs: int, positions: int, layout=KV_DIMS) -> list[int]:
    """The KV cache a model's graphs take (its dims in `layout` order), from its config and per-rank layout."""
    layers = model.config.get("num_layers", 1)  # (an EAGLE3 draft is one decoder layer)
    head_dim = model.config.get("head_dim")
    for what, v in (("config.num_layers", layers), ("config.head_dim", head_dim)):
        if type(v) is not int or not 1 <= v <= MAX_DIM:
            raise ValueError(f"models.{model.name}.{what} must be a positive integer, got {v!r}")
    dims = {"layers": layers, "kv": 2, "rows": max_num_seqs, "heads": model.layout_int("kv_heads_per_rank"),
            "positions": positions, "head_dim": head_dim}
    return [dims[d] for d in layout]


def _check_buckets(m: Manifest) -> None:
    K = m.num_speculative_tokens
    if m.max_model_len < min_max_model_len(K):
        raise ValueError(f"max_model_len {m.max_model_len} must exceed num_speculative_tokens + 1 ({K + 1})")
    for key in ("prefill_buckets", "batch_buckets", "context_buckets"):
        b = getattr(m, key)
        if b != sorted(set(b)):
            raise ValueError(f"{key} {b} must be strictly increasing")
    if m.context_buckets and not min_max_model_len(K) <= m.context_buckets[0] \
            <= m.context_buckets[-1] < m.max_model_len:
        raise ValueError(f"context_buckets {m.context_buckets} must lie in {min_max_model_len(K)}.."
                         f"{m.max_model_len - 1} (below max_model_len; the whole cache is always a graph)")


def _check_speculation(m: Manifest) -> None:
    """One shape per batch bucket; a menu only extends a speculating bucket; K is the deepest shape's depth."""
    if sorted(m.speculation) != m.batch_buckets:
        raise ValueError(f"speculation must have one shape per batch bucket {m.batch_buckets}, "
                         f"has {sorted(m.speculation)}")
    for b, shapes in m.menu.items():
        own = m.speculation.get(b)
        if own is None or not own.speculates:
            why = "is not one of the batch buckets" if own is None else "does not speculate"
            raise ValueError(f"menu: batch bucket {b} {why}; a menu extends a speculating bucket's shape")
        tags = [s.tag for s in [own, *shapes]]
        if any(not s.speculates for s in shapes) or len(set(tags)) != len(tags):
            raise ValueError(f"menu of batch bucket {b}: {tags[1:]} must be speculating shapes, each once and "
                             f"other than the bucket's own ({tags[0]})")
    K = m.num_speculative_tokens
    if K != max(s.depth for s in all_shapes(m.speculation, m.menu)):
        raise ValueError(f"num_speculative_tokens {K} is not the deepest speculation shape's depth")


def _check_serving(m: Manifest) -> None:
    if m.max_num_seqs < m.batch_buckets[-1]:
        raise ValueError(f"max_num_seqs {m.max_num_seqs} is below the largest batch bucket {m.batch_buckets[-1]}")
    if any(not 0 <= t < m.vocab_size for t in m.eos_token_ids):
        raise ValueError(f"eos_token_ids {m.eos_token_ids} must lie in [0, vocab_size {m.vocab_size})")
    if set(m.models) != {"target", "draft"}:
        raise ValueError(f"models must be exactly target and draft, got {sorted(m.models)}")
    for name, model in m.models.items():
        if model.name != name or len(model.weight_files) != m.tp_degree:
            raise ValueError(f"models.{name}: needs name {name!r} and one weight file per rank "
                             f"({m.tp_degree}), has {len(model.weight_files)}")


def _check_graph_table(m: Manifest) -> None:
    """Exactly one graph per (role, bucket, shape, context) the plan needs (plan_roles), none more."""
    have = {(g.role, g.bucket, g.shape.tag if g.shape else None, g.context) for g in m.graphs}
    if len(have) != len(m.graphs):
        raise ValueError("graphs: more than one graph for the same role, bucket, shape and context")
    need = {(r, b, v.tag if v else None, c)
            for r, b, v, c in plan_roles(m.prefill_buckets, m.speculation, m.menu, m.context_buckets)}

    def said(keys):
        return [f"{r}/{b}" + (f"/{v}" if v else "") + (f"/c{c}" if c else "") for r, b, v, c in sorted(keys, key=str)]
    missing = said(need - have)
    if missing:
        raise ValueError(f"graphs: missing {', '.join(missing[:4])} (every bucket needs its shapes' roles, "
                         "per context bucket where the role has them)")
    extra = said(have - need)
    if extra:
        raise ValueError(f"graphs: {', '.join(extra[:4])} serves no shape of its bucket (speculation, menu) "
                         "or no context bucket")


def _check_states(m: Manifest) -> dict[str, str]:
    """One KV cache per model, of the bundle's dtype and the shape its graphs were built for -> {model: name}."""
    if sorted(m.kv_layout) != sorted(KV_DIMS):
        raise ValueError(f"kv_layout {m.kv_layout} must name each of {', '.join(KV_DIMS)} once")
    by_name = {s.name: s for s in m.state}
    names = {model: kv_state_name(model) for model in m.models}
    positions = kv_cache_length(m.max_model_len, m.scratch())
    if set(by_name) != set(names.values()) or len(m.state) != len(names):
        raise ValueError(f"state must be exactly {sorted(names.values())}, got {[s.name for s in m.state]}")
    for model, name in names.items():
        s, want = by_name[name], kv_state_shape(m.models[model], m.max_num_seqs, positions, m.kv_layout)
        if s.dtype != m.dtype or s.shape != want:
            raise ValueError(f"state {name}: {s.dtype} {s.shape}, the bundle's graphs take {m.dtype} {want} "
                             f"({', '.join(m.kv_layout)}: max_num_seqs {m.max_num_seqs} rows, max_model_len "
                             f"{m.max_model_len} + scratch positions)")
    return names


def _check_ports(m: Manifest, g: GraphEntry) -> None:
    """Every input and output of a graph, the rank first, as the role table resolves it for its bucket's
    speculation shape, the padded hidden sizes, the vocab and the bundle's dtypes: the engine builds its
    inputs from these and reads the outputs by them."""
    shape = graph_shape(g.role, g.bucket, m.speculation, m.menu, g.shape)
    role = ROLES[g.role]
    hidden = {name: m.models[name].layout_int("padded_hidden") for name in m.models}
    dims = _dims(g.bucket, shape, hidden["target"], hidden["draft"], m.vocab_size)
    want = ([(RANK.name, list(RANK.shape), RANK.dtype)]
            + [_resolve(p, dims, m.dtype, index_dtype(m.backend)) for p in role.inputs],
            [_resolve(p, dims, m.dtype, "int64") for p in role.outputs])
    for kind, specs, ports in (("inputs", g.inputs, want[0]), ("outputs", g.outputs, want[1])):
        have = [(s.name, s.shape, s.dtype) for s in specs]
        if have != [(n, sh, dt) for n, sh, dt in ports]:
            bad = next((h, w) for h, w in zip(have + [None] * len(ports), ports + [None] * len(have)) if h != w)
            raise ValueError(f"graph {g.name}: {kind} {bad[0]} where its role for bucket {g.bucket} "
                             f"({shape.describe()}) takes {bad[1]} (name, shape, dtype)")


def _check_weights(m: Manifest, g: GraphEntry, first: list[str]) -> None:
    """Weights: the model's tensors, the same list in the same order for every graph of the model (one
    binding per model), each at most once; packed copies only of 2-D float32 weights, for at most the
    rows one call of the graph has, on a backend that packs."""
    if g.weights != first:
        raise ValueError(f"graph {g.name}: its weights differ from the other {g.model} graphs' (order or names)")
    if len(set(g.weights)) != len(g.weights):
        raise ValueError(f"graph {g.name}: a weight is listed twice")
    specs = {}
    for w in g.weights:
        model, _, tensor = w.partition("/")
        if model not in m.models or tensor not in m.models[model].tensors:
            raise ValueError(f"graph {g.name}: weight {w!r} is not in any model's tensors")
        specs[w] = m.models[model].tensors[tensor]
    if g.packed and m.backend not in PACKING_BACKENDS:
        raise ValueError(f"graph {g.name}: packed weights on a {m.backend} graph (only {', '.join(PACKING_BACKENDS)} "
                         "graphs take them)")
    rows = ROLES[g.role].tokens_per_call(g.bucket, graph_shape(g.role, g.bucket, m.speculation, m.menu, g.shape))
    for p in g.packed:
        if p.fused and p.format not in FUSED_FORMATS:
            raise ValueError(f"graph {g.name}: packed weight {p.weight!r} fuses {len(p.fused)} more in format "
                             f"{p.format}, which takes one weight per copy")
        for w in (p.weight, *p.fused):
            spec = specs.get(w)
            if spec is None:
                raise ValueError(f"graph {g.name}: packed weight {w!r} is not one of its weights")
            if len(spec.shape) != 2 or spec.dtype != "float32" or p.rows > rows:
                raise ValueError(f"graph {g.name}: packed weight {w!r} ({spec.dtype} {spec.shape}, {p.rows} rows): "
                                 f"packing takes 2-D float32 weights for at most the graph's {rows} token rows")
            if spec.shape[1:] != specs[p.weight].shape[1:]:
                raise ValueError(f"graph {g.name}: packed weights {p.weight!r} and {w!r} are fused but differ in "
                                 "input width")


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_entry(root: Path, path: Path) -> FileEntry:
    return FileEntry(path=path.relative_to(root).as_posix(), sha256=sha256_file(path), size=path.stat().st_size)
