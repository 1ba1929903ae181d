"""Checkpoints: resolve a recipe source to local files and read target / EAGLE3 draft checkpoints.

Targets: Llama-family and GPT-OSS (`gpt_oss`; MXFP4 experts dequantized to BF16 as they are read,
one expert at a time). Sources: a local HF-style directory (config.json + model.safetensors or a
sharded index), a GGUF file (dequantized through transformers + gguf), or `hf://org/model@rev`
(huggingface_hub snapshot, the resolved commit recorded). Drafts come in three formats
(REFERENCE §2): the official EAGLE release (`midlayer.*`, pytorch_model.bin), speculators
(`layers.0.*`, nested config) and SpecForge (`midlayer.*`, safetensors, aux ids = output-of-layer).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from .errors import CheckpointError
from .models.eagle3 import Eagle3Args
from .models.gpt_oss import GptOssArgs, gpt_oss_args
from .models.llama import LlamaArgs, llama_args, rope_params
from .recipe import SourceSpec


# ------------------------------------------------------------------ tensor sources

Rows = Callable[[int, int], torch.Tensor]


class TensorSource:
    """Lazy name -> tensor access; `get` reads one tensor (memory stays bounded by that tensor) and
    `get_rows` a dim-0 range of it (one expert of a stacked expert tensor)."""

    def __init__(self, names: dict[str, Callable[[], torch.Tensor]], shapes: dict[str, list[int]], origin: str,
                 rows: dict[str, Rows] | None = None):
        self._get, self.shapes, self.origin = names, shapes, origin
        self._rows = rows or {}

    def names(self) -> list[str]:
        return list(self._get)

    def __contains__(self, name: str) -> bool:
        return name in self._get

    def get(self, name: str) -> torch.Tensor:
        return self._get[name]()

    def get_rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows lo:hi of dim 0, reading only their bytes where the format allows it (safetensors)."""
        rows = self._rows.get(name)
        return rows(lo, hi) if rows is not None else self.get(name)[lo:hi]

    def renamed(self, fn: Callable[[str], str | None]) -> "TensorSource":
        get, shapes, rows = {}, {}, {}
        for n, g in self._get.items():
            new = fn(n)
            if new is not None:
                get[new], shapes[new] = g, self.shapes[n]
                if n in self._rows:
                    rows[new] = self._rows[n]
        return TensorSource(get, shapes, self.origin, rows)


def safetensors_source(directory: Path) -> TensorSource | None:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        return None
    get, shapes, rows = {}, {}, {}
    for fname in files:
        path = directory / fname
        if not path.exists():
            raise CheckpointError(f"{directory}: index names {fname}, which is missing; re-download the checkpoint")
        with safe_open(path, "pt") as f:
            for name in f.keys():
                shapes[name] = list(f.get_slice(name).get_shape())
                get[name] = (lambda p=path, n=name: _read_safetensor(p, n))
                if shapes[name]:
                    rows[name] = (lambda lo, hi, p=path, n=name: _read_safetensor_rows(p, n, lo, hi))
    return TensorSource(get, shapes, str(directory), rows)


def _read_safetensor(path: Path, name: str) -> torch.Tensor:
    with safe_open(path, "pt") as f:
        return f.get_tensor(name)


def _read_safetensor_rows(path: Path, name: str, lo: int, hi: int) -> torch.Tensor:
    with safe_open(path, "pt") as f:
        return f.get_slice(name)[lo:hi]


# ------------------------------------------------------------------ MXFP4 (GPT-OSS experts)

def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks [E, R, G, 16] uint8 (32 fp4 values per group, low nibble first), scales [E, R, G] uint8
    (exponent + 127) -> [E, G*32, R] (the [in, out] layout of GptOssExperts), through transformers'
    own `convert_moe_packed_tensors`. Elementwise per expert, so experts can be converted one at a time."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=dtype)


