"""manifest.json: the only contract between the builder and the runtime.

The builder imports these models to write a manifest; the runtime reads it back and trusts nothing
else about a bundle. Bump SCHEMA_VERSION on any incompatible change.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

SCHEMA_VERSION = 2  # 2: graph keys, bundle digest, build record
MANIFEST = "manifest.json"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TensorSpec(_Strict):
    name: str
    shape: list[int]
    dtype: str  # torch dtype name without the "torch." prefix
    pad: str | None = None  # weights: how the tensor was padded (see eagle3_build.sharding)
    shard: str | None = None  # weights: replicate | column | row | kv | vocab


class FileEntry(_Strict):
    path: str  # relative to the bundle root, POSIX separators
    sha256: str
    size: int


class GraphEntry(_Strict):
    name: str
    role: str
    model: Literal["target", "draft"]
    bucket: int
    file: FileEntry
    weights: list[str]  # qualified "<model>/<tensor>" names, in call order
    state: str  # name of the KV cache tensor the graph mutates
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    backend: dict[str, Any] = {}
    key: str = ""  # compile-cache key (eagle3_build.cache.graph_key)


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
    tp_degree: int
    num_speculative_tokens: int
    max_num_seqs: int
    max_model_len: int
    prefill_buckets: list[int]
    batch_buckets: list[int]
    aux_layer_ids: list[int]
    vocab_size: int
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
        out = [g.file for g in self.graphs] + list(self.files)
        for m in self.models.values():
            out += m.weight_files
        return out


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_entry(root: Path, path: Path) -> FileEntry:
    return FileEntry(path=path.relative_to(root).as_posix(), sha256=sha256_file(path), size=path.stat().st_size)
