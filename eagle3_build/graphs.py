"""Graph planning and the per-role graph modules.

The contract of every role (inputs, outputs, bucket kind, tokens per call, the call convention) is
`eagle3_runtime.graph_contract.ROLES`; this module implements it. The role modules take
(cache: KVCache, rank, *inputs), so the Neuron backend drives them with its device state and per-rank
weight instead (backends/neuron/model.py); `BoundGraph` is what the portable backends trace: weights as a
tuple input, bound by functional_call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from eagle3_runtime.graph_contract import ROLES, Role, graph_shape, plan_roles
from eagle3_runtime.manifest import dtype_name, torch_dtype
from eagle3_runtime.speculation import SpecShape

from .models.accept import accept_greedy
from .models.eagle3 import Eagle3Draft
from .models.linear import UNPACKED, LinearMethod, using
from .models.llama import Llama
from .models.weights import weight_tensors


@dataclass(frozen=True)
class GraphSpec:
    role: str
    bucket: int
    shape: SpecShape  # the speculation shape it is built for (graph_contract.graph_shape)
    variant: SpecShape | None = None  # the menu shape a per-shape role's graph serves (GraphEntry.shape)
    context: int | None = None  # the KV slots a per-context role's graph reads (GraphEntry.context; None: all)
    accept: str = "host"  # where greedy rows accept (Manifest.accept): "graph" adds the role's accept_outputs

    @property
    def contract(self) -> Role:
        return ROLES[self.role]

    @property
    def model(self) -> str:
        return self.contract.model

    @property
    def name(self) -> str:
        return self.contract.graph_name(self.bucket, self.variant, self.context)

    def tokens_per_call(self) -> int:
        return self.contract.tokens_per_call(self.bucket, self.shape)

    def n_outputs(self) -> int:
        return len(self.contract.outputs) + (len(self.contract.accept_outputs) if self.accept == "graph" else 0)


def plan_graphs(prefill_buckets: list[int], speculation: dict[int, SpecShape],
                menu: dict[int, list[SpecShape]] | None = None, contexts: list[int] | tuple[int, ...] = (),
                accept: str = "host", unroll: bool = False) -> list[GraphSpec]:
    """Every graph a bundle needs (graph_contract.plan_roles)."""
    return [GraphSpec(r, b, graph_shape(r, b, speculation, menu, v), v, c, accept if ROLES[r].accept_outputs else "host")
            for r, b, v, c in plan_roles(prefill_buckets, speculation, menu, contexts, unroll)]


# ---------------------------------------------------------------- role modules

def _last(h: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """h[i, last[i]] for every row i (a gather: on the XLA device an advanced index widens indices to s64)."""
    return h.gather(1, last.view(-1, 1, 1).expand(-1, 1, h.shape[-1]))[:, 0]


def _rows(b: int, T: int, like: torch.Tensor) -> torch.Tensor:
    return torch.arange(b, device=like.device, dtype=like.dtype)[:, None].expand(b, T)


def _steps(T: int, like: torch.Tensor) -> torch.Tensor:
    return torch.arange(T, device=like.device, dtype=like.dtype)


class TargetPrefill(nn.Module):
    def __init__(self, m: Llama, shape: SpecShape, context: int | None = None):
        super().__init__()
        self.m = m

    def forward(self, cache, rank, tokens, slot, last):
        S = tokens.shape[1]
        positions = _steps(S, slot)[None]
        h, aux = self.m(tokens, positions, cache, slot[:, None].expand(1, S), prefill=True, rank=rank)
        return self.m.logits(_last(h, last)), aux


class TargetVerify(nn.Module):
    """The N tree nodes of every row (a chain: N = K + 1 in a line) in one pass; node i at slot start + i. With
    accept "graph", also each row's greedy acceptance (models/accept.py)."""

    def __init__(self, m: Llama, shape: SpecShape, context: int | None = None, accept: str = "host"):
        super().__init__()
        self.m, self.context, self.accept = m, context, accept
        self.depth = shape.depth if accept == "graph" else None  # (host: any shape, None included)

    def forward(self, cache, rank, tokens, positions, start, tree_mask):
        b, N = tokens.shape
        slots = start[:, None] + _steps(N, start)
        h, aux = self.m(tokens, positions, cache, _rows(b, N, start), prefill=False, rank=rank, slots=slots,
                        start=start, tree_mask=tree_mask, context=self.context)
        logits = self.m.logits(h)
        if self.accept == "host":
            return logits, aux
        return logits, aux, *accept_greedy(logits, tokens, tree_mask, self.depth)


class TargetDecode(nn.Module):
    def __init__(self, m: Llama, shape: SpecShape, context: int | None = None):
        super().__init__()
        self.m, self.context = m, context

    def forward(self, cache, rank, tokens, pos):
        b = tokens.shape[0]
        h, aux = self.m(tokens[:, None], pos[:, None], cache, _rows(b, 1, pos), prefill=False, rank=rank,
                        context=self.context)
        return self.m.logits(h[:, 0]), aux[:, 0]