def mxfp4_source(src: TensorSource, uri: str) -> TensorSource:
    """Expose every `<name>_blocks` / `<name>_scales` pair as the BF16 tensor `<name>`, dequantized lazily,
    one expert at a time when read through `get_rows` (the sharder streams experts that way)."""
    names = set(src.names())
    pairs = {n.removesuffix("_blocks") for n in names if n.endswith("_blocks")}
    lone = sorted(n for n in names if n.endswith("_scales") and n.removesuffix("_scales") not in pairs)
    lone += sorted(f"{p}_blocks" for p in pairs if f"{p}_scales" not in names)
    if lone:
        raise CheckpointError(f"target {uri}: MXFP4 tensors without their pair: {lone[:3]}; every *_blocks "
                              "needs its *_scales (and vice versa) — the checkpoint is incomplete")
    get, shapes, rows = {}, {}, {}
    for n in src.names():
        base = n.removesuffix("_blocks").removesuffix("_scales")
        if base not in pairs:
            get[n], shapes[n] = (lambda n=n: src.get(n)), src.shapes[n]
            rows[n] = (lambda lo, hi, n=n: src.get_rows(n, lo, hi))
            continue
        if not n.endswith("_blocks"):
            continue
        b, s = src.shapes[n], src.shapes[f"{base}_scales"]
        if len(b) != 4 or b[3] != 16 or b[:3] != s:
            raise CheckpointError(f"target {uri}: {n} {b} / {base}_scales {s} is not an MXFP4 pair "
                                  "(blocks [E, R, G, 16], scales [E, R, G])")

        def part(lo, hi, base=base):
            return mxfp4_dequantize(src.get_rows(f"{base}_blocks", lo, hi), src.get_rows(f"{base}_scales", lo, hi))

        get[base], shapes[base], rows[base] = (lambda part=part, e=b[0]: part(0, e)), [b[0], b[2] * 32, b[1]], part
    return TensorSource(get, shapes, src.origin, rows)


def dict_source(tensors: dict[str, torch.Tensor], origin: str) -> TensorSource:
    return TensorSource({n: (lambda t=t: t) for n, t in tensors.items()},
                        {n: list(t.shape) for n, t in tensors.items()}, origin)


# ------------------------------------------------------------------ sources

@dataclass
class ResolvedSource:
    spec: SourceSpec
    directory: Path
    gguf_file: str | None = None
    revision: str | None = None  # resolved commit for hf:// sources

    def record(self) -> dict:
        return {"uri": self.spec.uri, "kind": self.spec.kind, "revision": self.spec.revision,
                "resolved_revision": self.revision, "gguf_file": self.gguf_file}


HF_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.jinja", "tokenizer*", "*.txt"]


def resolve(spec: SourceSpec, role: str) -> ResolvedSource:
    if spec.kind == "local":
        return ResolvedSource(spec, Path(spec.path))
    if spec.kind == "gguf":
        p = Path(spec.path)
        return ResolvedSource(spec, p.parent, gguf_file=p.name)
    # hf://org/name@rev through huggingface_hub (its cache, its offline mode, its auth)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = [spec.gguf_file] + ["*.json", "tokenizer*", "*.jinja"] if spec.gguf_file else list(HF_PATTERNS)
    if spec.allow_pickle:
        patterns.append("*.bin")
    try:
        local = Path(snapshot_download(spec.repo_id, revision=spec.revision, allow_patterns=patterns))
    except LocalEntryNotFoundError as e:
        raise CheckpointError(
            f"{role} {spec.uri}: not in the local Hugging Face cache and the hub cannot be reached "
            f"({type(e).__name__}); download it once (hf download {spec.repo_id} "
            f"--revision {spec.revision}) or point the recipe at a local directory") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{role} {spec.uri}: cannot fetch from the Hugging Face hub: {first}") from None
    return ResolvedSource(spec, local, gguf_file=spec.gguf_file, revision=local.name)


def read_config(directory: Path, role: str) -> dict:
    path = directory / "config.json"
    if not path.exists():
        raise CheckpointError(f"{role} {directory}: no config.json; a checkpoint directory needs config.json "
                              "and its weights (model.safetensors or a sharded index)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{role} {path}: invalid JSON ({e})") from None


# ------------------------------------------------------------------ target

@dataclass
class TargetCheckpoint:
    source: ResolvedSource
    config: dict
    args: LlamaArgs | GptOssArgs
    tensors: TensorSource  # canonical names (no `model.` prefix); MXFP4 experts appear dequantized
    eos_token_ids: list[int]
    bos_token_id: int | None


