"""manifest.json: the only contract between the builder and the runtime.

The builder imports these models to write a manifest; the runtime reads it back and trusts nothing else
about a bundle. This module holds the schema, the dtype names and the checks that make a manifest
consistent with itself: with the graph contract (graph_contract.py), the speculation shapes
(speculation.py) and its backend's facts (backends/facts.py). It imports no torch.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from .backends.facts import KNOWN, backend_facts
from .errors import Eagle3Error
from .graph_contract import (ACCEPT, KV_DIMS, ROLE_MODEL, ROLES, graph_shape, kv_cache_length, kv_state_name,
                             min_max_model_len, pick_context, plan_roles)
from .speculation import MAX_DEPTH, MAX_MENU, Capped, SpecShape, Strict, all_shapes, bucket_shapes

SCHEMA_VERSION = 10  # bump on any incompatible change (history: docs/manifest-schema.md)
MANIFEST = "manifest.json"

# ------------------------------------------------------------------ dtypes

# every dtype a manifest may name (torch's name without "torch.") -> (bytes per element, safetensors code)
DTYPE_TABLE = {"float32": (4, "F32"), "bfloat16": (2, "BF16"), "float16": (2, "F16"), "int64": (8, "I64"),
               "int32": (4, "I32"), "bool": (1, "BOOL")}
DTYPE_NAMES = tuple(DTYPE_TABLE)
DTYPE_BYTES = {name: nbytes for name, (nbytes, _) in DTYPE_TABLE.items()}
SAFETENSORS_CODES = {name: code for name, (_, code) in DTYPE_TABLE.items()}
MODEL_DTYPES = ("float32", "bfloat16", "float16")  # what a bundle's weights, KV caches and activations may be


def torch_dtype(name: str):
    """The torch.dtype of a manifest dtype name (torch is imported only here: the builder reads this
    module before it may import torch)."""
    import torch

    if name not in DTYPE_TABLE:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPE_NAMES)}")
    return getattr(torch, name)


def dtype_name(dtype) -> str:
    """A torch.dtype's manifest name ("torch.bfloat16" -> "bfloat16")."""
    return str(dtype).removeprefix("torch.")


# ------------------------------------------------------------------ the schema

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


class TensorSpec(Strict):
    name: str
    shape: Capped(list[Dim], 16)
    dtype: Literal[DTYPE_NAMES]  # type: ignore[valid-type]
    pad: str | None = None  # weights: how the tensor was padded (see eagle3_build.sharding)
    shard: str | None = None  # weights: replicate | column | row | kv | vocab

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


class FileEntry(Strict):
    path: Capped(str, 4096)  # relative to the bundle root, POSIX separators
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    size: Annotated[int, Field(ge=0)]

    @field_validator("path")
    @classmethod
    def _inside(cls, v: str) -> str:
        return bundle_relpath(v)


# oneDNN's packed formats: one copy may hold several weights (PackedWeight.fused), and one copy of a weight serves
# every row count (eagle3_runtime.packing)
ONEDNN_FORMATS = ("onednn", "onednn_bf16")
BLOCKED = "blocked"  # Inductor's CPU GEMM template's weight layout: also fuses, one copy per block_n
BLOCKED_BF16 = "blocked_bf16"  # the same layout in bfloat16 (draft projections only)
BLOCKED_FORMATS = (BLOCKED, BLOCKED_BF16)
FUSED_FORMATS = (*ONEDNN_FORMATS, *BLOCKED_FORMATS)


class PackedWeight(Strict):
    """A graph input made at load time from one of its weights (eagle3_runtime.packing)."""
    weight: str  # qualified name, one of the graph's weights
    # more of them, concatenated after `weight` along the output dim into one copy (FUSED_FORMATS only)
    fused: Capped(list[str], 8) = []
    rows: Count  # the GEMM row count the packing is for
    format: Literal["mkl_sgemm", "onednn", "onednn_bf16", "blocked", "blocked_bf16"]  # (packing.FORMATS)
    block_n: Annotated[int, Field(ge=1, le=1024)] | None = None  # the blocked formats' (and only theirs)

    @model_validator(mode="after")
    def _block_n(self):
        if (self.format in BLOCKED_FORMATS) != (self.block_n is not None):
            raise ValueError(f"packed weight {self.weight!r}: block_n goes with the blocked formats and only with them")
        return self


MAX_WEIGHTS = 1 << 16  # tensors of one model / weights of one graph (a 64-layer MoE has a few thousand)
MAX_FILES = 1 << 16
MAX_PORTS = 32