class DraftPrefill(nn.Module):
    def __init__(self, m: Eagle3Draft, shape: SpecShape, context: int | None = None):
        super().__init__()
        self.m, self.k = m, shape.topk

    def forward(self, cache, rank, aux, next_tokens, slot, last):
        S = next_tokens.shape[1]
        positions = _steps(S, slot)[None]
        out = self.m(self.m.combine(aux), next_tokens, positions, cache, slot[:, None].expand(1, S), prefill=True,
                     rank=rank)
        out = _last(out, last)
        return (*self.m.propose(out, self.k), self.m.recurrent_hidden(out))


class DraftCatchup(nn.Module):
    def __init__(self, m: Eagle3Draft, shape: SpecShape, context: int | None = None):
        super().__init__()
        self.m, self.k = m, shape.topk

    def forward(self, cache, rank, aux, next_tokens, start, last):
        b, T = next_tokens.shape
        positions = start[:, None] + _steps(T, start)
        out = self.m(self.m.combine(aux), next_tokens, positions, cache, _rows(b, T, start), prefill=False,
                     rank=rank)
        out = _last(out, last)
        return (*self.m.propose(out, self.k), self.m.recurrent_hidden(out))


class DraftStep(nn.Module):
    """One draft step over W frontier nodes per row: each node's top-k children."""

    def __init__(self, m: Eagle3Draft, shape: SpecShape, context: int | None = None):
        super().__init__()
        self.m, self.k = m, shape.topk

    def forward(self, cache, rank, hidden, tokens, positions, slots, start, tree_mask):
        b, W = tokens.shape
        out = self.m(hidden, tokens, positions, cache, _rows(b, W, start), prefill=False, rank=rank, slots=slots,
                     start=start, tree_mask=tree_mask)
        return (*self.m.propose(out, self.k), self.m.recurrent_hidden(out))


class DraftChain(nn.Module):
    """A chain's depth - 1 draft steps in one graph (graph_contract: unrolled draft): from the root's hidden and
    its first child, step s writes KV slot start + s at position start + s, sees the slots of steps 0..s, and
    its top-1 token and recurrent hidden feed step s + 1."""

    def __init__(self, m: Eagle3Draft, shape: SpecShape, context: int | None = None):
        super().__init__()
        self.m, self.steps = m, shape.depth - 1

    def forward(self, cache, rank, hidden, token, start):
        b, M = token.shape[0], self.steps
        offsets = _steps(M, start)
        seen = torch.ones(M, M, dtype=torch.bool, device=start.device).tril()  # row s: steps 0..s
        h, t, out = hidden[:, None], token[:, None], []
        for s in range(M):
            pos = start[:, None] + offsets[s:s + 1][None, :]  # [b, 1]
            mask = seen[s][None, None, :].expand(b, 1, M).to(start.dtype)
            o = self.m(h, t, pos, cache, _rows(b, 1, start), prefill=False, rank=rank, slots=pos, start=start,
                       tree_mask=mask)
            t = self.m.propose(o, 1)[0][:, :, 0].to(token.dtype)
            h = self.m.recurrent_hidden(o)
            out.append(t)
        return (torch.cat(out, 1),)


ROLE_MODULES = {"target_prefill": TargetPrefill, "target_verify": TargetVerify, "target_decode": TargetDecode,
                "draft_prefill": DraftPrefill, "draft_catchup": DraftCatchup, "draft_step": DraftStep,
                "draft_chain": DraftChain}


def step_inputs(spec: GraphSpec, *, target_hidden: int, draft_hidden: int, dtype: torch.dtype,
                index_dtype: torch.dtype = torch.int64) -> list[tuple[str, list[int], torch.dtype]]:
    """(name, shape, dtype) of a graph's inputs after weights and kv, in call order, the rank first
    (graph_contract.ROLES; `index_dtype` for token / position / index inputs)."""
    ins = spec.contract.input_specs(spec.bucket, spec.shape, target_hidden=target_hidden, draft_hidden=draft_hidden,
                                    dtype=dtype_name(dtype), index_dtype=dtype_name(index_dtype))
    return [(n, shape, torch_dtype(x)) for n, shape, x in ins]


class BoundGraph(nn.Module):
    """What gets traced: weights arrive as a tuple input and are bound by functional_call; the projections go
    through `method` (models.linear.LinearMethod), which gets the weights tuple's entries after the weights."""

    def __init__(self, role_module: nn.Module, weight_names: list[str]):
        super().__init__()
        self.role_module = role_module
        self.weight_names = ["m." + n for n in weight_names]
        self.method: LinearMethod = UNPACKED

    def forward(self, weights: tuple, kv: torch.Tensor, *inputs):
        n = len(self.weight_names)
        bound = dict(zip(self.weight_names, weights[:n]))
        with using(self.role_module, self.method), self.method.bind(tuple(weights[n:])):
            return torch.func.functional_call(self.role_module, bound, (kv, *inputs), strict=False)


def model_weight_names(model: nn.Module) -> list[str]:
    return list(weight_tensors(model))


def build_graph_module(spec: GraphSpec, model: nn.Module) -> tuple[BoundGraph, list[str]]:
    names = model_weight_names(model)
    return BoundGraph(role_module(spec, model), names), names


def role_module(spec: GraphSpec, model: nn.Module) -> nn.Module:
    """The module of a graph's role, for its shape, context and acceptance."""
    extra = {"accept": spec.accept} if spec.contract.accept_outputs else {}
    return ROLE_MODULES[spec.role](model, spec.shape, spec.context, **extra)
