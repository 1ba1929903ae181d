"""Padding and tensor-parallel sharding of weights (the layouts of vLLM-Neuron / NxDI).

Each rule is a small named function; `tensor_plan` picks the rules for a canonical tensor name and
`write_rank_files` streams a checkpoint through them into weights/<model>/rank<r>.safetensors.

Notation: H_u unpadded hidden, H_p padded hidden; tp ranks, rank r.
* column-parallel (q, gate, up): contiguous rows per rank; k/v by KV head (replicated when tp > n_kv,
  rank r holds head r // (tp // n_kv));
* row-parallel (o, down): contiguous input columns per rank (+ all-reduce in the graph); row-parallel
  biases are divided by tp;
* vocab-parallel (embeddings, lm_heads): ceil(V / tp) rows per rank, short trailing ranks zero-padded;
* replicated: norms, the draft's fc / input_norm, d2t;
* hidden padding: zero columns/rows up to H_p; fc's 3 aux chunks and the draft q/k/v's 2 input halves
  are padded each at its own end;
* GPT-OSS: sinks go with their q heads, the router is replicated, the stacked experts
  (gate_up [E, H, 2I] with interleaved gate/up columns, down [E, I, H]) are sharded on the intermediate
  dim -- whole (gate, up) pairs per rank -- and padded like the hidden (zero-gated channels); they
  stream one expert at a time.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from eagle3_runtime.manifest import SAFETENSORS_CODES, torch_dtype

from .checkpoints.sources import TensorSource
from .errors import UserError
from .models.layout import Layout


def valid_tp_degrees(num_heads: int, num_kv_heads: int, limit: int = 64) -> list[int]:
    return [t for t in range(1, limit + 1)
            if num_heads % t == 0 and (num_kv_heads % t == 0 or t % num_kv_heads == 0)]


def check_tp(model: str, num_heads: int, num_kv_heads: int, tp: int) -> None:
    """Heads must divide evenly; KV heads either divide by tp or are replicated tp // n_kv times.
    (We refuse rather than pad heads: padded heads cost compute on every rank.)"""
    if tp in valid_tp_degrees(num_heads, num_kv_heads, limit=max(tp, 1)):
        return
    valid = valid_tp_degrees(num_heads, num_kv_heads)
    raise UserError(f"tp_degree {tp} does not fit the {model}: {num_heads} attention heads and {num_kv_heads} KV "
                    f"heads must split evenly across ranks; valid tp degrees: {', '.join(map(str, valid))}")


# ------------------------------------------------------------------ padding rules

def pad_dim(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """Zero-pad `dim` at its end up to `size`."""
    if t.shape[dim] == size:
        return t
    if t.shape[dim] > size:
        raise ValueError(f"cannot pad dim {dim} of {tuple(t.shape)} down to {size}")
    shape = list(t.shape)
    shape[dim] = size - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def pad_chunks(t: torch.Tensor, dim: int, chunks: int, size: int) -> torch.Tensor:
    """Split `dim` into `chunks` equal pieces and zero-pad each at its own end to `size`
    (fc: 3 aux chunks -> zeros at [i*H_p + H_u, (i+1)*H_p); draft q/k/v: embedding half | hidden half)."""
    return torch.cat([pad_dim(c, dim, size) for c in t.chunk(chunks, dim=dim)], dim=dim)


# ------------------------------------------------------------------ shard rules

def shard_even(t: torch.Tensor, dim: int, rank: int, tp: int) -> torch.Tensor:
    """Contiguous 1/tp of `dim` (column-parallel rows, row-parallel columns)."""
    if t.shape[dim] % tp:
        raise ValueError(f"dim {dim} of {tuple(t.shape)} does not split into {tp} ranks")
    n = t.shape[dim] // tp
    return t.narrow(dim, rank * n, n)


def shard_vocab(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Rows [r*vpr, min((r+1)*vpr, V)), zero-padded to vpr rows (short trailing ranks)."""
    vocab = t.shape[0]
    vpr = math.ceil(vocab / tp)
    lo, hi = min(rank * vpr, vocab), min((rank + 1) * vpr, vocab)
    return pad_dim(t[lo:hi], 0, vpr)