class GraphEntry(Strict):
    name: str
    role: Literal[tuple(ROLE_MODEL)]  # type: ignore[valid-type]
    model: Literal["target", "draft"]
    bucket: Count
    file: FileEntry
    weights: Capped(list[str], MAX_WEIGHTS)  # qualified "<model>/<tensor>" names, in call order
    packed: Capped(list[PackedWeight], MAX_WEIGHTS) = []  # passed after the weights, in this order
    state: str  # name of the KV cache tensor the graph mutates
    inputs: Capped(list[TensorSpec], MAX_PORTS)
    outputs: Capped(list[TensorSpec], MAX_PORTS)
    backend: dict[str, Any] = {}
    key: str = ""  # compile-cache key (eagle3_build.compile.cache)
    shape: SpecShape | None = None  # a per-shape role's graph for a menu shape (None: the bucket's own shape)
    context: Count | None = None  # a per-context role's graph for a context bucket (None: the whole cache)

    def input(self, name: str) -> TensorSpec:
        for spec in self.inputs:
            if spec.name == name:
                return spec
        raise KeyError(f"graph {self.name} has no input {name!r}")


class ModelEntry(Strict):
    name: Literal["target", "draft"]
    architecture: str
    config: dict[str, Any]  # the canonical args the graphs were traced with
    layout: dict[str, Any]  # tp degree, padded hidden and the per-rank sizes
    weight_files: Capped(list[FileEntry], 1 << 12)  # one per rank
    tensors: Capped(dict[str, TensorSpec], MAX_WEIGHTS)  # what each rank file holds (rank 0 shapes)

    def layout_int(self, key: str) -> int:
        v = self.layout.get(key)
        if type(v) is not int or not 1 <= v <= MAX_DIM:
            raise ValueError(f"models.{self.name}.layout.{key} must be a positive integer, got {v!r}")
        return v


