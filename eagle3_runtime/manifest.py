"""manifest.json: the only contract between the builder and the runtime.

The builder imports these models to write a manifest; the runtime reads it back and trusts nothing
else about a bundle. Bump SCHEMA_VERSION on any incompatible change.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .errors import Eagle3Error

SCHEMA_VERSION = 2  # 2: graph keys, bundle digest, build record
MANIFEST = "manifest.json"

# Graph roles: both prefill roles per prefill bucket, every batch role per batch bucket.
PREFILL_ROLES = ("target_prefill", "draft_prefill")
BATCH_ROLES = ("target_verify", "target_decode", "draft_catchup", "draft_step")
ROLE_MODEL = {"target_prefill": "target", "target_verify": "target", "target_decode": "target",
              "draft_prefill": "draft", "draft_catchup": "draft", "draft_step": "draft"}
BACKENDS = ("export", "aoti", "neuron")
NATIVE_CODE_BACKENDS = ("aoti", "neuron")  # their graph files are machine code: trust them only by a pin
DTYPE_NAMES = ("float32", "bfloat16", "float16", "int64", "int32", "bool")  # torch names without "torch."
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "bool": 1}

MAX_DIM = 1 << 40  # no real tensor dimension comes near this; a manifest that says so is refused
Dim = Annotated[int, Field(ge=0, le=MAX_DIM)]
Count = Annotated[int, Field(ge=1, le=1 << 24)]
DIGEST_RE = re.compile(r"[0-9a-f]{64}")


def bundle_relpath(path: str) -> str:
    """The one rule for paths in a manifest: relative, POSIX, normalised, inside the bundle."""
    p = PurePosixPath(path)
    if (not path or "\\" in path or "\0" in path or p.is_absolute() or path != p.as_posix()
            or any(part in ("", ".", "..") for part in path.split("/"))):
        raise ValueError(f"path {path!r} is not a plain relative path inside the bundle")
    return path


class BundleError(Eagle3Error):
    """The bundle cannot be served; the message names the file and the fix."""


class SchemaError(BundleError):
    """A manifest schema version this runtime cannot read."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TensorSpec(_Strict):
    name: str
    shape: list[Dim] = Field(max_length=16)
    dtype: Literal[DTYPE_NAMES]  # type: ignore[valid-type]
    pad: str | None = None  # weights: how the tensor was padded (see eagle3_build.sharding)
    shard: str | None = None  # weights: replicate | column | row | kv | vocab

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


class FileEntry(_Strict):
    path: str  # relative to the bundle root, POSIX separators
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    size: Annotated[int, Field(ge=0)]

    @field_validator("path")
    @classmethod
    def _inside(cls, v: str) -> str:
        return bundle_relpath(v)


class GraphEntry(_Strict):
    name: str
    role: Literal[tuple(ROLE_MODEL)]  # type: ignore[valid-type]
    model: Literal["target", "draft"]
    bucket: Count
    file: FileEntry
    weights: list[str]  # qualified "<model>/<tensor>" names, in call order
    state: str  # name of the KV cache tensor the graph mutates
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    backend: dict[str, Any] = {}
    key: str = ""  # compile-cache key (eagle3_build.cache.graph_key)

    def input(self, name: str) -> TensorSpec:
        for spec in self.inputs:
            if spec.name == name:
                return spec
        raise KeyError(f"graph {self.name} has no input {name!r}")


class ModelEntry(_Strict):
    name: Literal["target", "draft"]
    architecture: str
    config: dict[str, Any]  # the canonical args the graphs were traced with
    layout: dict[str, Any]  # tp degree, padded hidden and the per-rank sizes
    weight_files: list[FileEntry]  # one per rank
    tensors: dict[str, TensorSpec]  # what each rank file holds (rank 0 shapes)


