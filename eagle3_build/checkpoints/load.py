"""Checkpoints: read and check target / EAGLE3 draft configs and open their tensors.

Targets: Llama-family and GPT-OSS (`gpt_oss`; MXFP4 experts dequantized to BF16 as they are read,
one expert at a time). Sources: a local HF-style directory (config.json + model.safetensors or a
sharded index), a GGUF file (dequantized through transformers + gguf), or `hf://org/model@rev`
(huggingface_hub snapshot, the resolved commit recorded). Drafts come in three on-disk
formats: the official EAGLE release (`midlayer.*`, pytorch_model.bin), speculators
(`layers.0.*`, nested config) and SpecForge (`midlayer.*`, safetensors, aux ids = output-of-layer).
"""
from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import CheckpointError, UserError
from ..models.eagle3 import Eagle3Args
from ..models.gpt_oss import GptOssArgs, gpt_oss_args
from ..models.llama import LlamaArgs, llama_args, rope_params
from .sources import ResolvedSource, TensorSource, _is_int, dict_source, mxfp4_source, read_json, safetensors_source

# ------------------------------------------------------------------ config field types



def _is_id(v) -> bool:
    return _is_int(v) and v >= 0


def _is_id_list(v) -> bool:
    return isinstance(v, list) and all(map(_is_id, v))


MAX_DIM = 1 << 24
# kind -> (what the message says it must be, test)
KINDS = {
    "dim": (f"a positive integer (at most {MAX_DIM})", lambda v: _is_int(v) and 1 <= v <= MAX_DIM),
    "id": ("a non-negative integer", _is_id),
    "ids": ("a non-negative integer or a list of them", lambda v: _is_id(v) or _is_id_list(v)),
    "id_list": ("a list of non-negative integers", _is_id_list),
    "number": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "str_list": ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
}
ROPE_FIELDS = {"rope_type": "str", "type": "str", "rope_theta": "number", "factor": "number",
               "low_freq_factor": "number", "high_freq_factor": "number", "original_max_position_embeddings": "dim",
               "beta_fast": "number", "beta_slow": "number", "attention_factor": "number", "truncate": "bool"}
# every config.json field this build reads -> its kind, or a dict of fields for a nested object;
# null counts as absent (required fields are checked where the model type is known)
CONFIG_FIELDS: dict = {
    "model_type": "str", "speculators_model_type": "str",
    **dict.fromkeys(["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings", "draft_vocab_size",
                     "target_hidden_size", "num_local_experts", "num_experts", "num_experts_per_tok",
                     "experts_per_token", "sliding_window"], "dim"),
    **dict.fromkeys(["rms_norm_eps", "rope_theta", "swiglu_limit", "swiglu_alpha"], "number"),
    **dict.fromkeys(["tie_word_embeddings", "attention_bias", "norm_before_residual", "norm_before_fc", "fc_norm",
                     "norm_output"], "bool"),
    "bos_token_id": "id", "eos_token_id": "ids", "layer_types": "str_list",
    "eagle_aux_hidden_state_layer_ids": "id_list",
    "rope_scaling": ROPE_FIELDS, "rope_parameters": ROPE_FIELDS, "quantization_config": {"quant_method": "str"},
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": "id_list"},
}
CONFIG_FIELDS["transformer_layer_config"] = dict(CONFIG_FIELDS)  # speculators: the layer's own (Llama) config
GENERATION_FIELDS = {"eos_token_id": "ids", "bos_token_id": "id"}
TARGET_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
DRAFT_REQUIRED = ("hidden_size", "intermediate_size", "num_attention_heads")  # of the layer config




def _shown(v) -> str:
    text = json.dumps(v)
    return text if len(text) <= 60 else text[:57] + "..."


def check_fields(obj: dict, fields: dict, where: str, prefix: str = "") -> None:
    """Refuse the first field of `obj` whose value is not of its kind, naming it (`prefix` for nesting)."""
    for name, kind in fields.items():
        v = obj.get(name)
        if v is None:
            continue
        if isinstance(kind, dict):
            if not isinstance(v, dict):
                raise CheckpointError(f"{where}: {prefix}{name} must be a JSON object, got {_shown(v)}")
            check_fields(v, kind, where, f"{prefix}{name}.")
            continue
        what, ok = KINDS[kind]
        if not ok(v):
            raise CheckpointError(f"{where}: {prefix}{name} must be {what}, got {_shown(v)}")


