"""Sampling and speculative verification (plain PyTorch, CPU, no loops over the vocabulary).

Greedy (temperature 0): emit the target's argmax; verification accepts a draft token iff it equals
the target's argmax at that position.

Sampled (temperature > 0): every emitted token is the inverse-CDF sample x = F_p^-1(u_t) of the target's
distribution p at its output position t (temperature, top-k, top-p applied first, as vLLM does:
`target_probs`), with u_t the request's uniform for position t (`Uniforms`: a counter-based stream keyed by
the request's seed and t alone). Verification with the draft's deterministic proposals (a chain, or a
tree's children in order) walks the tree: at node u (output position t) draw x = F_p^-1(u_t); if x is one
of u's children the walk goes on there, else x is emitted and the round ends; at a leaf x is the bonus.
The emitted tokens are then exactly the target's autoregressive samples: each x has distribution p,
a child c is accepted with probability p(c) and, on rejection, x is distributed as p without the proposed
children renormalised — what speculative sampling with a greedy draft (Leviathan et al. 2023, App. A.1)
and recursive rejection over a tree's candidates (SpecInfer; EAGLE-2 / SGLang) give. And since x depends on
(p, u_t) only, a seeded request emits the same tokens whatever the speculation shape (none, chain, tree),
the batch it shares, or a shape switch mid-request: identical wherever the target's probabilities are
(a different graph — another batch bucket, verify width or context bucket — computes them with other
float rounding, which moves a sample only when u_t falls within that rounding of a CDF step).
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .tree import Tree

# vLLM's rule: a temperature below this is treated as greedy (dividing by it would overflow).
_GREEDY_EPS = 1e-5
_MASK64 = (1 << 64) - 1

Uniform = Callable[[int], float]  # j -> the uniform of the j-th token from here on (0: the next one), in [0, 1)


def position_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) of output position `position` of a request seeded `seed`: splitmix64 of
    (seed, position), 53 bits (a counter-based generator: any position without drawing the ones before)."""
    z = (seed + 0x9E3779B97F4A7C15 * (position + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) * 2.0 ** -53


class Uniforms:
    """One request's random numbers: its uniform for every output position (position_uniform)."""

    def __init__(self, seed: int):
        self.seed = seed & _MASK64

    def at(self, position: int) -> Uniform:
        """The uniforms from output position `position` on: u(j) is position + j's."""
        return lambda j=0: position_uniform(self.seed, position + j)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0        # (0, 1]; 1 = off
    top_k: int = 0            # 0 or -1 = off
    seed: int | None = None   # None -> fresh OS entropy per uniforms()

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def validate(self) -> None:
        t, p, k = self.temperature, self.top_p, self.top_k
        if not isinstance(t, (int, float)) or not t >= 0 or t == float("inf"):  # `not >=` catches NaN
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 = off), got {k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")

    def uniforms(self) -> Uniforms:
        """A request's stream: its seed's (negative and large seeds wrap to 64 bits), else fresh entropy."""
        return Uniforms(secrets.randbits(64) if self.seed is None else self.seed)


def target_probs(logits: Tensor, p: SamplingParams) -> Tensor:
    """float32 probabilities [..., V] after temperature, top-k, then top-p, renormalised.

    Greedy params give the one-hot of the argmax (the T -> 0 limit). Top-k keeps every token tied
    with the k-th largest (as vLLM). Top-p (nucleus) keeps the smallest head of the descending-sorted,
    top-k-renormalised distribution whose mass reaches top_p; the argmax always survives.
    """
    logits = logits.float()
    V = logits.shape[-1]
    if p.greedy:
        idx = logits.argmax(-1, keepdim=True)
        return torch.zeros_like(logits).scatter_(-1, idx, 1.0)
    # (+inf, or a huge logit over a tiny temperature, clamped to float32's largest: softmax of inf is NaN)
    probs = torch.softmax((logits / p.temperature).clamp(max=torch.finfo(torch.float32).max), dim=-1)
    if 0 < p.top_k < V:
        kth = probs.topk(p.top_k, dim=-1).values[..., -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if p.top_p < 1.0:
        probs = _top_p(probs, p.top_p)
    return probs


# Top-p first looks at this many largest tokens (a partial sort); it sorts the whole vocabulary only
# when they hold less than top_p of the mass. Same kept set either way.
_TOP_P_CANDIDATES = 1024


def _top_p(probs: Tensor, top_p: float) -> Tensor:
    V = probs.shape[-1]
    vals, idx = probs.topk(min(V, _TOP_P_CANDIDATES), dim=-1)  # descending
    cum = vals.cumsum(-1)
    if vals.shape[-1] < V and not bool((cum[..., -1] >= top_p).all()):
        vals, idx = probs.sort(dim=-1, descending=True)
        cum = vals.cumsum(-1)
    keep = (cum - vals) < top_p  # mass strictly before the token
    keep[..., 0] = True  # the argmax, always (a top_p below float32's smallest number would keep nothing)
    out = torch.zeros_like(probs).scatter_(-1, idx, vals * keep)
    return out / out.sum(-1, keepdim=True)


def sample(probs: Tensor, u: float) -> int:
    """The token at uniform `u` in [0, 1) of `probs` [V] (non-negative, need not be normalised): the
    inverse CDF, summed in float64, O(V) (~10x faster than torch.multinomial at a 128k vocabulary on CPU);
    a zero-probability token is never returned."""
    cdf = probs.double().cumsum(-1)
    i = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))
    if i >= probs.shape[-1]:  # u * total rounded up to the total: take the last token with mass
        i = int(probs.nonzero()[-1])
    return i


