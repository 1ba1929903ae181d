"""Llama-family target model as static-shape, functional PyTorch (gpt-fast style).

Weights are *graph inputs* (bound from the bundle's safetensors at load time), so the module is
built on the meta device and only its RoPE table is real. The KV cache is one static tensor

    kv: [num_layers, 2, max_num_seqs, num_kv_heads, max_model_len, head_dim]

read and written through `KVCache` (in place, or functionally for Neuron device state). Row i
of a batch-bucket-b graph is cache row i (`kv[:, :, :b]`, a view), so the
runtime keeps active sequences in rows 0..n-1; prefill writes one request into row `slot`.

Aux states for EAGLE3 are the residual-stream states *entering* decoder layers `aux_layer_ids`
(vLLM semantics; HF `hidden_states[k]`).

Tensor parallelism (`Layout`): every module is built with its rank-local shapes; collectives go
through `Comm` (torch.distributed functional collectives for torch.export / AOTI, NxD's parallel-region
functions for Neuron), and the rank is a tensor (an input, or Neuron's per-rank weight) so one graph
serves every rank. With hidden padding (H_u -> H_p) the padded channels stay exactly zero through the
network and RMSNorm averages over H_u only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from ..errors import CheckpointError
from .layout import Layout
from .linear import Linear, project


@dataclass(frozen=True)
class LlamaArgs:
    ARCH: ClassVar[str] = "llama"

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


def rope_params(cfg: dict) -> dict:
    """HF rope parameters from a config dict, read as transformers reads config.json: 5.x takes a truthy
    legacy `rope_scaling` over `rope_parameters` (4.x knows only `rope_scaling`), and the top-level
    `rope_theta` fills a missing `rope_theta`. A file carrying both forms consistently (what
    `Rope.config_fields` writes) reads the same either way."""
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", float(cfg.get("rope_theta") or 10000.0))
    return params


def llama_args(cfg: dict, role: str) -> LlamaArgs:
    try:
        heads = cfg["num_attention_heads"]
        return LlamaArgs(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope=rope_params(cfg), max_position_embeddings=cfg.get("max_position_embeddings", 8192))
    except KeyError as e:
        raise CheckpointError(f"{role} config.json lacks {e.args[0]!r}") from e


def rope_inv_freq(rope: dict, head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling exactly as the installed transformers (4.x or 5.x) computes them
    for these rope parameters (the numerical reference)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = rope.get("rope_type", "default")
    cfg = LlamaConfig(head_dim=head_dim, hidden_size=head_dim, num_attention_heads=1,
                      max_position_embeddings=max_position_embeddings, **Rope.config_kwargs(rope))
    if rope_type in ROPE_INIT_FUNCTIONS:  # 4.x has "default" there too
        return ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    if rope_type == "default":  # 5.x: the default rope lives on the model's rotary embedding
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        return LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    raise CheckpointError(f"rope_type {rope_type!r} is not known to the installed transformers")


class Rope(nn.Module):
    @staticmethod
    def config_fields(rope: dict) -> dict:
        """The config.json keys for rope parameters in both forms: `rope_parameters` (transformers 5) and
        `rope_theta` + `rope_scaling` (4.x: None for the default rope, else the parameters less the theta).
        transformers 5 reads `rope_scaling` + `rope_theta` back into exactly `rope_parameters`."""
        params = dict(rope)
        params.setdefault("rope_type", "default")
        params.setdefault("rope_theta", 10000.0)
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        return {"rope_parameters": params, "rope_theta": params["rope_theta"],
                "rope_scaling": None if params["rope_type"] == "default" else scaling}

    @staticmethod
    def config_kwargs(rope: dict) -> dict:
        """The rope keyword arguments the installed transformers' config classes understand:
        `rope_parameters` for 5.x, `rope_theta` + `rope_scaling` for 4.x (which ignores `rope_parameters`)."""
        import transformers

        fields = Rope.config_fields(rope)
        if int(transformers.__version__.split(".")[0]) >= 5:
            return {"rope_parameters": fields["rope_parameters"]}
        return {"rope_theta": fields["rope_theta"], "rope_scaling": fields["rope_scaling"]}

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


class FunctionalCollectives:
    """torch.distributed functional collectives over the default process group (a fake one while
    tracing), captured by torch.export / AOTI."""

    GROUP = "0"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x, "sum", self.GROUP)

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(funcol, "all_gather_single"):
            return funcol.all_gather_single(x, x.dim() - 1, self.GROUP)
        # torch 2.9 (the Neuron SDK's) has the same op only under its older name, which wants contiguous input
        return funcol.all_gather_tensor(x.contiguous(), x.dim() - 1, self.GROUP)


class Comm:
    """The in-graph collectives of one model (one object shared by all its layers): a sum over the
    TP ranks and a gather along the last dim. `ops` implements them (FunctionalCollectives, or the
    Neuron backend's NxD mappings)."""

    def __init__(self, tp: int, ops=None):
        self.tp, self.ops = tp, ops or FunctionalCollectives()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp == 1 else self.ops.all_reduce(x)

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp == 1 else self.ops.gather_last(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, true_dim: int | None = None):
        super().__init__()
        self.eps, self.true_dim = eps, true_dim or dim
        self.weight = nn.Parameter(torch.empty(dim))

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        """x / rms(x) in float32."""
        h = x.float()
        if self.true_dim == h.shape[-1]:
            var = h.pow(2).mean(-1, keepdim=True)
        else:  # padded channels are zero: average over the real ones only
            var = h.pow(2).sum(-1, keepdim=True) / self.true_dim
        return h * torch.rsqrt(var + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self.normed(x).to(x.dtype)


class VocabEmbedding(nn.Module):
    """Vocab-parallel embedding: rank r holds rows [r*vpr, (r+1)*vpr); masked lookup + all-reduce."""

    def __init__(self, vocab_per_rank: int, dim: int, comm: Comm):
        super().__init__()
        self.comm, self.vpr = comm, vocab_per_rank
        self.weight = nn.Parameter(torch.empty(vocab_per_rank, dim))

    def forward(self, ids: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
        if self.comm.tp == 1:
            return F.embedding(ids, self.weight)
        local = ids - rank * self.vpr
        rows = local.clamp(0, self.vpr - 1)
        ok = rows == local  # this rank's rows (a compare with no 64-bit scalar operand for Neuron)
        e = F.embedding(rows, self.weight) * ok[..., None].to(self.weight.dtype)
        return self.comm.all_reduce(e)


def vocab_parallel_logits(h: torch.Tensor, head: nn.Module, vocab: int, comm: Comm) -> torch.Tensor:
    """Local logits over this rank's vocab rows (`head`: the module whose weight projects to them), gathered in
    rank order; the zero-padded rows of short trailing ranks land past `vocab` and are cut off, so they can never
    be chosen."""
    logits = comm.gather_last(project(h, head)[0].float())
    return logits[..., :vocab] if logits.shape[-1] != vocab else logits


class KVCache:
    """A graph's access to its model's static KV cache kv [layers, 2, rows, Hkv, S, d].

    In place (`functional=False`, the portable backends): every index is a tensor, so a write is ONE
    index_put_ on the graph input. `kv[layer, 0, rows, ...]` with Python ints would write through a
    select() view; functionalized, that becomes a select_scatter, which Inductor/AOTI materialise as a
    full copy of the whole cache per layer (measured: 2.3 s vs 24 ms per SmolLM2-sized decode step). A
    direct index_put on the graph input is re-inplaced to a scatter of just the new rows.

    Functional (`functional=True`, Neuron): the cache is device state, a module Parameter the graph
    may not mutate; each write makes the new cache value (`kv` afterwards), which the graph returns as
    the output aliased to that state (XLA lowers it to an in-place scatter on the device buffer).
    """

    def __init__(self, kv: torch.Tensor, functional: bool = False):
        self.kv, self.functional = kv, functional

    @classmethod
    def of(cls, cache: "KVCache | torch.Tensor") -> "KVCache":
        """A KVCache as given, or the in-place one over a plain cache tensor."""
        return cache if isinstance(cache, KVCache) else cls(cache)

    def write(self, layer: int, rows, positions, k_new, v_new) -> None:
        """k_new/v_new [b, Hkv, T, d] at (rows, positions) [b, T] of `layer`."""
        which = torch.zeros_like(rows)
        layer_idx = which + layer
        for kind, new in ((which, k_new), (which + 1, v_new)):
            index = [layer_idx, kind, rows, None, positions]
            if self.functional:
                self.kv = torch.ops.aten.index_put(self.kv, index, new.transpose(1, 2))
            else:
                self.kv[layer_idx, kind, rows, :, positions] = new.transpose(1, 2)

    def read(self, layer: int, b: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [b, Hkv, slots, d] of cache rows 0..b-1, KV slots 0..slots-1."""
        return self.kv[layer, 0, :b, :, :slots], self.kv[layer, 1, :b, :, :slots]

    @property
    def length(self) -> int:
        return self.kv.shape[4]


@dataclass
class Where:
    """Where one call's tokens sit. rows/slots [b, T]: the cache entries their keys go to; positions
    [b, T]: RoPE positions; visible [b, T, S]: the cache slots each query sees (None in prefill: the
    fresh keys, causal). A chain's slots are its positions; a tree's nodes share positions per depth."""

    rows: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    visible: torch.Tensor | None
    prefill: bool


def where(cache: KVCache, rows, positions, prefill: bool, slots=None, start=None, tree_mask=None,
          context: int | None = None) -> Where:
    """Causal over positions (slots = positions), or a tree: slots < start committed, slot start + j seen
    where tree_mask[.., j] (graph_contract.ROLES); over the first `context` KV slots (None: all)."""
    slots = positions if slots is None else slots
    if prefill:
        return Where(rows, slots, positions, None, True)
    key = torch.arange(context or cache.length, device=positions.device, dtype=positions.dtype)
    if tree_mask is None:
        return Where(rows, slots, positions, key[None, None, :] <= positions[:, :, None], False)
    b, T, M = tree_mask.shape
    rel = key[None, :] - start[:, None].to(key.dtype)  # [b, S]
    # (tensor against tensor: on the XLA device an int32 compared with a Python int is widened to s64)
    inside = rel.clamp(0, M - 1)
    seen = tree_mask.bool().gather(2, inside[:, None, :].expand(b, T, key.shape[0]))
    in_tree, before = inside == rel, rel < inside  # 0 <= rel < M; rel < 0
    return Where(rows, slots, positions, before[:, None, :] | (in_tree[:, None, :] & seen), False)


def attend(q, k_new, v_new, cache: KVCache, layer: int, at: Where):
    """Write k/v of this step into the static cache, then attend.

    q [b, H, T, d]; k_new/v_new [b, Hkv, T, d]. Prefill attends over its own fresh keys (causal, the
    prompt starts at 0); every other call attends over cache rows 0..b-1 where `at.visible` (a verify's or tree's
    queries: the query heads of each KV head folded into its query rows, so SDPA passes over that head's keys once).
    """
    cache.write(layer, at.rows, at.slots, k_new, v_new)
    if at.prefill:
        return F.scaled_dot_product_attention(q, k_new, v_new, is_causal=True, enable_gqa=True)
    keys, values = cache.read(layer, q.shape[0], at.visible.shape[-1])
    b, H, T, d = q.shape
    G = H // keys.shape[1]
    if T > 1 and G > 1:  # each KV head's G query heads as G*T query rows of one head: one pass over its keys
        mask = at.visible[:, None, None].expand(b, 1, G, T, -1).reshape(b, 1, G * T, -1)
        o = F.scaled_dot_product_attention(q.reshape(b, H // G, G * T, d), keys, values, attn_mask=mask)
        return o.view(b, H, T, d)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=at.visible[:, None], enable_gqa=True)


class Attention(nn.Module):
    """q/k/v column-parallel by heads (rank-local counts), o_proj row-parallel + all-reduce."""

    def __init__(self, in_features: int, hidden: int, n_heads: int, n_kv: int, head_dim: int, comm: Comm):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim, self.comm = n_heads, n_kv, head_dim, comm
        self.q_proj = Linear(in_features, n_heads * head_dim, bias=False)
        self.k_proj = Linear(in_features, n_kv * head_dim, bias=False)
        self.v_proj = Linear(in_features, n_kv * head_dim, bias=False)
        self.o_proj = Linear(n_heads * head_dim, hidden, bias=False)

    def forward(self, x, cos, sin, cache, layer, at: Where):
        b, T, _ = x.shape
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        q = q.view(b, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(b, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = attend(q, k, v, cache, layer, at)
        return self.comm.all_reduce(self.o_proj(o.transpose(1, 2).reshape(b, T, self.n_heads * self.head_dim)))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, comm: Comm):
        super().__init__()
        self.comm = comm
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    def forward(self, x):
        gate, up = project(x, self.gate_proj, self.up_proj)
        return self.comm.all_reduce(self.down_proj(F.silu(gate) * up))


class DecoderLayer(nn.Module):
    def __init__(self, a: LlamaArgs, L: Layout, comm: Comm):
        super().__init__()
        Hp = L.padded_hidden
        self.self_attn = Attention(Hp, Hp, L.heads_per_rank, L.kv_heads_per_rank, a.head_dim, comm)
        self.mlp = MLP(Hp, L.intermediate_per_rank, comm)
        self.input_layernorm = RMSNorm(Hp, a.rms_norm_eps, L.hidden)
        self.post_attention_layernorm = RMSNorm(Hp, a.rms_norm_eps, L.hidden)

    def forward(self, h, cos, sin, cache, layer, at: Where):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, cache, layer, at)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderStack(nn.Module):
    """The target-model frame Llama and GPT-OSS share: vocab-parallel embedding, decoder layers, final
    norm, lm_head (unless tied), RoPE and the aux-state capture. Subclasses supply the layers and norm.
    Canonical weight names = HF names without the `model.` prefix."""

    def __init__(self, a, aux_layer_ids: tuple[int, ...], L: Layout, make_layer, norm_cls=RMSNorm):
        super().__init__()
        self.args, self.layout, self.aux_layer_ids = a, L, tuple(aux_layer_ids)
        comm = self.comm = Comm(L.tp)
        Hp = L.padded_hidden
        self.embed_tokens = VocabEmbedding(L.vocab_per_rank, Hp, comm)
        self.layers = nn.ModuleList(make_layer(i, comm) for i in range(a.num_layers))
        self.norm = norm_cls(Hp, a.rms_norm_eps, L.hidden)
        if not a.tie_word_embeddings:
            self.lm_head = Linear(Hp, L.vocab_per_rank, bias=False)
        self.rope = Rope(a.rope, a.head_dim, a.max_position_embeddings)

    def kv_shape(self, max_num_seqs: int, max_model_len: int) -> list[int]:
        a, L = self.args, self.layout
        return [a.num_layers, 2, max_num_seqs, L.kv_heads_per_rank, max_model_len, a.head_dim]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens if self.args.tie_word_embeddings else self.lm_head
        return vocab_parallel_logits(self.norm(h), head, self.args.vocab_size, self.comm)

    def forward(self, tokens, positions, cache: KVCache | torch.Tensor, rows, prefill: bool, rank: torch.Tensor,
                slots=None, start=None, tree_mask=None, context: int | None = None):
        """tokens/positions/rows [b, T] -> (last hidden [b, T, H_p], aux [b, T, 3*H_p]); a tree's
        slots / start / tree_mask and the KV slots read (`context`) as in `where`."""
        cache = KVCache.of(cache)
        at = where(cache, rows, positions, prefill, slots, start, tree_mask, context)
        h = self.embed_tokens(tokens, rank)
        cos, sin = self.rope(positions, h.dtype)
        entering = {}
        for i, layer in enumerate(self.layers):
            entering[i] = h
            h = layer(h, cos, sin, cache, i, at)
        return h, torch.cat([entering[i] for i in self.aux_layer_ids], dim=-1)


class Llama(DecoderStack):
    """Target model."""

    def __init__(self, a: LlamaArgs, aux_layer_ids: tuple[int, ...], layout: Layout | None = None):
        L = layout or llama_layout(a, 1)
        super().__init__(a, aux_layer_ids, L, lambda i, comm: DecoderLayer(a, L, comm))


def llama_layout(a, tp: int, padded_hidden: int | None = None) -> Layout:
    """The layout of a Llama or GPT-OSS target (same field names; GPT-OSS's expert intermediate follows
    Layout's rules)."""
    return Layout(tp=tp, hidden=a.hidden_size, padded_hidden=padded_hidden or a.hidden_size,
                  num_heads=a.num_heads, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim,
                  intermediate=a.intermediate_size, vocab=a.vocab_size)