class Manifest(_Strict):
    schema_version: int
    name: str
    created_at: str
    backend: str
    dtype: str
    tp_degree: Count
    num_speculative_tokens: Annotated[int, Field(ge=0, le=64)]
    max_num_seqs: Count
    max_model_len: Count
    prefill_buckets: list[Count] = Field(min_length=1, max_length=64)
    batch_buckets: list[Count] = Field(min_length=1, max_length=64)
    aux_layer_ids: list[int]
    vocab_size: Count
    eos_token_ids: list[int]
    bos_token_id: int | None
    draft_format: str
    recipe: dict[str, Any]
    sources: dict[str, Any]
    toolchain: dict[str, str]
    models: dict[str, ModelEntry]
    state: list[TensorSpec]  # KV caches the runtime allocates (zeros)
    graphs: list[GraphEntry]
    files: list[FileEntry]  # tokenizer, configs, everything else
    notes: list[str] = []
    build: dict[str, Any] = {}  # timings, cache hits, host: excluded from the digest
    digest: str = ""  # sha256 over everything above except created_at and build

    @model_validator(mode="after")
    def _consistent(self) -> "Manifest":
        """What the runtime relies on, checked as data before anything is allocated or loaded."""
        K = self.num_speculative_tokens
        if self.max_model_len <= K + 1:
            raise ValueError(f"max_model_len {self.max_model_len} must exceed num_speculative_tokens + 1 ({K + 1})")
        for key in ("prefill_buckets", "batch_buckets"):
            b = getattr(self, key)
            if b != sorted(set(b)):
                raise ValueError(f"{key} {b} must be strictly increasing")
        if any(not 0 <= t < self.vocab_size for t in self.eos_token_ids):
            raise ValueError(f"eos_token_ids {self.eos_token_ids} must lie in [0, vocab_size {self.vocab_size})")
        if set(self.models) != {"target", "draft"}:
            raise ValueError(f"models must be exactly target and draft, got {sorted(self.models)}")
        for name, m in self.models.items():
            if m.name != name or len(m.weight_files) != self.tp_degree:
                raise ValueError(f"models.{name}: needs name {name!r} and one weight file per rank "
                                 f"({self.tp_degree}), has {len(m.weight_files)}")
        states = {s.name for s in self.state}
        have = [(g.role, g.bucket) for g in self.graphs]
        if len(set(have)) != len(have):
            raise ValueError("graphs: more than one graph for the same role and bucket")
        need = [(r, s) for s in self.prefill_buckets for r in PREFILL_ROLES]
        need += [(r, b) for b in self.batch_buckets for r in BATCH_ROLES]
        missing = [f"{r}/{b}" for r, b in need if (r, b) not in set(have)]
        if missing:
            raise ValueError(f"graphs: missing {', '.join(missing[:4])} (every bucket needs every role)")
        for g in self.graphs:
            if g.model != ROLE_MODEL[g.role] or g.state not in states:
                raise ValueError(f"graph {g.name}: model {g.model!r} / state {g.state!r} do not match its role")
            if not g.inputs or g.inputs[0].name != "rank":
                raise ValueError(f"graph {g.name}: the first input must be the rank")
            for w in g.weights:
                model, _, tensor = w.partition("/")
                if model not in self.models or tensor not in self.models[model].tensors:
                    raise ValueError(f"graph {g.name}: weight {w!r} is not in any model's tensors")
        if self.digest and not DIGEST_RE.fullmatch(self.digest):
            raise ValueError("digest must be 64 lowercase hex digits (sha256)")
        return self

    def state_bytes(self) -> int:
        return sum(s.nbytes for s in self.state)

    def compute_digest(self) -> str:
        """Same artifact <=> same digest: covers every file's sha256, the graph keys, shapes, recipe,
        sources and toolchain, but not when or how fast it was built."""
        body = self.model_dump(mode="json", exclude={"created_at", "build", "digest"})
        return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def graph(self, role: str, bucket: int) -> GraphEntry:
        for g in self.graphs:
            if g.role == role and g.bucket == bucket:
                return g
        raise KeyError(f"bundle has no {role} graph for bucket {bucket}")

    def all_files(self) -> list[FileEntry]:
        """Every file once (a neuron bundle's graphs of one model share that model's file)."""
        out = [g.file for g in self.graphs] + list(self.files)
        for m in self.models.values():
            out += m.weight_files
        return list({f.path: f for f in out}.values())


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_entry(root: Path, path: Path) -> FileEntry:
    return FileEntry(path=path.relative_to(root).as_posix(), sha256=sha256_file(path), size=path.stat().st_size)
