"""A model's tensor-parallel layout: how its dimensions (heads, hidden, intermediate, vocab) map onto
tp ranks, padding included. The model files build it; sharding.py applies it to the weights."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """How one model's dimensions map onto tp ranks (and padding)."""

    tp: int
    hidden: int  # H_u
    padded_hidden: int  # H_p (== hidden when not padded)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    input_hidden: int = 0  # width of each aux chunk the draft's fc reads (target hidden, unpadded)
    padded_input_hidden: int = 0

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.tp

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.tp)

    @property
    def vocab_per_rank(self) -> int:
        return math.ceil(self.vocab / self.tp)

    @property
    def padded_intermediate(self) -> int:
        return padded_intermediate_size(self.intermediate, self.hidden, self.padded_hidden, self.tp)

    @property
    def intermediate_per_rank(self) -> int:
        return self.padded_intermediate // self.tp

    def to_dict(self) -> dict:
        return {"tp": self.tp, "hidden": self.hidden, "padded_hidden": self.padded_hidden,
                "heads_per_rank": self.heads_per_rank, "kv_heads_per_rank": self.kv_heads_per_rank,
                "vocab_per_rank": self.vocab_per_rank, "intermediate_per_rank": self.intermediate_per_rank}


def padded_intermediate_size(intermediate: int, hidden: int, padded_hidden: int, tp: int) -> int:
    """The MLP / expert intermediate width the ranks hold, rounded up to a multiple of tp. When it equals
    the hidden size (GPT-OSS: 2880) it is padded together with the hidden (-> 3072).
    Padded channels have zero gate/up weights and biases, so they output exactly zero (SwiGLU: silu(0) = 0;
    GPT-OSS: (up + 1) * 0 * sigmoid(0) = 0) and their zero down rows add nothing."""
    inter = padded_hidden if intermediate == hidden else intermediate
    return math.ceil(inter / tp) * tp
