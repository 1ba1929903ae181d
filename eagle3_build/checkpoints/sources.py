"""Tensor sources: a recipe source resolved to local files (HF directory, GGUF, hf://), tensors read
lazily by name from safetensors / MXFP4 / in-memory dicts, and size-capped JSON reads."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open

from eagle3_runtime.manifest import DTYPE_BYTES, SAFETENSORS_CODES

from ..errors import CheckpointError
from ..recipe import SourceSpec

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
# safetensors dtype -> bytes per element (every dtype torch reads whole bytes of): the manifest's
# dtypes, plus those a foreign checkpoint may hold
ST_DTYPES = {code: DTYPE_BYTES[name] for name, code in SAFETENSORS_CODES.items()} | {
    "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "U32": 4, "U64": 8, "F64": 8,
    "C64": 8}


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



def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _json_kind(v) -> str:
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return kinds.get(type(v), "a number")
