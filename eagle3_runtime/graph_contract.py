"""The graph contract: the roles every bundle's graphs play (`ROLES`: model, bucket kind, inputs,
outputs, tokens per call), which graphs a bundle has (`plan_roles`), and its KV caches (the scratch rule,
their dims). The builder implements it (graphs.py), the manifest is checked against it, the engine calls
by it. Torch-free."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .speculation import SpecShape, all_shapes, bucket_shapes, merged_shape

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
# Greedy acceptance in the graph (Manifest.accept "graph"; ACCEPT): the verify graph also returns, per row,
# what accepting its greedy path gives (eagle3_build/models/accept.py): `accepted` drafts, the accepted
# `path` (node indices, root first, zero after it) and the `next_tokens` it emits (the path's tokens after the
# root, then the target's token after its last node; zero after), the draft catch-up's inputs as they are.
# "host": the runtime finds the path from the logits.
#
# Unrolled draft (Manifest.unroll_draft; draft_unrolled): a chain's depth - 1 draft steps run in one draft_chain
# call (vLLM Neuron's fused draft) instead of a draft_step call each: from the root's hidden and its first child
# (the catch-up's), each step's top-1 token feeds the next; step s (0-based) writes the draft's KV slot
# start + s at RoPE position start + s, as draft_step does. Trees keep their draft_step calls.
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
    accept_outputs: tuple[Port, ...] = ()  # after `outputs`, where the bundle accepts in the graph
    unrolled: bool | None = None  # per-shape roles: only for shapes whose draft steps are unrolled (True) / are not

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
                     dtype: str, accept: str = "host") -> list[tuple[str, list[int], str]]:
        dims = _dims(bucket, shape, target_hidden, draft_hidden, vocab)
        ports = self.outputs + (self.accept_outputs if accept == "graph" else ())
        return [_resolve(p, dims, dtype, "int64") for p in ports]

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
         per_context=True, accept_outputs=_ports("accepted[n]:int64", "path[n,T]:int64", "next_tokens[n,T]:int64")),
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
         per_shape=True, unrolled=False),
    Role("draft_chain", "draft", "batch", _ports("hidden[n,Hd]:model", "token[n]:index", "start[n]:index"),
         _ports("tokens[n,M]:int64"), "token", needs_depth=2, per_shape=True, unrolled=True),
)}
ACCEPT = ("host", "graph")  # where a greedy row's verified tree is accepted (Manifest.accept)
# derived views
PREFILL_ROLES = tuple(r.name for r in ROLES.values() if r.bucket_kind == "prefill")
BATCH_ROLES = tuple(r.name for r in ROLES.values() if r.bucket_kind == "batch")
ROLE_MODEL = {r.name: r.model for r in ROLES.values()}


PlannedRole = tuple[str, int, SpecShape | None, int | None]


def draft_unrolled(shape: SpecShape, unroll: bool) -> bool:
    """Whether a shape's draft steps run in one draft_chain call: chains of depth 2 or more, where the bundle
    unrolls."""
    return unroll and shape.kind == "chain" and shape.depth >= 2


def plan_roles(prefill_buckets: list[int], speculation: dict[int, SpecShape],
               menu: dict[int, list[SpecShape]] | None = None, contexts: list[int] | tuple[int, ...] = (),
               unroll: bool = False) -> list[PlannedRole]:
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
                variants = [None if s == own else s for s in shapes if s.depth >= role.needs_depth and (
                    role.unrolled is None or role.unrolled == draft_unrolled(s, unroll))]
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


# KV caches: one state tensor per model with these dims, in the order the manifest's kv_layout names:
# layers, 2 (k, v), rows (max_num_seqs), KV heads per rank, positions (kv_cache_length), head_dim; a row is
# a sequence slot, a position a token's KV slot
KV_DIMS = ("layers", "kv", "rows", "heads", "positions", "head_dim")


def kv_state_name(model: str) -> str:
    return f"{model}_kv"