class Manifest(Strict):
    schema_version: int
    name: str
    created_at: str
    backend: str
    dtype: Literal[MODEL_DTYPES]  # type: ignore[valid-type]
    tp_degree: Count
    num_speculative_tokens: Annotated[int, Field(ge=0, le=MAX_DEPTH)]  # the deepest shape's depth (menus too)
    speculation: Capped(dict[Count, SpecShape], 64)  # per batch bucket: what --speculation always serves
    menu: Capped(dict[Count, Capped(list[SpecShape], MAX_MENU)], 64) = {}  # per batch bucket: more shapes
    max_num_seqs: Count
    max_model_len: Count
    prefill_buckets: Capped(list[Count], 64) = Field(min_length=1)
    batch_buckets: Capped(list[Count], 64) = Field(min_length=1)
    context_buckets: Capped(list[Count], 64) = []  # KV slots the per-context roles' extra graphs read
    accept: Literal[ACCEPT] = "host"  # type: ignore[valid-type]  # greedy acceptance: in the verify graph or on the host
    unroll_draft: bool = False  # chains draft in one draft_chain call (graph_contract.draft_unrolled)
    aux_layer_ids: Capped(list[int], 64)
    vocab_size: Count
    eos_token_ids: Capped(list[int], 1024)
    bos_token_id: int | None
    draft_format: str
    recipe: dict[str, Any]
    sources: dict[str, Any]
    toolchain: dict[str, str]
    models: Capped(dict[str, ModelEntry], 2)
    state: Capped(list[TensorSpec], 16)  # KV caches the runtime allocates (zeros)
    kv_layout: Capped(list[str], 8)  # the KV caches' dims by name, in order: a permutation of KV_DIMS
    graphs: Capped(list[GraphEntry], 1024)
    files: Capped(list[FileEntry], MAX_FILES)  # tokenizer, configs, everything else
    notes: Capped(list[str], 1024) = []
    build: dict[str, Any] = {}  # timings, cache hits, host: excluded from the digest
    digest: str = ""  # sha256 over everything above except created_at and build

    @model_validator(mode="after")
    def _consistent(self) -> "Manifest":
        """What the runtime relies on, checked as data before anything is allocated or loaded; every
        check is linear in the manifest's size."""
        _check_buckets(self)
        _check_speculation(self)
        _check_serving(self)
        _check_graph_table(self)
        states = _check_states(self)
        weights: dict[str, list[str]] = {}
        for g in self.graphs:
            if g.model != ROLE_MODEL[g.role] or states.get(g.model) != g.state:
                raise ValueError(f"graph {g.name}: model {g.model!r} / state {g.state!r} do not match its role "
                                 f"({ROLE_MODEL[g.role]}, state {states.get(ROLE_MODEL[g.role])!r})")
            fmt, want = g.backend.get("format"), backend_facts(self.backend).graph_formats()
            if want and fmt not in want:
                raise ValueError(f"graph {g.name}: its file is a {fmt!r} graph, a {self.backend} bundle's graphs are "
                                 f"{' or '.join(map(repr, want))}")
            _check_ports(self, g)
            _check_weights(self, g, weights.setdefault(g.model, g.weights))
        if self.digest and not DIGEST_RE.fullmatch(self.digest):
            raise ValueError("digest must be 64 lowercase hex digits (sha256)")
        return self

    def scratch(self) -> int:
        return max(s.scratch for s in all_shapes(self.speculation, self.menu))

    def longest_prompt(self) -> int:
        """The most prompt tokens a request may have: max_model_len - 1 where every batch bucket has a verify
        graph to continue a prompt past its first prefill chunk (the engine's prefill plan), else the largest
        prefill bucket."""
        if all(any(s.speculates for s in self.shapes(b)) for b in self.batch_buckets):
            return self.max_model_len - 1
        return min(self.prefill_buckets[-1], self.max_model_len - 1)

    def shapes(self, bucket: int) -> list[SpecShape]:
        """A batch bucket's speculation shapes: its own, then its menu."""
        return bucket_shapes(self.speculation, self.menu, bucket)

    def state_bytes(self) -> int:
        return sum(s.nbytes for s in self.state)

    def compute_digest(self) -> str:
        """Same artifact <=> same digest: covers every file's sha256, the graph keys, shapes, recipe,
        sources and toolchain, but not when or how fast it was built."""
        return digest_of(self.model_dump(mode="json"))

    def kv_dim(self, name: str) -> int:
        """Where dim `name` of KV_DIMS ("rows": a sequence's slot, "positions": a token's) is in every KV cache."""
        return self.kv_layout.index(name)

    def state_of(self, model: str) -> str:
        """The name of model `model`'s KV cache (what its graphs mutate)."""
        return next(g.state for g in self.graphs if g.model == model)

    def graph(self, role: str, bucket: int, shape: SpecShape | None = None, slots: int | None = None
              ) -> GraphEntry:
        """The graph of `role` at `bucket` that serves `shape` (None: the bucket's own shape) and reads the
        fewest KV slots holding `slots` (None: the whole-cache graph)."""
        variant = shape if shape is not None and ROLES[role].per_shape and shape != self.speculation.get(bucket) \
            else None
        context = pick_context(self.context_buckets, slots) if slots is not None and ROLES[role].per_context \
            else None
        for g in self.graphs:
            if g.role == role and g.bucket == bucket and g.shape == variant and g.context == context:
                return g
        raise KeyError(f"bundle has no {role} graph for bucket {bucket}" + (f" and {variant.describe()}" if variant
                                                                               else ""))

    def all_files(self) -> list[FileEntry]:
        """Every file once (a neuron bundle's graphs of one model share that model's file)."""
        out = [g.file for g in self.graphs] + list(self.files)
        for m in self.models.values():
            out += m.weight_files
        return list({f.path: f for f in out}.values())


def digest_of(raw: dict) -> str:
    """The bundle digest of a manifest as JSON data (the builder's model dump, or the raw file the
    runtime reads before validating anything): sha256 of its canonical JSON without created_at, build
    and the digest itself."""
    body = {k: v for k, v in raw.items() if k not in ("created_at", "build", "digest")}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ------------------------------------------------------------------ the checks


def kv_state_shape(model: ModelEntry, max_num_seqs: int, positions: int, layout=KV_DIMS) -> list[int]:
    """The KV cache a model's graphs take (its dims in `layout` order), from its config and per-rank layout."""
    layers = model.config.get("num_layers", 1)  # (an EAGLE3 draft is one decoder layer)
    head_dim = model.config.get("head_dim")
    for what, v in (("config.num_layers", layers), ("config.head_dim", head_dim)):
        if type(v) is not int or not 1 <= v <= MAX_DIM:
            raise ValueError(f"models.{model.name}.{what} must be a positive integer, got {v!r}")
    dims = {"layers": layers, "kv": 2, "rows": max_num_seqs, "heads": model.layout_int("kv_heads_per_rank"),
            "positions": positions, "head_dim": head_dim}
    return [dims[d] for d in layout]


