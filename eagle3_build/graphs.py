"""Graph planning and the per-role graph modules.

One graph per (role, bucket). Every graph is called as

    graph(weights: tuple[Tensor, ...], kv: Tensor, rank: Tensor[1], *inputs) -> tuple[Tensor, ...]

weights in the order the manifest lists them (bound from weights/<model>/rank<r>.safetensors),
`kv` the model's static KV cache (mutated in place), the rank as a tensor (so one graph serves every
rank), then the step inputs below. H is the padded hidden size. The role modules themselves take
(cache: KVCache, rank, *inputs), so the Neuron backend drives them with its device state and
per-rank weight instead (backends/neuron.py). Token, position and index inputs are int64, or int32
where the backend asks for it (`index_dtype`).

  role            bucket  inputs                                             outputs
  target_prefill  S       tokens[1,S] slot[1] last[1]                        logits[1,V] aux[1,S,3H]
  target_verify   b       tokens[b,K+1] start[b]                             logits[b,K+1,V] aux[b,K+1,3H]
  target_decode   b       tokens[b] pos[b]                                   logits[b,V]
  draft_prefill   S       aux[1,S,3H] next_tokens[1,S] slot[1] last[1]       token[1] hidden[1,Hd]
  draft_catchup   b       aux[b,K+1,3H] next_tokens[b,K+1] start[b] last[b]  token[b] hidden[b,Hd]
  draft_step      b       hidden[b,Hd] tokens[b] pos[b]                      token[b] hidden[b,Hd]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from eagle3_runtime.manifest import BATCH_ROLES, PREFILL_ROLES, ROLE_MODEL

from .models.eagle3 import Eagle3Draft
from .models.llama import Llama



@dataclass(frozen=True)
class GraphSpec:
    role: str
    bucket: int

    @property
    def model(self) -> str:
        return ROLE_MODEL[self.role]

    @property
    def name(self) -> str:
        return f"{self.role}_{'s' if self.role in PREFILL_ROLES else 'b'}{self.bucket}"


def plan_graphs(prefill_buckets: list[int], batch_buckets: list[int]) -> list[GraphSpec]:
    """Every graph a bundle needs: both prefill roles per prefill bucket, all batch roles per batch
    bucket (target_decode is always present: it is the speculation-cutoff fallback)."""
    specs = [GraphSpec(r, s) for s in prefill_buckets for r in PREFILL_ROLES]
    specs += [GraphSpec(r, b) for b in batch_buckets for r in BATCH_ROLES]
    return specs


# ---------------------------------------------------------------- role modules

def _last(h: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    return h[torch.arange(h.shape[0], device=h.device, dtype=last.dtype), last]


def _rows(b: int, T: int, like: torch.Tensor) -> torch.Tensor:
    return torch.arange(b, device=like.device, dtype=like.dtype)[:, None].expand(b, T)


def _steps(T: int, like: torch.Tensor) -> torch.Tensor:
    return torch.arange(T, device=like.device, dtype=like.dtype)


class TargetPrefill(nn.Module):
    def __init__(self, m: Llama):
        super().__init__()
        self.m = m

    def forward(self, cache, rank, tokens, slot, last):
        S = tokens.shape[1]
        positions = _steps(S, slot)[None]
        h, aux = self.m(tokens, positions, cache, slot[:, None].expand(1, S), prefill=True, rank=rank)
        return self.m.logits(_last(h, last)), aux


class TargetVerify(nn.Module):
    def __init__(self, m: Llama):
        super().__init__()
        self.m = m

    def forward(self, cache, rank, tokens, start):
        b, T = tokens.shape
        positions = start[:, None] + _steps(T, start)
        h, aux = self.m(tokens, positions, cache, _rows(b, T, start), prefill=False, rank=rank)
        return self.m.logits(h), aux


class TargetDecode(nn.Module):
    def __init__(self, m: Llama):
        super().__init__()
        self.m = m

    def forward(self, cache, rank, tokens, pos):
        b = tokens.shape[0]
        h, _ = self.m(tokens[:, None], pos[:, None], cache, _rows(b, 1, pos), prefill=False, rank=rank)
        return (self.m.logits(h[:, 0]),)


class DraftPrefill(nn.Module):
    def __init__(self, m: Eagle3Draft):
        super().__init__()
        self.m = m

    def forward(self, cache, rank, aux, next_tokens, slot, last):
        S = next_tokens.shape[1]
        positions = _steps(S, slot)[None]
        out = self.m(self.m.combine(aux), next_tokens, positions, cache, slot[:, None].expand(1, S), prefill=True,
                     rank=rank)
        out = _last(out, last)
        return self.m.propose(out), self.m.recurrent_hidden(out)


class DraftCatchup(nn.Module):
    def __init__(self, m: Eagle3Draft):
        super().__init__()
        self.m = m

    def forward(self, cache, rank, aux, next_tokens, start, last):
        b, T = next_tokens.shape
        positions = start[:, None] + _steps(T, start)
        out = self.m(self.m.combine(aux), next_tokens, positions, cache, _rows(b, T, start), prefill=False,
                     rank=rank)
        out = _last(out, last)
        return self.m.propose(out), self.m.recurrent_hidden(out)


class DraftStep(nn.Module):
    def __init__(self, m: Eagle3Draft):
        super().__init__()
        self.m = m

    def forward(self, cache, rank, hidden, tokens, pos):
        b = tokens.shape[0]
        out = self.m(hidden[:, None], tokens[:, None], pos[:, None], cache, _rows(b, 1, pos), prefill=False,
                     rank=rank)[:, 0]
        return self.m.propose(out), self.m.recurrent_hidden(out)


ROLE_MODULES = {"target_prefill": TargetPrefill, "target_verify": TargetVerify, "target_decode": TargetDecode,
                "draft_prefill": DraftPrefill, "draft_catchup": DraftCatchup, "draft_step": DraftStep}


def step_inputs(spec: GraphSpec, *, K: int, target_hidden: int, draft_hidden: int, dtype: torch.dtype,
                index_dtype: torch.dtype = torch.int64) -> list[tuple[str, list[int], torch.dtype]]:
    """(name, shape, dtype) of a graph's step inputs, in call order (after weights and kv); the rank
    first (int64 always: a portable graph's input, Neuron's per-rank weight)."""
    i64, T, n = index_dtype, K + 1, spec.bucket
    aux3 = 3 * target_hidden
    return [("rank", [1], torch.int64)] + {
        "target_prefill": [("tokens", [1, n], i64), ("slot", [1], i64), ("last", [1], i64)],
        "target_verify": [("tokens", [n, T], i64), ("start", [n], i64)],
        "target_decode": [("tokens", [n], i64), ("pos", [n], i64)],
        "draft_prefill": [("aux", [1, n, aux3], dtype), ("next_tokens", [1, n], i64), ("slot", [1], i64),
                          ("last", [1], i64)],
        "draft_catchup": [("aux", [n, T, aux3], dtype), ("next_tokens", [n, T], i64), ("start", [n], i64),
                          ("last", [n], i64)],
        "draft_step": [("hidden", [n, draft_hidden], dtype), ("tokens", [n], i64), ("pos", [n], i64)],
    }[spec.role]


OUTPUT_NAMES = {"target_prefill": ("logits", "aux"), "target_verify": ("logits", "aux"),
                "target_decode": ("logits",), "draft_prefill": ("token", "hidden"),
                "draft_catchup": ("token", "hidden"), "draft_step": ("token", "hidden")}


class BoundGraph(nn.Module):
    """What gets traced: weights arrive as a tuple input and are bound by functional_call."""

    def __init__(self, role_module: nn.Module, weight_names: list[str]):
        super().__init__()
        self.role_module = role_module
        self.weight_names = ["m." + n for n in weight_names]

    def forward(self, weights: tuple, kv: torch.Tensor, *inputs):
        bound = dict(zip(self.weight_names, weights))
        return torch.func.functional_call(self.role_module, bound, (kv, *inputs), strict=False)


def model_weight_names(model: nn.Module) -> list[str]:
    """Parameters and persistent buffers (d2t) in a stable order."""
    names = [n for n, _ in model.named_parameters()]
    names += [n for n, _ in model.named_buffers() if n.split(".")[-1] not in model_nonpersistent(model)]
    return names


def model_nonpersistent(model: nn.Module) -> set[str]:
    out = set()
    for mod in model.modules():
        out |= set(mod._non_persistent_buffers_set)
    return out


def build_graph_module(spec: GraphSpec, model: nn.Module) -> tuple[BoundGraph, list[str]]:
    names = model_weight_names(model)
    return BoundGraph(ROLE_MODULES[spec.role](model), names), names
