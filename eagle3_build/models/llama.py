"""Llama-family target model as static-shape, functional PyTorch (gpt-fast style).

Weights are *graph inputs* (bound from the bundle's safetensors at load time), so the module is
built on the meta device and only its RoPE table is real. The KV cache is one static tensor

    kv: [num_layers, 2, max_num_seqs, num_kv_heads, max_model_len, head_dim]

mutated in place. Row i of a batch-bucket-b graph is cache row i (`kv[:, :, :b]`, a view), so the
runtime keeps active sequences in rows 0..n-1; prefill writes one request into row `slot`.

Aux states for EAGLE3 are the residual-stream states *entering* decoder layers `aux_layer_ids`
(vLLM semantics; HF `hidden_states[k]`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    rope: dict = field(default_factory=dict)  # HF rope parameters (rope_type, rope_theta, ...)
    max_position_embeddings: int = 8192


def rope_inv_freq(rope: dict, head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling exactly as transformers computes them (the numerical reference)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(rope)
    rope_type = params.get("rope_type", "default")
    cfg = LlamaConfig(head_dim=head_dim, hidden_size=head_dim, num_attention_heads=1,
                      max_position_embeddings=max_position_embeddings, rope_parameters=params)
    if rope_type == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        return LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    return ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")


class Rope(nn.Module):
    def __init__(self, rope: dict, head_dim: int, max_position_embeddings: int):
        super().__init__()
        with torch.device("cpu"):  # real even when the model is built on the meta device
            inv, scale = rope_inv_freq(rope, head_dim, max_position_embeddings)
        self.register_buffer("inv_freq", inv.float(), persistent=False)
        self.scale = float(scale)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [b, h, T, d]; cos/sin [b, T, d]
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def attend(q, k_new, v_new, kv, layer: int, rows, positions, prefill: bool):
    """Write k/v of this step into the static cache, then attend.

    q [b, H, T, d]; k_new/v_new [b, Hkv, T, d]; rows [b, T] cache rows; positions [b, T].
    Prefill attends over its own fresh keys (causal, prompt starts at 0); every other step attends
    over cache rows 0..b-1 with key_pos <= query_pos.
    """
    kv[layer, 0, rows, :, positions] = k_new.transpose(1, 2)
    kv[layer, 1, rows, :, positions] = v_new.transpose(1, 2)
    if prefill:
        return F.scaled_dot_product_attention(q, k_new, v_new, is_causal=True, enable_gqa=True)
    b = q.shape[0]
    keys, values = kv[layer, 0, :b], kv[layer, 1, :b]
    key_pos = torch.arange(kv.shape[4], device=q.device)
    mask = key_pos[None, None, None, :] <= positions[:, None, :, None]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)


class Attention(nn.Module):
    def __init__(self, in_features: int, hidden: int, n_heads: int, n_kv: int, head_dim: int):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, head_dim
        self.q_proj = nn.Linear(in_features, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, n_kv * head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, n_kv * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, hidden, bias=False)

    def forward(self, x, cos, sin, kv, layer, rows, positions, prefill):
        b, T, _ = x.shape
        q = self.q_proj(x).view(b, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = attend(q, k, v, kv, layer, rows, positions, prefill)
        return self.o_proj(o.transpose(1, 2).reshape(b, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.self_attn = Attention(a.hidden_size, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim)
        self.mlp = MLP(a.hidden_size, a.intermediate_size)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, h, cos, sin, kv, layer, rows, positions, prefill):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv, layer, rows, positions, prefill)
        return h + self.mlp(self.post_attention_layernorm(h))


class Llama(nn.Module):
    """Target model. Canonical weight names = HF names without the `model.` prefix."""

    def __init__(self, a: LlamaArgs, aux_layer_ids: tuple[int, ...]):
        super().__init__()
        self.args, self.aux_layer_ids = a, tuple(aux_layer_ids)
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(a) for _ in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        if not a.tie_word_embeddings:
            self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        self.rope = Rope(a.rope, a.head_dim, a.max_position_embeddings)

    def kv_shape(self, max_num_seqs: int, max_model_len: int) -> list[int]:
        a = self.args
        return [a.num_layers, 2, max_num_seqs, a.num_kv_heads, max_model_len, a.head_dim]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight if self.args.tie_word_embeddings else self.lm_head.weight
        return F.linear(self.norm(h), w).float()

    def forward(self, tokens, positions, kv, rows, prefill: bool):
        """tokens/positions/rows [b, T] -> (last hidden [b, T, H], aux [b, T, 3H])."""
        h = self.embed_tokens(tokens)
        cos, sin = self.rope(positions, h.dtype)
        entering = {}
        for i, layer in enumerate(self.layers):
            entering[i] = h
            h = layer(h, cos, sin, kv, i, rows, positions, prefill)
        return h, torch.cat([entering[i] for i in self.aux_layer_ids], dim=-1)