def _check_buckets(m: Manifest) -> None:
    K = m.num_speculative_tokens
    if m.max_model_len < min_max_model_len(K):
        raise ValueError(f"max_model_len {m.max_model_len} must exceed num_speculative_tokens + 1 ({K + 1})")
    for key in ("prefill_buckets", "batch_buckets", "context_buckets"):
        b = getattr(m, key)
        if b != sorted(set(b)):
            raise ValueError(f"{key} {b} must be strictly increasing")
    if m.context_buckets and not min_max_model_len(K) <= m.context_buckets[0] \
            <= m.context_buckets[-1] < m.max_model_len:
        raise ValueError(f"context_buckets {m.context_buckets} must lie in {min_max_model_len(K)}.."
                         f"{m.max_model_len - 1} (below max_model_len; the whole cache is always a graph)")


def _check_speculation(m: Manifest) -> None:
    """One shape per batch bucket; a menu only extends a speculating bucket; K is the deepest shape's depth."""
    if sorted(m.speculation) != m.batch_buckets:
        raise ValueError(f"speculation must have one shape per batch bucket {m.batch_buckets}, "
                         f"has {sorted(m.speculation)}")
    for b, shapes in m.menu.items():
        own = m.speculation.get(b)
        if own is None or not own.speculates:
            why = "is not one of the batch buckets" if own is None else "does not speculate"
            raise ValueError(f"menu: batch bucket {b} {why}; a menu extends a speculating bucket's shape")
        tags = [s.tag for s in [own, *shapes]]
        if any(not s.speculates for s in shapes) or len(set(tags)) != len(tags):
            raise ValueError(f"menu of batch bucket {b}: {tags[1:]} must be speculating shapes, each once and "
                             f"other than the bucket's own ({tags[0]})")
    K = m.num_speculative_tokens
    if K != max(s.depth for s in all_shapes(m.speculation, m.menu)):
        raise ValueError(f"num_speculative_tokens {K} is not the deepest speculation shape's depth")


def _check_serving(m: Manifest) -> None:
    if m.max_num_seqs < m.batch_buckets[-1]:
        raise ValueError(f"max_num_seqs {m.max_num_seqs} is below the largest batch bucket {m.batch_buckets[-1]}")
    if any(not 0 <= t < m.vocab_size for t in m.eos_token_ids):
        raise ValueError(f"eos_token_ids {m.eos_token_ids} must lie in [0, vocab_size {m.vocab_size})")
    if set(m.models) != {"target", "draft"}:
        raise ValueError(f"models must be exactly target and draft, got {sorted(m.models)}")
    for name, model in m.models.items():
        if model.name != name or len(model.weight_files) != m.tp_degree:
            raise ValueError(f"models.{name}: needs name {name!r} and one weight file per rank "
                             f"({m.tp_degree}), has {len(model.weight_files)}")


def _check_graph_table(m: Manifest) -> None:
    """Exactly one graph per (role, bucket, shape, context) the plan needs (plan_roles), none more."""
    have = {(g.role, g.bucket, g.shape.tag if g.shape else None, g.context) for g in m.graphs}
    if len(have) != len(m.graphs):
        raise ValueError("graphs: more than one graph for the same role, bucket, shape and context")
    need = {(r, b, v.tag if v else None, c)
            for r, b, v, c in plan_roles(m.prefill_buckets, m.speculation, m.menu, m.context_buckets, m.unroll_draft)}

    def graph_labels(keys):
        return [f"{r}/{b}" + (f"/{v}" if v else "") + (f"/c{c}" if c else "") for r, b, v, c in sorted(keys, key=str)]
    missing = graph_labels(need - have)
    if missing:
        raise ValueError(f"graphs: missing {', '.join(missing[:4])} (every bucket needs its shapes' roles, "
                         "per context bucket where the role has them)")
    extra = graph_labels(have - need)
    if extra:
        raise ValueError(f"graphs: {', '.join(extra[:4])} serves no shape of its bucket (speculation, menu) "
                         "or no context bucket")