def next_token(logits: Tensor, p: SamplingParams, u: Uniform | None) -> int:
    """Plain decode / prefill: the argmax (greedy) or the sample at u(0) of target_probs(logits)."""
    if p.greedy:
        return int(logits.argmax(-1))
    return sample(target_probs(logits, p), u(0))


def _check_shapes(logits: Tensor, drafts: list[int]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(drafts) + 1:
        raise ValueError(f"verify needs logits [K+1, V] for K={len(drafts)} drafts, got {tuple(logits.shape)}")


def verify_greedy(logits: Tensor, drafts: list[int]) -> tuple[int, list[int]]:
    """A chain's greedy acceptance (tree.accept_greedy on the chain: the longest prefix with
    d_{i+1} == argmax(logits[i])); returns (a, d_1..d_a + argmax at a)."""
    from .tree import accept_greedy, chain_tree

    _check_shapes(logits, drafts)
    g = logits.argmax(-1).tolist()
    a = len(accept_greedy(chain_tree(drafts), g)) - 1
    return a, list(drafts[:a]) + [g[a]]


def verify_sampled(logits: Tensor, drafts: list[int], p: SamplingParams, u: Uniform | None) -> tuple[int, list[int]]:
    """A chain's speculative sampling (the module docstring); returns (a, d_1..d_a + the corrected / bonus
    token). Draws u(0)..u(a): one uniform per emitted token."""
    if p.greedy:
        return verify_greedy(logits, drafts)
    _check_shapes(logits, drafts)
    from .tree import chain_tree

    path, new = verify_tree_sampled(logits, chain_tree(drafts), p, u)
    return len(path) - 1, new


def verify_tree_sampled(logits: Tensor, tree: "Tree", p: SamplingParams, u: Uniform) -> tuple[list[int], list[int]]:
    """Speculative sampling over a token tree (the module docstring); returns (accepted path of node
    indices from the root, the path's tokens + the corrected / bonus token). logits [N, V] per node; the
    node at depth d draws u(d)."""
    probs = target_probs(logits, p)  # [N, V]
    kids = tree.children()
    path = [0]
    while True:
        node = path[-1]
        x = sample(probs[node], u(len(path) - 1))
        child = next((c for c in kids[node] if tree.tokens[c] == x), None)
        if child is None:
            return path, [tree.tokens[i] for i in path[1:]] + [x]
        path.append(child)
