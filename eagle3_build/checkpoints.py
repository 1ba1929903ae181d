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
import math
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open

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
    files = _index_files(index) if index.exists() else sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        return None
    get, shapes, rows = {}, {}, {}
    for fname in files:
        path = directory / fname
        if not path.exists():
            raise CheckpointError(f"{directory}: index names {fname}, which is missing; re-download the checkpoint")
        for name, shape in safetensors_header(path).items():
            shapes[name] = shape
            get[name] = (lambda p=path, n=name: _read_safetensor(p, n))
            if shape:
                rows[name] = (lambda lo, hi, p=path, n=name: _read_safetensor(p, n, (lo, hi)))
    return TensorSource(get, shapes, str(directory), rows)


def _index_files(index: Path) -> list[str]:
    """Shard file names of a sharded checkpoint (plain names in the index's own directory)."""
    weight_map = read_json(index, "checkpoint").get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: weight_map must be a JSON object mapping tensor names to shard files; "
                              "re-download the checkpoint")
    files = sorted(set(weight_map.values()))
    bad = [f for f in files if Path(f).name != f or not f.endswith(".safetensors")]
    if bad:
        raise CheckpointError(f"{index}: weight_map names {bad[0]!r}, which is not a .safetensors file in this "
                              "directory; re-download the checkpoint")
    return files


def _read_safetensor(path: Path, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """One tensor (or a dim-0 row range of it); the header was validated when the source was listed."""
    try:
        with safe_open(path, "pt") as f:
            return f.get_tensor(name) if rows is None else f.get_slice(name)[rows[0]:rows[1]]
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"cannot read tensor {name} from {path} ({e}); the file changed or is corrupt, "
                              "re-download it") from e


# ------------------------------------------------------------------ safetensors headers

MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
# safetensors dtype -> bytes per element (every dtype torch reads whole bytes of)
ST_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
             "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}


def safetensors_header(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, from a header read and checked here before anything maps the file: a
    truncated or corrupt file is one CheckpointError naming it (never a safe_open/mmap crash)."""
    def corrupt(problem: str) -> CheckpointError:
        return CheckpointError(f"truncated or corrupt safetensors file {path}: {problem}; re-download it")

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise corrupt(f"only {size} bytes, too short for a header")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise corrupt(f"header length {n} runs past the end of the file ({size} bytes)")
        if n > MAX_HEADER_BYTES:
            raise corrupt(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise corrupt(f"header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise corrupt("header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise corrupt("__metadata__ must map strings to strings")
    data_len = size - 8 - n
    spans = sorted((*_tensor_span(path, name, info, data_len, corrupt), name) for name, info in header.items())
    pos = 0  # tensors must tile the data exactly, as safetensors requires
    for begin, end, name in spans:
        if begin != pos:
            raise corrupt(f"tensor {name} starts at data byte {begin}, expected {pos} (tensors overlap or leave a gap)")
        pos = end
    if pos != data_len:
        raise corrupt(f"tensor data ends at byte {pos} but the file holds {data_len} bytes of data")
    return {name: list(header[name]["shape"]) for name in sorted(header)}  # safe_open's order


def _tensor_span(path: Path, name: str, info, data_len: int, corrupt) -> tuple[int, int]:
    """(begin, end) of one header entry's bytes, after checking dtype, shape and offsets."""
    if not isinstance(info, dict):
        raise corrupt(f"entry {name} is not a JSON object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in ST_DTYPES:
        raise CheckpointError(f"safetensors file {path}: tensor {name} has dtype {dtype!r}, which this build "
                              f"does not read (known: {', '.join(ST_DTYPES)})")
    if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)):
        raise corrupt(f"tensor {name}: shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise corrupt(f"tensor {name}: data_offsets {offsets!r} must be [begin, end] with 0 <= begin <= end")
    begin, end = offsets
    if end > data_len:
        raise corrupt(f"tensor {name}: data_offsets [{begin}, {end}] run past the end of the data ({data_len} bytes)")
    nbytes = math.prod(shape) * ST_DTYPES[dtype]
    if end - begin != nbytes:
        raise corrupt(f"tensor {name}: shape {shape} of {dtype} needs {nbytes} bytes, data_offsets give {end - begin}")
    return begin, end


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
            f"--revision {spec.revision}) or point the recipe at a local directory") from e
    except (HfHubHTTPError, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{role} {spec.uri}: cannot fetch from the Hugging Face hub: {first}") from e
    return ResolvedSource(spec, local, gguf_file=spec.gguf_file, revision=local.name)


MAX_JSON_BYTES = 64 << 20  # config / generation_config / index files are kilobytes


def read_json(path: Path, role: str) -> dict:
    """A JSON object from `path`; anything else is one CheckpointError naming the file."""
    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise CheckpointError(f"{role} {path}: {size} bytes, over the {MAX_JSON_BYTES}-byte cap for a "
                                  "checkpoint JSON file; the file is corrupt, re-download it")
        data = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{role} {path}: invalid JSON ({e}); re-download it") from e
    except OSError as e:
        raise CheckpointError(f"{role} {path}: cannot read it ({e.strerror or e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{role} {path}: must be a JSON object, got {_json_kind(data)}")
    return data


def read_config(directory: Path, role: str) -> dict:
    path = directory / "config.json"
    if not path.exists():
        raise CheckpointError(f"{role} {directory}: no config.json; a checkpoint directory needs config.json "
                              "and its weights (model.safetensors or a sharded index)")
    cfg = read_json(path, role)
    check_fields(cfg, CONFIG_FIELDS, f"{role} {path}")
    return cfg


# ------------------------------------------------------------------ config field types

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


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


def _json_kind(v) -> str:
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return kinds.get(type(v), "a number")


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


LLAMA_TYPES = {"llama"}
TARGET_ARGS = {"llama": llama_args, "gpt_oss": gpt_oss_args}  # model_type -> config parser


def _eos_ids(directory: Path, cfg: dict) -> list[int]:
    gen = directory / "generation_config.json"
    eos = None
    if gen.exists():
        gen_cfg = read_json(gen, "target")
        check_fields(gen_cfg, GENERATION_FIELDS, f"target {gen}")
        eos = gen_cfg.get("eos_token_id")
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