LLAMA_TYPES = {"llama"}
TARGET_ARGS = {"llama": llama_args, "gpt_oss": gpt_oss_args}  # model_type -> config parser


def _eos_ids(directory: Path, cfg: dict) -> list[int]:
    gen = directory / "generation_config.json"
    eos = None
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        eos = cfg.get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def load_target(src: ResolvedSource) -> TargetCheckpoint:
    if src.gguf_file:
        return _load_gguf_target(src)
    cfg = read_config(src.directory, "target")
    mtype = cfg.get("model_type")
    if mtype not in TARGET_ARGS:
        raise CheckpointError(f"target {src.spec.uri}: model_type {mtype!r} is not supported by this build "
                              f"(supported: {', '.join(sorted(TARGET_ARGS))})")
    args = TARGET_ARGS[mtype](cfg, "target")
    quant = (cfg.get("quantization_config") or {}).get("quant_method")
    if quant is not None and (mtype, quant) != ("gpt_oss", "mxfp4"):
        raise CheckpointError(f"target {src.spec.uri}: quantization {quant!r} is not supported (only GPT-OSS "
                              "MXFP4 experts, dequantized at build time); use an unquantized checkpoint")
    tensors = safetensors_source(src.directory)
    if tensors is None:
        raise CheckpointError(f"target {src.spec.uri}: no *.safetensors in {src.directory}; convert the "
                              "checkpoint to safetensors (pickled .bin targets are not loaded)")
    tensors = tensors.renamed(lambda n: n[len("model."):] if n.startswith("model.") else n)
    if mtype == "gpt_oss":
        tensors = mxfp4_source(tensors, src.spec.uri)
    return TargetCheckpoint(src, cfg, args, tensors, _eos_ids(src.directory, cfg), cfg.get("bos_token_id"))


def _load_gguf_target(src: ResolvedSource) -> TargetCheckpoint:
    from transformers import AutoConfig, AutoModelForCausalLM

    path = src.directory / src.gguf_file
    if not path.exists():
        raise CheckpointError(f"target {src.spec.uri}: GGUF file {path} does not exist")
    try:
        hf_cfg = AutoConfig.from_pretrained(src.directory, gguf_file=src.gguf_file)
        model = AutoModelForCausalLM.from_pretrained(src.directory, gguf_file=src.gguf_file,
                                                     dtype=torch.float32)
    except Exception as e:  # transformers/gguf raise many types for unsupported files
        raise CheckpointError(f"target {path}: transformers cannot load this GGUF file: {e}") from None
    cfg = hf_cfg.to_dict()
    if cfg.get("model_type") not in LLAMA_TYPES:
        raise CheckpointError(f"target {path}: GGUF architecture {cfg.get('model_type')!r} is not supported")
    sd = {k[len("model."):] if k.startswith("model.") else k: v.detach()
          for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) or cfg.get("eos_token_id")
    eos_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    return TargetCheckpoint(src, cfg, llama_args(cfg, "target"), dict_source(sd, str(path)), eos_ids,
                            cfg.get("bos_token_id"))


# ------------------------------------------------------------------ draft

