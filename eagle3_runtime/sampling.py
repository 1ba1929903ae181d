"""Sampling and speculative verification (plain PyTorch, CPU, no loops over the vocabulary).

Greedy (temperature 0): emit the target's argmax; verification accepts a draft token iff it equals
the target's argmax at that position.

Sampled (temperature > 0), with a greedy draft (draft prob q = 1 at the proposed token): at position
i accept d_{i+1} with probability p_i(d_{i+1}); on rejection emit a sample from
norm(max(p_i - onehot(d_{i+1}), 0)) (p_i with d_{i+1} zeroed, renormalised) and stop; if all K
drafts are accepted emit a bonus sample from p_K. The emitted tokens then follow the target's own
autoregressive distribution exactly (Leviathan et al. 2023, App. A.1). Temperature, top-k and top-p
are applied to p before the test (`target_probs`), as vLLM does.

Every random draw takes the caller's `torch.Generator`, so a seed reproduces the output.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .tree import Tree

# vLLM's rule: a temperature below this is treated as greedy (dividing by it would overflow).
_GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0        # (0, 1]; 1 = off
    top_k: int = 0            # 0 or -1 = off
    seed: int | None = None   # None -> fresh OS entropy per generator()

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

    def generator(self) -> torch.Generator:
        g = torch.Generator()
        if self.seed is None:
            g.seed()  # non-deterministic seed (std::random_device)
        else:
            g.manual_seed(self.seed % (1 << 64))  # accept negative / large seeds
        return g


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
    probs = torch.softmax(logits / p.temperature, dim=-1)
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
    keep = (cum - vals) < top_p  # mass strictly before the token; 0 for the argmax -> always kept
    out = torch.zeros_like(probs).scatter_(-1, idx, vals * keep)
    return out / out.sum(-1, keepdim=True)


def sample(probs: Tensor, gen: torch.Generator | None) -> int:
    """One token id drawn from `probs` [V] (non-negative, need not be normalised).

    Inverse CDF with one uniform from `gen`: O(V) and ~10x faster than torch.multinomial at a 128k
    vocabulary on CPU. The CDF is summed in float64; a zero-probability token is never returned.
    """
    cdf = probs.double().cumsum(-1)
    x = torch.rand(1, generator=gen, dtype=torch.float64) * cdf[-1]
    i = int(torch.searchsorted(cdf, x, right=True))  # first i with cdf[i] > x
    if i >= probs.shape[-1]:  # x rounded up to the total: take the last token with mass
        i = int(probs.nonzero()[-1])
    return i


def next_token(logits: Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """Plain decode / prefill: the argmax (greedy) or a sample from target_probs(logits)."""
    if p.greedy:
        return int(logits.argmax(-1))
    return sample(target_probs(logits, p), gen)


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


def verify_sampled(logits: Tensor, drafts: list[int], p: SamplingParams,
                   gen: torch.Generator | None) -> tuple[int, list[int]]:
    """Speculative sampling with a greedy draft; returns (a, d_1..d_a + the corrected/bonus token).

    The K acceptance uniforms are drawn up front in one call (independent of the outcome), then one
    uniform for the emitted token: 2 RNG calls per round, same stream for the same seed.
    """
    if p.greedy:
        return verify_greedy(logits, drafts)
    _check_shapes(logits, drafts)
    K = len(drafts)
    probs = target_probs(logits, p)                                   # [K+1, V]
    d = torch.tensor(drafts, dtype=torch.long)
    p_draft = probs[:K].gather(-1, d[:, None]).squeeze(-1)           # p_i(d_{i+1}), [K]
    u = torch.rand(K, generator=gen)
    rejected = (u >= p_draft).tolist()                               # u in [0,1): p = 1 always accepts
    a = rejected.index(True) if True in rejected else K
    if a == K:
        return K, list(drafts) + [sample(probs[K], gen)]
    residual = probs[a].clone()
    residual[drafts[a]] = 0.0                                        # = norm(max(p - onehot(d), 0))
    if not residual.sum() > 0:  # unreachable after normalisation (all mass on d means p_a(d) = 1); guard
        residual = probs[a]
    return a, list(drafts[:a]) + [sample(residual, gen)]


def verify_tree_sampled(logits: Tensor, tree: "Tree", p: SamplingParams,
                        gen: torch.Generator | None) -> tuple[list[int], list[int]]:
    """Speculative sampling over a token tree; returns (accepted path of node indices from the root,
    the path's tokens + the corrected/bonus token). logits [N, V] per node.

    Recursive rejection over siblings with deterministic draft candidates (SpecInfer's multi-draft
    verification; EAGLE-2 / SGLang's target-only tree sampling): at node u, with r = p_u, try u's
    children in draft order, accepting child x with probability r(x) / sum(r); on rejection r(x) = 0
    and the next child is tried. When no child is accepted the emitted token is a sample of r. Each
    emitted token then has exactly the target's distribution p_u (zeroing a rejected x and
    renormalising is the residual norm(max(p - onehot(x), 0)) of the one-candidate case). A chain goes
    to verify_sampled, its one-child case.
    """
    kids = tree.children()
    if all(len(k) <= 1 for k in kids) and kids[-1] == [] and all(kids[i] == [i + 1] for i in range(len(kids) - 1)):
        a, new = verify_sampled(logits, tree.tokens[1:], p, gen)
        return list(range(a + 1)), new
    probs = target_probs(logits, p)  # [N, V]
    path = [0]
    while True:
        u = path[-1]
        r = probs[u].clone()
        accepted = None
        for c in kids[u]:
            x = tree.tokens[c]
            total = float(r.sum())
            if not total > 0:
                break
            if float(torch.rand(1, generator=gen, dtype=torch.float64)) * total < float(r[x]):
                accepted = c
                break
            r[x] = 0.0
        if accepted is None:
            if not r.sum() > 0:  # unreachable (a token of all the mass is always accepted); guard
                r = probs[u]
            return path, [tree.tokens[i] for i in path[1:]] + [sample(r, gen)]
        path.append(accepted)
