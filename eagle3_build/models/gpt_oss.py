"""GPT-OSS target model (`model_type: gpt_oss`) as static-shape, functional PyTorch, next to llama.py.

Same interface as `Llama`, so the role modules of graphs.py drive it unchanged:
forward(tokens, positions, cache, rows, prefill, rank) -> (last hidden, aux), logits(h), kv_shape(B, L).
Canonical weight names are the HF names without `model.`. What differs from Llama (as in
transformers' models/gpt_oss/modeling_gpt_oss.py):

* q/k/v/o biases and per-head attention sinks: p_ij = exp(s_ij) / (sum_k exp(s_ik) + exp(sink_h));
* sliding-window attention on the layers `layer_types` marks `sliding_attention` (key k is visible to
  query q iff q - W < k <= q), full causal attention on the others; one static KV cache for all layers,
  the window is a mask;
* YaRN RoPE (inv_freq and attention scaling from transformers, through llama.Rope);
* MoE MLP: router [E, H] + bias, softmax over the top-k router logits; each expert applies the
  clamped SwiGLU  gu = x @ W_gu + b_gu; gate, up = gu[..., ::2], gu[..., 1::2];
  gate = min(gate, limit); up = clamp(up, -limit, limit); y = ((up + 1) * gate * sigmoid(alpha * gate)) @ W_d + b_d;
* norms multiply by the weight in float32 before casting back (HF GptOssRMSNorm).

Tensor parallelism as for Llama: q/k/v/o and sinks by head, vocab-parallel embedding and lm_head. The
experts are sharded on the intermediate dim: every rank holds every expert's slice (2I/tp interleaved
gate/up columns, I/tp down rows, down bias / tp), the router is replicated, and the routed sum is
all-reduced once per layer. The MoE runs routed (gathering the top-k experts' weights per token) when
few tokens are in flight (decode, verify) and dense over all experts otherwise (prefill): both are
static-shape.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from ..errors import CheckpointError
from .layout import Layout
from .linear import Linear
from .llama import Comm, DecoderStack, RMSNorm, Where, apply_rope, llama_layout, rope_params

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class GptOssArgs:
    ARCH: ClassVar[str] = "gpt_oss"

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # per expert
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    num_experts: int
    experts_per_token: int
    sliding_window: int | None
    layer_types: tuple[str, ...]
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    attention_bias: bool = True
    rope: dict = field(default_factory=dict)
    max_position_embeddings: int = 131072


def gpt_oss_args(cfg: dict, role: str) -> GptOssArgs:
    """GptOssArgs from a config.json dict (transformers' GptOssConfig defaults where a key is absent)."""
    try:
        heads, n = cfg["num_attention_heads"], cfg["num_hidden_layers"]
        types = cfg.get("layer_types") or [SLIDING if i % 2 == 0 else FULL for i in range(n)]
        bad = sorted(set(types) - {SLIDING, FULL})
        if bad or len(types) != n:
            raise CheckpointError(f"{role} config.json: layer_types must list {n} entries of {SLIDING!r} / "
                                  f"{FULL!r}, got {len(types)} entries{f' with {bad}' if bad else ''}")
        experts = cfg.get("num_local_experts") or cfg.get("num_experts")
        top_k = cfg.get("num_experts_per_tok") or cfg.get("experts_per_token")
        if not experts or not top_k:
            raise KeyError("num_local_experts" if not experts else "num_experts_per_tok")
        if not 0 < top_k <= experts:
            raise CheckpointError(f"{role} config.json: num_experts_per_tok {top_k} must be in 1..{experts}")
        rope = rope_params({"rope_theta": 150000.0, **cfg})
        return GptOssArgs(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=n, num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_experts=int(experts), experts_per_token=int(top_k), sliding_window=cfg.get("sliding_window"),
            layer_types=tuple(types), swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            attention_bias=bool(cfg.get("attention_bias", True)), rope=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 131072))
    except KeyError as e:
        raise CheckpointError(f"{role} config.json lacks {e.args[0]!r}") from e


