"""EAGLE3 draft: one Llama decoder layer whose attention reads cat(embed, hidden) (2H wide).

Per position i the draft pairs the target's aux state aux_i (3 target hidden states) with the
embedding of the NEXT token t_{i+1}, at RoPE position i, and predicts t_{i+2}:

    x   = fc(aux)                       [input_norm(aux) first if norm_before_fc]
    en  = input_layernorm(embed(t_{i+1})); xn = hidden_norm(x)
    r   = (xn if norm_before_residual else x) + o_proj(attn(cat[en, xn]))
    out = r + mlp(post_attention_layernorm(r))
    tok = topk(lm_head(norm(out))) + d2t[topk]              # d2t holds offsets into the target vocab
Recurrent steps feed x = out (norm(out) if norm_output) and the previous draft token, position + 1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from .layout import Layout
from .linear import Linear
from .llama import MLP, Attention, Comm, KVCache, RMSNorm, Rope, VocabEmbedding, Where, vocab_parallel_logits, where


@dataclass(frozen=True)
class Eagle3Args:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int  # target vocab (embedding rows)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # input-of-layer (vLLM) semantics
    norm_before_residual: bool
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    has_d2t: bool = True
    rope: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 8192


class Eagle3Layer(nn.Module):
    def __init__(self, a: Eagle3Args, L: Layout, comm: Comm):
        super().__init__()
        Hp, H = L.padded_hidden, L.hidden
        self.norm_before_residual = a.norm_before_residual
        self.self_attn = Attention(2 * Hp, Hp, L.heads_per_rank, L.kv_heads_per_rank, a.head_dim, comm)
        self.mlp = MLP(Hp, L.intermediate_per_rank, comm)
        self.input_layernorm = RMSNorm(Hp, a.rms_norm_eps, H)
        self.hidden_norm = RMSNorm(Hp, a.rms_norm_eps, H)
        self.post_attention_layernorm = RMSNorm(Hp, a.rms_norm_eps, H)

    def forward(self, e, x, cos, sin, cache, at: Where):
        en, xn = self.input_layernorm(e), self.hidden_norm(x)
        res = xn if self.norm_before_residual else x
        h = res + self.self_attn(torch.cat([en, xn], dim=-1), cos, sin, cache, 0, at)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Draft(nn.Module):
    """Canonical weight names: fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t,
    embed_tokens.weight (the target's when the draft has none), input_norm.weight, fc_norm.{0,1,2}.weight."""

    def __init__(self, a: Eagle3Args, layout: Layout | None = None):
        super().__init__()
        L = layout or draft_layout(a, 1)
        self.args, self.layout = a, L
        comm = self.comm = Comm(L.tp)
        Hp, Hin, Hin_p = L.padded_hidden, L.input_hidden, L.padded_input_hidden
        self.embed_tokens = VocabEmbedding(math.ceil(a.vocab_size / L.tp), Hp, comm)
        if a.norm_before_fc:
            self.input_norm = RMSNorm(3 * Hin_p, a.rms_norm_eps, 3 * Hin)
        if a.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(Hin_p, a.rms_norm_eps, Hin) for _ in range(3))
        self.fc = Linear(3 * Hin_p, Hp, bias=False)  # replicated
        self.midlayer = Eagle3Layer(a, L, comm)
        self.norm = RMSNorm(Hp, a.rms_norm_eps, L.hidden)
        self.lm_head = Linear(Hp, L.vocab_per_rank, bias=False)  # vocab-parallel over the draft vocab
        if a.has_d2t:
            self.register_buffer("d2t", torch.empty(a.draft_vocab_size, dtype=torch.int64))
        self.rope = Rope(a.rope, a.head_dim, a.max_position_embeddings)

    def kv_shape(self, max_num_seqs: int, max_model_len: int) -> list[int]:
        return [1, 2, max_num_seqs, self.layout.kv_heads_per_rank, max_model_len, self.args.head_dim]

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [.., 3*Ht] -> x [.., H]."""
        if self.args.norm_before_fc:
            aux = self.input_norm(aux)
        if self.args.fc_norm:
            aux = torch.cat([n(c) for n, c in zip(self.fc_norm, aux.chunk(3, dim=-1))], dim=-1)
        return self.fc(aux)

    def propose(self, out: torch.Tensor, k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's k most likely next tokens (target vocab ids, best first) and their log-probs
        (float32), [.., k] each, from the layer output."""
        logits = vocab_parallel_logits(self.norm(out), self.lm_head, self.args.draft_vocab_size, self.comm)
        logp, idx = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
        if not self.args.has_d2t:
            return idx, logp
        idx = idx.to(self.d2t.dtype)  # (int64, or int32 on Neuron)
        return idx + self.d2t.index_select(0, idx.reshape(-1)).view(idx.shape), logp  # (32-bit indices on XLA)

    def recurrent_hidden(self, out: torch.Tensor) -> torch.Tensor:
        return self.norm(out) if self.args.norm_output else out

    def forward(self, x, tokens, positions, cache: KVCache | torch.Tensor, rows, prefill: bool, rank: torch.Tensor,
                slots=None, start=None, tree_mask=None):
        cache = KVCache.of(cache)
        at = where(cache, rows, positions, prefill, slots, start, tree_mask)
        e = self.embed_tokens(tokens, rank)
        cos, sin = self.rope(positions, x.dtype)
        return self.midlayer(e, x, cos, sin, cache, at)


def draft_layout(a: Eagle3Args, tp: int, padded_hidden: int | None = None,
                 padded_target_hidden: int | None = None) -> Layout:
    """The draft's vocab-parallel dims are over the DRAFT vocab (its lm_head); its embedding is
    vocab-parallel over the target vocab with the same rule."""
    return Layout(tp=tp, hidden=a.hidden_size, padded_hidden=padded_hidden or a.hidden_size,
                  num_heads=a.num_heads, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim,
                  intermediate=a.intermediate_size, vocab=a.draft_vocab_size,
                  input_hidden=a.target_hidden_size,
                  padded_input_hidden=padded_target_hidden or a.target_hidden_size)
