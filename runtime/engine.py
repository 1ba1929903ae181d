"""The EAGLE3 loop over a bundle's graphs (gpt-fast style: plain PyTorch, one readable loop).

Sequence state: `ids` = prompt + generated; the last id is *pending* (not yet in the target's KV
cache) at position p = len(ids) - 1. One speculative round:

    draft K tokens:  d_1 from the last prefill/catch-up, d_2..d_K from draft_step at positions p..p+K-2
    verify:          target runs [pending, d_1..d_K] at p..p+K -> greedy g_0..g_K
    accept:          a = length of the prefix with d_i == g_{i-1}; emit d_1..d_a, g_a
    catch-up:        draft re-runs positions p..p+a with the target's aux states -> next d_1

Sequences at p + K > max_model_len - 1 (and --no-spec) use the plain decode graph.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .buckets import pick_bucket
from .bundle import Bundle


class RequestError(ValueError):
    """A request this bundle cannot serve (the message has the numbers)."""


@dataclass
class SpecStats:
    """Speculative-decoding counters, reported in vLLM's format."""

    k: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.k

    def record(self, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += self.k
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def per_position(self) -> list[float]:
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_position]

    def to_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "acceptance_rate": self.acceptance_rate,
                "mean_acceptance_length": self.mean_acceptance_length,
                "per_position_acceptance_rate": self.per_position}

    def format(self) -> str:
        pos = ", ".join(f"{r:.3f}" for r in self.per_position)
        return (f"SpecDecoding metrics: Mean acceptance length: {self.mean_acceptance_length:.2f}, "
                f"Accepted: {self.num_accepted_tokens} tokens, Drafted: {self.num_draft_tokens} tokens, "
                f"Per-position acceptance rate: {pos}, Avg Draft acceptance rate: {100 * self.acceptance_rate:.1f}%")


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS) | "length"
    stats: SpecStats
    seconds: float
    target_passes: int


class Engine:
    def __init__(self, bundle: Bundle):
        self.bundle = bundle
        m = bundle.manifest
        self.K, self.max_len = m.num_speculative_tokens, m.max_model_len
        self.prefill_buckets, self.batch_buckets = m.prefill_buckets, m.batch_buckets
        self.eos = set(m.eos_token_ids)

    def check_request(self, n_prompt: int, max_tokens: int) -> None:
        largest = self.prefill_buckets[-1]
        if n_prompt < 1:
            raise RequestError("the prompt is empty (0 tokens)")
        if n_prompt > largest:
            raise RequestError(f"the prompt has {n_prompt} tokens, the largest prefill bucket of this bundle is "
                               f"{largest} (max_model_len {self.max_len}); shorten the prompt or rebuild with a "
                               "larger buckets.prefill")
        if n_prompt >= self.max_len:
            raise RequestError(f"the prompt has {n_prompt} tokens, max_model_len is {self.max_len}: no room to generate")
        if max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1 (got {max_tokens})")
        if n_prompt + max_tokens > self.max_len:
            raise RequestError(f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
                               f"{self.max_len}; ask for at most {self.max_len - n_prompt} tokens")

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_tokens: int, speculative: bool = True) -> Generation:
        self.check_request(len(prompt_ids), max_tokens)
        b = self.bundle
        K, L = self.K, self.max_len
        t0 = time.perf_counter()
        ids = list(prompt_ids)
        n = len(ids)
        stats = SpecStats(K)
        finish = None

        def emit(tok: int) -> bool:
            """Append one token; True when the sequence is finished."""
            nonlocal finish
            ids.append(tok)
            if tok in self.eos:
                finish = "stop"
            elif len(ids) - n >= max_tokens or len(ids) >= L:
                finish = "length"
            return finish is not None

        # prefill (row 0)
        S = pick_bucket(self.prefill_buckets, n)
        tokens = torch.zeros(1, S, dtype=torch.int64)
        tokens[0, :n] = torch.tensor(ids)
        slot, last = torch.zeros(1, dtype=torch.int64), torch.tensor([n - 1])
        logits, aux = b.graph("target_prefill", S)(tokens, slot, last)
        passes = 1
        done = emit(int(logits[0].argmax()))
        if not done and speculative:
            nxt = torch.zeros(1, S, dtype=torch.int64)
            nxt[0, :n] = torch.tensor(ids[1:n + 1])
            draft_tok, hidden = b.graph("draft_prefill", S)(aux, nxt, slot, last)

        bucket = pick_bucket(self.batch_buckets, 1)
        verify, catchup = b.graph("target_verify", bucket), b.graph("draft_catchup", bucket)
        step, decode = b.graph("draft_step", bucket), b.graph("target_decode", bucket)
        while not done:
            p = len(ids) - 1
            if speculative and p + K <= L - 1:
                drafts = [int(draft_tok[0])]
                for k in range(1, K):
                    draft_tok, hidden = step(hidden, draft_tok, torch.tensor([p - 1 + k]))
                    drafts.append(int(draft_tok[0]))
                logits, aux = verify(torch.tensor([[ids[-1]] + drafts]), torch.tensor([p]))
                passes += 1
                greedy = logits[0].argmax(-1).tolist()
                a = 0
                while a < K and drafts[a] == greedy[a]:
                    a += 1
                stats.record(a)
                new = drafts[:a] + [greedy[a]]
                for tok in new:
                    if done := emit(tok):
                        break
                if not done:
                    nxt = torch.zeros(1, K + 1, dtype=torch.int64)
                    nxt[0, :a + 1] = torch.tensor(new)
                    draft_tok, hidden = catchup(aux, nxt, torch.tensor([p]), torch.tensor([a]))
            else:
                (logits,) = decode(torch.tensor([ids[-1]]), torch.tensor([p]))
                passes += 1
                done = emit(int(logits[0].argmax()))
        return Generation(prompt_ids=list(prompt_ids), token_ids=ids[n:], finish_reason=finish, stats=stats,
                          seconds=time.perf_counter() - t0, target_passes=passes)