def _check_states(m: Manifest) -> dict[str, str]:
    """One KV cache per model, of the bundle's dtype and the shape its graphs were built for -> {model: name}."""
    if sorted(m.kv_layout) != sorted(KV_DIMS):
        raise ValueError(f"kv_layout {m.kv_layout} must name each of {', '.join(KV_DIMS)} once")
    by_name = {s.name: s for s in m.state}
    names = {model: kv_state_name(model) for model in m.models}
    positions = kv_cache_length(m.max_model_len, m.scratch())
    if set(by_name) != set(names.values()) or len(m.state) != len(names):
        raise ValueError(f"state must be exactly {sorted(names.values())}, got {[s.name for s in m.state]}")
    for model, name in names.items():
        s, want = by_name[name], kv_state_shape(m.models[model], m.max_num_seqs, positions, m.kv_layout)
        if s.dtype != m.dtype or s.shape != want:
            raise ValueError(f"state {name}: {s.dtype} {s.shape}, the bundle's graphs take {m.dtype} {want} "
                             f"({', '.join(m.kv_layout)}: max_num_seqs {m.max_num_seqs} rows, max_model_len "
                             f"{m.max_model_len} + scratch positions)")
    return names


def _check_ports(m: Manifest, g: GraphEntry) -> None:
    """Every input and output of a graph, the rank first, as the role table resolves it for its bucket's
    speculation shape, the padded hidden sizes, the vocab and the bundle's dtypes: the engine builds its
    inputs from these and reads the outputs by them."""
    shape = graph_shape(g.role, g.bucket, m.speculation, m.menu, g.shape)
    role = ROLES[g.role]
    hidden = {f"{name}_hidden": m.models[name].layout_int("padded_hidden") for name in m.models}
    index_dtype = backend_facts(m.backend).index_dtype
    want = (role.input_specs(g.bucket, shape, **hidden, dtype=m.dtype, index_dtype=index_dtype),
            role.output_specs(g.bucket, shape, **hidden, vocab=m.vocab_size, dtype=m.dtype, accept=m.accept))
    for kind, specs, ports in (("inputs", g.inputs, want[0]), ("outputs", g.outputs, want[1])):
        have = [(s.name, s.shape, s.dtype) for s in specs]
        if have != [(n, sh, dt) for n, sh, dt in ports]:
            bad = next((h, w) for h, w in zip(have + [None] * len(ports), ports + [None] * len(have)) if h != w)
            raise ValueError(f"graph {g.name}: {kind} {bad[0]} where its role for bucket {g.bucket} "
                             f"({shape.describe()}) takes {bad[1]} (name, shape, dtype)")


def _check_weights(m: Manifest, g: GraphEntry, first: list[str]) -> None:
    """Weights: the model's tensors, the same list in the same order for every graph of the model (one
    binding per model), each at most once; packed copies only of 2-D float32 weights, for at most the
    rows one call of the graph has, on a backend that packs."""
    if g.weights != first:
        raise ValueError(f"graph {g.name}: its weights differ from the other {g.model} graphs' (order or names)")
    if len(set(g.weights)) != len(g.weights):
        raise ValueError(f"graph {g.name}: a weight is listed twice")
    specs = {}
    for w in g.weights:
        model, _, tensor = w.partition("/")
        if model not in m.models or tensor not in m.models[model].tensors:
            raise ValueError(f"graph {g.name}: weight {w!r} is not in any model's tensors")
        specs[w] = m.models[model].tensors[tensor]
    if g.packed and not backend_facts(m.backend).packs_weights:
        packing = ", ".join(f.name for f in KNOWN.values() if f.packs_weights)
        raise ValueError(f"graph {g.name}: packed weights on a {m.backend} graph (only {packing} graphs take them)")
    rows = ROLES[g.role].tokens_per_call(g.bucket, graph_shape(g.role, g.bucket, m.speculation, m.menu, g.shape))
    for p in g.packed:
        if p.fused and p.format not in FUSED_FORMATS:
            raise ValueError(f"graph {g.name}: packed weight {p.weight!r} fuses {len(p.fused)} more in format "
                             f"{p.format}, which takes one weight per copy")
        for w in (p.weight, *p.fused):
            spec = specs.get(w)
            if spec is None:
                raise ValueError(f"graph {g.name}: packed weight {w!r} is not one of its weights")
            if len(spec.shape) != 2 or spec.dtype != "float32" or p.rows > rows:
                raise ValueError(f"graph {g.name}: packed weight {w!r} ({spec.dtype} {spec.shape}, {p.rows} rows): "
                                 f"packing takes 2-D float32 weights for at most the graph's {rows} token rows")
            if spec.shape[1:] != specs[p.weight].shape[1:]:
                raise ValueError(f"graph {g.name}: packed weights {p.weight!r} and {w!r} are fused but differ in "
                                 "input width")


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_entry(root: Path, path: Path) -> FileEntry:
    return FileEntry(path=path.relative_to(root).as_posix(), sha256=sha256_file(path), size=path.stat().st_size)