class GptOssRMSNorm(RMSNorm):
    """HF GptOssRMSNorm: weight * normed in float32, then cast (Llama casts first; same in float32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight.float() * self.normed(x)).to(x.dtype)


def sink_attention(q, k, v, sinks, visible, scale: float) -> torch.Tensor:
    """Softmax attention with one extra logit per head (its sink) that takes probability mass but no value.

    q [b, H, T, d]; k/v [b, Hkv, S, d] (GQA: q head h reads KV head h // (H / Hkv)); sinks [H];
    visible [b, T, S] bool.
    """
    b, H, T, d = q.shape
    n_kv = k.shape[1]
    g = H // n_kv
    q = q.view(b, n_kv, g, T, d)
    s = (q @ k[:, :, None].transpose(-1, -2)) * scale  # [b, Hkv, g, T, S]
    s = s.masked_fill(~visible[:, None, None], float("-inf"))
    sink = sinks.to(s.dtype).view(1, n_kv, g, 1, 1).expand(b, n_kv, g, T, 1)
    p = torch.cat([s, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return (p @ v[:, :, None]).view(b, H, T, d)


class Attention(nn.Module):
    def __init__(self, a: GptOssArgs, L: Layout, window: int | None, comm: Comm):
        super().__init__()
        H, Hkv, d, Hp = L.heads_per_rank, L.kv_heads_per_rank, a.head_dim, L.padded_hidden
        self.n_heads, self.n_kv, self.head_dim, self.window, self.comm = H, Hkv, d, window, comm
        self.scale = d ** -0.5
        self.q_proj = Linear(Hp, H * d, bias=a.attention_bias)
        self.k_proj = Linear(Hp, Hkv * d, bias=a.attention_bias)
        self.v_proj = Linear(Hp, Hkv * d, bias=a.attention_bias)
        self.o_proj = Linear(H * d, Hp, bias=a.attention_bias)
        self.sinks = nn.Parameter(torch.empty(H))

    def forward(self, x, cos, sin, cache, layer, at: Where):
        b, T, _ = x.shape
        q = self.q_proj(x).view(b, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.write(layer, at.rows, at.slots, k, v)
        q_pos = at.positions[:, :, None]
        if at.prefill:  # the prompt's own keys (positions 0..S-1)
            keys, values, key_pos = k, v, at.positions[0]
            visible = key_pos <= q_pos
        else:  # cache rows 0..b-1, the slots `at` sees (the context)
            visible = at.visible
            keys, values = cache.read(layer, b, visible.shape[-1])
            key_pos = torch.arange(visible.shape[-1], device=x.device, dtype=q_pos.dtype)
        if self.window is not None:  # on slots: a tree's visible keys (its ancestors) lie within its depth
            visible = visible & (key_pos > q_pos - self.window)
        o = sink_attention(q, keys, values, self.sinks, visible, self.scale)
        return self.comm.all_reduce(self.o_proj(o.transpose(1, 2).reshape(b, T, self.n_heads * self.head_dim)))


def _rows_of(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t[idx] as index_select: on the XLA device an advanced index widens its indices to s64 (to wrap
    negative ones); index_select keeps them 32-bit."""
    return t.index_select(0, idx.reshape(-1)).view(*idx.shape, *t.shape[1:])


class Experts(nn.Module):
    """Stacked experts, rank-local intermediate slice I_r: gate_up [E, H, 2 I_r] (gate even, up odd)."""

    def __init__(self, n_experts: int, hidden: int, inter: int, limit: float, alpha: float):
        super().__init__()
        self.limit, self.alpha = limit, alpha
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, hidden, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(n_experts, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(n_experts, inter, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(n_experts, hidden))

    def act(self, gu: torch.Tensor) -> torch.Tensor:
        gate, up = gu[..., ::2], gu[..., 1::2]
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def routed(self, x, idx, w):
        """x [N, H], idx/w [N, k]: gathers the k chosen experts' weights per token (decode, verify)."""
        gu = torch.einsum("nh,nkhi->nki", x, _rows_of(self.gate_up_proj, idx)) + _rows_of(self.gate_up_proj_bias, idx)
        y = torch.einsum("nki,nkih->nkh", self.act(gu), _rows_of(self.down_proj, idx)) + _rows_of(self.down_proj_bias, idx)
        return (y * w[..., None]).sum(dim=1)

    def dense(self, x, idx, w):
        """Every expert on every token, weighted by the (mostly zero) routing weights (prefill)."""
        gu = torch.einsum("nh,ehi->eni", x, self.gate_up_proj) + self.gate_up_proj_bias[:, None]
        y = torch.einsum("eni,eih->enh", self.act(gu), self.down_proj) + self.down_proj_bias[:, None]
        # routing weights [N, E] as a one-hot sum rather than a scatter (no int64 scatter for neuronx-cc;
        # the same values: each expert is chosen at most once per token)
        experts = torch.arange(y.shape[0], device=idx.device, dtype=idx.dtype)
        weights = ((idx[..., None] == experts).to(w.dtype) * w[..., None]).sum(dim=1)
        return torch.einsum("enh,ne->nh", y, weights)


class MoE(nn.Module):
    def __init__(self, a: GptOssArgs, L: Layout, comm: Comm):
        super().__init__()
        self.top_k, self.n_experts, self.comm = a.experts_per_token, a.num_experts, comm
        self.router = Linear(L.padded_hidden, a.num_experts, bias=True)  # replicated
        self.experts = Experts(a.num_experts, L.padded_hidden, L.intermediate_per_rank, a.swiglu_limit,
                               a.swiglu_alpha)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, T, H = x.shape
        x = x.reshape(b * T, H)
        top, idx = torch.topk(self.router(x), self.top_k, dim=-1)
        idx = idx.to(torch.int32)  # 32-bit expert indices for the gathers (neuronx-cc: no 64-bit gather/scatter)
        w = top.softmax(dim=-1)
        # static choice per graph: gathering k experts per token beats running all E when N*k < E
        y = self.experts.routed(x, idx, w) if b * T * self.top_k < self.n_experts else self.experts.dense(x, idx, w)
        return self.comm.all_reduce(y).view(b, T, H)


class DecoderLayer(nn.Module):
    def __init__(self, a: GptOssArgs, L: Layout, window: int | None, comm: Comm):
        super().__init__()
        Hp = L.padded_hidden
        self.self_attn = Attention(a, L, window, comm)
        self.mlp = MoE(a, L, comm)
        self.input_layernorm = GptOssRMSNorm(Hp, a.rms_norm_eps, L.hidden)
        self.post_attention_layernorm = GptOssRMSNorm(Hp, a.rms_norm_eps, L.hidden)

    def forward(self, h, cos, sin, cache, layer, at: Where):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, cache, layer, at)
        return h + self.mlp(self.post_attention_layernorm(h))


class GptOss(DecoderStack):
    """Target model; same frame and call interface as llama.Llama, its own layers and norm."""

    def __init__(self, a: GptOssArgs, aux_layer_ids: tuple[int, ...], layout: Layout | None = None):
        L = layout or llama_layout(a, 1)

        def layer(i: int, comm: Comm) -> DecoderLayer:
            return DecoderLayer(a, L, a.sliding_window if a.layer_types[i] == SLIDING else None, comm)

        super().__init__(a, aux_layer_ids, L, layer, GptOssRMSNorm)