def require_fields(obj: dict, names: tuple[str, ...], where: str, prefix: str = "") -> None:
    missing = [n for n in names if obj.get(n) is None]
    if missing:
        raise CheckpointError(f"{where}: config.json lacks {prefix}{missing[0]!r}; the checkpoint is incomplete")


# ------------------------------------------------------------------ target

@dataclass
class TargetCheckpoint:
    source: ResolvedSource
    config: dict
    args: LlamaArgs | GptOssArgs
    tensors: TensorSource  # canonical names (no `model.` prefix); MXFP4 experts appear dequantized
    eos_token_ids: list[int]
    bos_token_id: int | None
    meta_models: dict = field(default_factory=dict, repr=False, compare=False)  # layout -> model (pair.build_target)


LLAMA_TYPES = {"llama"}
TARGET_ARGS = {"llama": llama_args, "gpt_oss": gpt_oss_args}  # model_type -> config parser


def eos_token_ids(config: dict, generation_config: dict | None = None) -> list[int]:
    """The eos rule: generation_config's eos_token_id when it sets one, else config.json's; either
    may be one id or a list."""
    eos = (generation_config or {}).get("eos_token_id")
    if eos is None:
        eos = config.get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def _eos_ids(directory: Path, cfg: dict) -> list[int]:
    gen = directory / "generation_config.json"
    gen_cfg = None
    if gen.exists():
        gen_cfg = read_json(gen, "target")
        check_fields(gen_cfg, GENERATION_FIELDS, f"target {gen}")
    return eos_token_ids(cfg, gen_cfg)


def load_target(src: ResolvedSource) -> TargetCheckpoint:
    if src.gguf_file:
        return _load_gguf_target(src)
    cfg = read_config(src.directory, "target")
    mtype = cfg.get("model_type")
    if mtype not in TARGET_ARGS:
        raise CheckpointError(f"target {src.spec.uri}: model_type {mtype!r} is not supported by this build "
                              f"(supported: {', '.join(sorted(TARGET_ARGS))})")
    require_fields(cfg, TARGET_REQUIRED, f"target {src.spec.uri}")
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
        raise CheckpointError(f"target {path}: transformers cannot load this GGUF file: {e}") from e
    cfg = hf_cfg.to_dict()
    if cfg.get("model_type") not in LLAMA_TYPES:
        raise CheckpointError(f"target {path}: GGUF architecture {cfg.get('model_type')!r} is not supported")
    sd = {k[len("model."):] if k.startswith("model.") else k: v.detach()
          for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    gen = getattr(model, "generation_config", None)
    eos_ids = eos_token_ids(cfg, {"eos_token_id": getattr(gen, "eos_token_id", None)})
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
    meta_models: dict = field(default_factory=dict, repr=False, compare=False)  # layout -> model (pair.build_draft)

    def stored_dtype(self) -> torch.dtype | None:
        """The dtype the checkpoint stores the draft's lm_head in (one row read); None where unreadable
        (`plan` has no tensors)."""
        if "lm_head.weight" not in self.tensors:
            return None
        try:
            return self.tensors.get_rows("lm_head.weight", 0, 1).dtype
        except UserError:  # (CheckpointError too)
            return None


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
    try:  # mmap needs the zip format; the legacy (pre-1.6) format is read whole
        sd = torch.load(bin_path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(bin_path))
    except Exception as e:
        raise CheckpointError(f"draft {bin_path}: torch.load(weights_only=True) refused it: {e}") from e
    if not (isinstance(sd, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items())):
        raise CheckpointError(f"draft {bin_path}: does not hold a state dict (tensor name -> tensor); "
                              "re-download the draft")
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
    require_fields(layer_cfg, DRAFT_REQUIRED, f"draft {src.spec.uri}",
                   "transformer_layer_config." if fmt == "speculators" else "")
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
    return DraftCheckpoint(src, cfg, fmt, args, tensors, has_embed="embed_tokens.weight" in tensors, notes=notes)



def read_config(directory: Path, role: str) -> dict:
    path = directory / "config.json"
    if not path.exists():
        raise CheckpointError(f"{role} {directory}: no config.json; a checkpoint directory needs config.json "
                              "and its weights (model.safetensors or a sharded index)")
    cfg = read_json(path, role)
    check_fields(cfg, CONFIG_FIELDS, f"{role} {path}")
    return cfg