def shard_gate_up_pairs(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """GPT-OSS experts' fused gate_up (last dim 2I, gate at even and up at odd columns): a contiguous
    1/tp of the last dim. Each rank gets whole (gate, up) pairs -- the same intermediate channels for
    both -- because 2I/tp is even."""
    if t.shape[-1] % (2 * tp):
        raise ValueError(f"gate_up width {t.shape[-1]} does not split into {tp} ranks of whole gate/up pairs")
    return shard_even(t, t.dim() - 1, rank, tp)


def kv_heads_for_rank(rank: int, tp: int, num_kv_heads: int) -> list[int]:
    """tp >= n_kv: one head per rank, head r // (tp // n_kv); else n_kv // tp consecutive heads."""
    if tp >= num_kv_heads:
        return [rank // (tp // num_kv_heads)]
    per = num_kv_heads // tp
    return list(range(rank * per, (rank + 1) * per))


def shard_kv(t: torch.Tensor, rank: int, tp: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    heads = t.view(num_kv_heads, head_dim, *t.shape[1:])
    return torch.cat([heads[h] for h in kv_heads_for_rank(rank, tp, num_kv_heads)], dim=0)


# ------------------------------------------------------------------ per-tensor plan

@dataclass(frozen=True)
class TensorPlan:
    name: str
    pad: str  # none | cols | rows | vec | gate_up | down | qkv_halves | fc | vec_chunks3 | vec_input | expert_*
    shard: str  # replicate | column | row | kv | vocab | row_bias | expert_gate_up | expert_row

    @property
    def per_expert(self) -> bool:
        """Dim 0 is the expert axis and no rule touches it: the tensor streams one expert at a time."""
        return self.pad.startswith("expert_")

    def apply(self, t: torch.Tensor, rank: int, L: Layout) -> torch.Tensor:
        Hp, Ip = L.padded_hidden, L.padded_intermediate
        p = self.pad
        if p == "cols":
            t = pad_dim(t, 1, Hp)
        elif p == "rows":
            t = pad_dim(t, 0, Hp)
        elif p == "vec":
            t = pad_dim(t, 0, Hp)
        elif p == "gate_up":
            t = pad_dim(pad_dim(t, 1, Hp), 0, Ip)
        elif p == "down":
            t = pad_dim(pad_dim(t, 0, Hp), 1, Ip)
        elif p == "qkv_halves":
            t = pad_chunks(t, 1, 2, Hp)
        elif p == "fc":
            t = pad_dim(pad_chunks(t, 1, 3, L.padded_input_hidden), 0, Hp)
        elif p == "vec_chunks3":
            t = pad_chunks(t, 0, 3, L.padded_input_hidden)
        elif p == "vec_input":
            t = pad_dim(t, 0, L.padded_input_hidden)
        elif p == "expert_gate_up":  # [E, H, 2I]: zero (gate, up) pairs appended after the real ones
            t = pad_dim(pad_dim(t, 1, Hp), 2, 2 * Ip)
        elif p == "expert_gate_up_bias":  # [E, 2I]
            t = pad_dim(t, 1, 2 * Ip)
        elif p == "expert_down":  # [E, I, H]
            t = pad_dim(pad_dim(t, 1, Ip), 2, Hp)
        elif p == "expert_vec":  # [E, H]
            t = pad_dim(t, 1, Hp)
        elif p != "none":
            raise ValueError(p)
        s = self.shard
        if s == "replicate" or L.tp == 1:
            return t
        if s == "column":
            return shard_even(t, 0, rank, L.tp)
        if s == "row":
            return shard_even(t, 1, rank, L.tp)
        if s == "kv":
            return shard_kv(t, rank, L.tp, L.num_kv_heads, L.head_dim)
        if s == "vocab":
            return shard_vocab(t, rank, L.tp)
        if s == "row_bias":
            return t / L.tp
        if s == "expert_gate_up":
            return shard_gate_up_pairs(t, rank, L.tp)
        if s == "expert_row":
            return shard_even(t, 1, rank, L.tp)
        raise ValueError(s)

    def to_dict(self) -> dict:
        return {"pad": self.pad, "shard": self.shard}


# GPT-OSS tensors by their last two name parts -> (pad, shard): sinks go with their q heads; the router
# is replicated; experts are sharded on the intermediate dim (every rank holds every expert's slice)
# and down's bias is row-parallel
GPT_OSS_RULES: dict[str, tuple[str, str]] = {
    "self_attn.sinks": ("none", "column"),
    "router.weight": ("cols", "replicate"),
    "router.bias": ("none", "replicate"),
    "experts.gate_up_proj": ("expert_gate_up", "expert_gate_up"),
    "experts.gate_up_proj_bias": ("expert_gate_up_bias", "expert_gate_up"),
    "experts.down_proj": ("expert_down", "expert_row"),
    "experts.down_proj_bias": ("expert_vec", "row_bias"),
}


def tensor_plan(model: str, name: str) -> TensorPlan:
    """The pad + shard rule of one canonical tensor name (target: Llama / GPT-OSS names without `model.`;
    draft: fc, input_norm, fc_norm.i, midlayer.*, norm, lm_head, d2t, embed_tokens)."""
    leaf = name.split(".")
    last = ".".join(leaf[-2:])
    if last in GPT_OSS_RULES:
        return TensorPlan(name, *GPT_OSS_RULES[last])
    draft_attn_in = model == "draft" and name.startswith("midlayer.self_attn.")
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return TensorPlan(name, "cols", "vocab")
    if name == "d2t":
        return TensorPlan(name, "none", "replicate")
    if name == "fc.weight":
        return TensorPlan(name, "fc", "replicate")
    if name == "input_norm.weight":
        return TensorPlan(name, "vec_chunks3", "replicate")
    if name.startswith("fc_norm."):
        return TensorPlan(name, "vec_input", "replicate")
    if last in ("q_proj.bias", "gate_proj.bias", "up_proj.bias"):
        return TensorPlan(name, "none", "column")
    if last in ("k_proj.bias", "v_proj.bias"):
        return TensorPlan(name, "none", "kv")
    if last in ("o_proj.bias", "down_proj.bias"):  # row-parallel: each rank adds 1/tp before the all-reduce
        return TensorPlan(name, "vec", "row_bias")
    if last in ("q_proj.weight",):
        return TensorPlan(name, "qkv_halves" if draft_attn_in else "cols", "column")
    if last in ("k_proj.weight", "v_proj.weight"):
        return TensorPlan(name, "qkv_halves" if draft_attn_in else "cols", "kv")
    if last == "o_proj.weight":
        return TensorPlan(name, "rows", "row")
    if last in ("gate_proj.weight", "up_proj.weight"):
        return TensorPlan(name, "gate_up", "column")
    if last == "down_proj.weight":
        return TensorPlan(name, "down", "row")
    if name.endswith("norm.weight"):
        return TensorPlan(name, "vec", "replicate")
    raise UserError(f"{model} tensor {name}: no sharding rule; this architecture is not supported")


# ------------------------------------------------------------------ streaming safetensors writer

# the manifest's dtypes (manifest.SAFETENSORS_CODES), plus the byte types a weight file may hold
_ST_DTYPES = {torch_dtype(n): code for n, code in SAFETENSORS_CODES.items()} | {torch.uint8: "U8", torch.int8: "I8"}


class StreamingSafetensorsWriter:
    """Writes a .safetensors file tensor by tensor, with the header computed up front from the plan,
    so memory never holds more than the tensor being written. Byte-identical for identical input."""

    def __init__(self, path: Path, specs: list[tuple[str, list[int], torch.dtype]]):
        self.path, self.specs = path, specs
        header, offset = {}, 0
        for name, shape, dtype in specs:
            n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.f = open(path, "wb")
        self.f.write(struct.pack("<Q", len(raw)) + raw)
        self.next = 0
        self.rows = 0  # dim-0 rows of the current tensor written so far

    def write(self, name: str, t: torch.Tensor) -> None:
        """Write the next tensor whole, or in consecutive dim-0 slabs (one expert at a time)."""
        exp_name, shape, dtype = self.specs[self.next]
        whole = list(t.shape) == list(shape)
        slab = (not whole and t.dim() == len(shape) >= 1 and list(t.shape[1:]) == list(shape[1:])
                and self.rows + t.shape[0] <= shape[0])
        if name != exp_name or t.dtype != dtype or not (whole or slab):
            raise ValueError(f"{self.path}: expected {exp_name} {shape} {dtype} (rows from {self.rows}), "
                             f"got {name} {list(t.shape)} {t.dtype}")
        if t.numel():
            self.f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
        self.rows += t.shape[0] if slab else (shape[0] if shape else 0)
        if not shape or self.rows == shape[0]:
            self.next, self.rows = self.next + 1, 0

    def close(self) -> None:
        self.f.close()
        if self.next != len(self.specs):
            raise ValueError(f"{self.path}: {len(self.specs) - self.next} tensors were never written")


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Floats to the build dtype, integers (d2t) to the integer dtype asked for (int32 on Neuron)."""
    return t.to(dtype) if t.is_floating_point() == dtype.is_floating_point else t


def write_rank_files(model: str, tensors: "TensorSource", names: list[str], shapes: dict[str, tuple[list[int], torch.dtype]],
                     layout: Layout, out_dir: Path, *, file_name: Callable[[int], str] = lambda r: f"rank{r}.safetensors",
                     key: Callable[[str], str] = lambda n: n, sources: dict[str, "TensorSource"] | None = None,
                     extra: Callable[[int], dict[str, torch.Tensor]] | None = None) -> list[Path]:
    """Stream `names` from `tensors` through their plans into one file per rank.

    `shapes` gives each tensor's per-rank shape and dtype (from the rank-local model). Peak memory is
    one source tensor plus its padded copy, independent of the model size; stacked expert tensors
    (GPT-OSS) are read, dequantized and written one expert at a time. The Neuron backend names the
    files and keys as NxD's `nxd_model.initialize` reads them (`file_name`, `key`), takes a tensor
    from another checkpoint (`sources`: the draft's copy of the target embedding) and appends small
    per-rank tensors (`extra`: the rank weight)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sources = sources or {}
    tails = [extra(r) if extra else {} for r in range(layout.tp)]
    specs = [(key(n), shapes[n][0], shapes[n][1]) for n in names]
    paths = [out_dir / file_name(r) for r in range(layout.tp)]
    writers = [StreamingSafetensorsWriter(p, specs + [(k, list(t.shape), t.dtype) for k, t in tail.items()])
               for p, tail in zip(paths, tails)]
    try:
        for n in names:
            plan = tensor_plan(model, n)
            dtype = shapes[n][1]
            src_of = sources.get(n, tensors)
            parts = range(shapes[n][0][0]) if plan.per_expert else [None]
            for e in parts:
                src = cast(src_of.get(n) if e is None else src_of.get_rows(n, e, e + 1), dtype)
                for r, w in enumerate(writers):
                    w.write(key(n), plan.apply(src, r, layout))
                del src
        for w, tail in zip(writers, tails):
            for k, t in tail.items():
                w.write(k, t)
    finally:
        for w in writers:
            w.f.close()
    for w in writers:
        w.close()
    return paths