@dataclass
class DraftCheckpoint:
    source: ResolvedSource
    config: dict
    format: str  # eagle | speculators | specforge
    args: Eagle3Args
    tensors: TensorSource  # canonical names
    has_embed: bool
    notes: list[str] = field(default_factory=list)


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    return (2, num_layers // 2, num_layers - 3)


def _draft_tensors(src: ResolvedSource) -> TensorSource:
    st = safetensors_source(src.directory)
    if st is not None:
        return st
    bin_path = src.directory / "pytorch_model.bin"
    if not bin_path.exists():
        raise CheckpointError(f"draft {src.spec.uri}: no model.safetensors or pytorch_model.bin in {src.directory}")
    if not src.spec.allow_pickle:
        raise CheckpointError(
            f"draft {src.spec.uri}: only pytorch_model.bin (a pickle) is present; pickles are not loaded by "
            "default. Set `allow_pickle: true` on this draft in the recipe to load it with "
            "torch.load(weights_only=True), or convert it to model.safetensors")
    try:
        sd = torch.load(bin_path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise CheckpointError(f"draft {bin_path}: torch.load(weights_only=True) refused it: {e}") from None
    return dict_source(sd, str(bin_path))


def _canonical_draft_name(name: str) -> str:
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0."):]
    return name


def load_draft(src: ResolvedSource, target: TargetCheckpoint) -> DraftCheckpoint:
    if src.gguf_file:
        raise CheckpointError(f"draft {src.spec.uri}: GGUF drafts are not supported; use an EAGLE3 checkpoint "
                              "directory (official, speculators or SpecForge format)")
    cfg = read_config(src.directory, "draft")
    return draft_checkpoint(src, cfg, _draft_tensors(src), target)


def draft_checkpoint(src: ResolvedSource, cfg: dict, raw: TensorSource, target: TargetCheckpoint) -> DraftCheckpoint:
    """A draft from its config and its (raw-named) tensors; `plan` passes an empty TensorSource."""
    tensors = raw.renamed(_canonical_draft_name)
    n_target = target.args.num_layers
    notes = []
    if cfg.get("speculators_model_type") is not None:
        if cfg["speculators_model_type"] != "eagle3":
            raise CheckpointError(f"draft {src.spec.uri}: speculators_model_type "
                                  f"{cfg['speculators_model_type']!r} is not eagle3")
        fmt = "speculators"
        layer_cfg = cfg.get("transformer_layer_config") or {}
        aux = cfg.get("eagle_aux_hidden_state_layer_ids")  # input-of-layer semantics (vLLM)
        aux = tuple(aux) if aux else default_aux_layer_ids(n_target)
        nbr = cfg.get("norm_before_residual")
        if nbr is None:
            nbr = True
            notes.append("norm_before_residual missing: True (vLLM rule for speculators drafts)")
    else:
        layer_cfg = cfg
        eagle_cfg = cfg.get("eagle_config") or {}
        sg_ids = eagle_cfg.get("eagle_aux_hidden_state_layer_ids")
        is_bin = raw.origin.endswith(".bin")
        fmt = "eagle" if is_bin else "specforge"
        if sg_ids:
            # SGLang/SpecForge: id k = OUTPUT of layer k = input of layer k+1
            aux = tuple(int(i) + 1 for i in sg_ids)
            notes.append(f"eagle_config aux ids {list(sg_ids)} (output-of-layer) -> input-of-layer {list(aux)}")
        else:
            aux = default_aux_layer_ids(n_target)
        nbr = bool(cfg.get("norm_before_residual", False))
    try:
        heads = layer_cfg["num_attention_heads"]
        hidden = layer_cfg["hidden_size"]
        vocab = layer_cfg.get("vocab_size") or cfg.get("vocab_size") or target.args.vocab_size
        dvocab = cfg.get("draft_vocab_size") or layer_cfg.get("draft_vocab_size") or vocab
        args = Eagle3Args(
            hidden_size=hidden, intermediate_size=layer_cfg["intermediate_size"], num_heads=heads,
            num_kv_heads=layer_cfg.get("num_key_value_heads") or heads,
            head_dim=layer_cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=layer_cfg.get("rms_norm_eps", 1e-6), vocab_size=vocab, draft_vocab_size=dvocab,
            target_hidden_size=cfg.get("target_hidden_size") or layer_cfg.get("target_hidden_size") or hidden,
            aux_layer_ids=tuple(int(i) for i in aux), norm_before_residual=bool(nbr),
            norm_before_fc=bool(cfg.get("norm_before_fc", False)) or "input_norm.weight" in tensors,
            fc_norm=bool(cfg.get("fc_norm", False)) or "fc_norm.0.weight" in tensors,
            norm_output=bool(cfg.get("norm_output", False)), has_d2t="d2t" in tensors,
            rope=rope_params(layer_cfg), max_position_embeddings=layer_cfg.get("max_position_embeddings", 8192))
    except KeyError as e:
        raise CheckpointError(f"draft {src.spec.uri}: config.json lacks {e.args[0]!r}") from None
    return DraftCheckpoint(src, cfg, fmt, args, tensors, has_embed="embed_tokens.weight" in tensors, notes=notes)
