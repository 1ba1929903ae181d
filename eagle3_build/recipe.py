"""Recipe loading: YAML file -> validated, fully resolved :class:`Recipe`.

A recipe pairs target models with EAGLE3 drafts (see ``recipes/*.yaml``).  ``load_recipe``
collects every problem of a file and raises one :class:`RecipeError` listing them all, each with
the file, the 1-based line, the dotted key path and what is allowed.  Nothing else escapes it.
"""

from __future__ import annotations

import hashlib
import os
import re
import typing
from dataclasses import dataclass
from pathlib import Path
import types
from typing import Annotated, Any, Callable, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from eagle3_runtime.manifest import (
    BACKENDS,
    MAX_DEPTH,
    MAX_NODES,
    MODEL_DTYPES,
    NO_SPECULATION,
    SpecShape,
    chain,
    dynamic_tree,
    max_tree_nodes,
    min_max_model_len,
    static_tree,
)

from .buckets import default_batch_buckets, default_prefill_buckets
from .errors import UserError

__all__ = [
    "RecipeIssue",
    "RecipeError",
    "SourceSpec",
    "Speculation",
    "Serving",
    "Parallel",
    "Buckets",
    "VerifySettings",
    "VERIFY_DEFAULTS",
    "PairRecipe",
    "Recipe",
    "load_recipe",
    "min_max_model_len",
    "select_pair",
]

# the backend_options each backend understands (checked here with the recipe line, and by get_backend)
BACKEND_OPTIONS = {"export": (), "aoti": ("device", "inductor_configs"),
                   "neuron": ("compiler_args", "role_compiler_args", "fold_env_flags")}
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")
HF_RE = re.compile(r"hf://([A-Za-z0-9][A-Za-z0-9._-]*)/([A-Za-z0-9][A-Za-z0-9._-]*)(?:@([^\s@]+))?\Z")
_SCHEME_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_SOURCE_FORMS = (
    "a local checkpoint directory, hf://org/name[@revision], a path to a .gguf file, "
    "or a mapping with keys source, gguf_file, allow_pickle"
)
_TOP_KEYS = ("defaults", "pairs")

# Hostile-input bounds (a real recipe is a few KB, a few hundred nodes, nested ~5 deep)
MAX_RECIPE_BYTES = 1 << 20  # refused before parsing
MAX_YAML_NODES = 100_000  # counted with every alias expanded (billion laughs)
MAX_YAML_DEPTH = 64
MAX_PAIRS = 100  # defaults are merged into every pair: this bounds that work too


# --------------------------------------------------------------------------------------- errors


@dataclass(frozen=True)
class RecipeIssue:
    """One problem in a recipe file."""

    file: str
    line: int | None
    key: str
    message: str

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return f"{where}: {self.key}: {self.message}" if self.key else f"{where}: {self.message}"


class RecipeError(UserError):
    """Every problem found in a recipe; ``str()`` gives one ``file:line: key: message`` per line."""

    def __init__(self, errors: list[RecipeIssue]):
        self.errors = list(errors)
        super().__init__(str(self))

    MAX_SHOWN = 20  # a hostile recipe can hold thousands of problems; the first ones name the fix

    def __str__(self) -> str:
        shown = [str(e) for e in self.errors[: self.MAX_SHOWN]]
        if len(self.errors) > self.MAX_SHOWN:
            shown.append(f"... and {len(self.errors) - self.MAX_SHOWN} more problem(s) in this recipe")
        return "\n".join(shown)


# --------------------------------------------------------------------------------- output models


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SourceSpec(_Frozen):
    """A normalised model source (target or draft)."""

    uri: str  # as written in the recipe
    kind: Literal["local", "hf", "gguf"]
    path: str | None = None  # absolute local path (for gguf: the .gguf file)
    repo_id: str | None = None  # hf only
    revision: str | None = None  # hf only, default "main"
    gguf_file: str | None = None  # hf only: a .gguf file inside the repo
    allow_pickle: bool = False


class Speculation(_Frozen):
    num_speculative_tokens: int  # the deepest shape's depth
    shapes: dict[int, SpecShape]  # per batch bucket (manifest.SpecShape)

    def scratch(self) -> int:
        return max(s.scratch for s in self.shapes.values())


class Serving(_Frozen):
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int


class Parallel(_Frozen):
    tp_degree: int = 1
    padded_hidden_size: int | None = None


class Buckets(_Frozen):
    prefill: list[int]
    batch: list[int]


class VerifySettings(_Frozen):
    """The pair's ``verify`` section. These defaults are the only ones: the schema below and
    ``eagle3-build verify`` (for a manifest whose recipe lacks a key) take them from here."""

    min_acceptance_length: float | None = None  # the gate; None: no gate
    num_prompts: int = 4  # 0: compile skips verify
    max_tokens: int = 32  # per prompt
    chat: bool = False  # wrap each prompt as one user message in the target's chat template


VERIFY_DEFAULTS = VerifySettings()


class PairRecipe(_Frozen):
    name: str
    target: SourceSpec
    draft: SourceSpec
    dtype: Literal[MODEL_DTYPES]  # type: ignore[valid-type]
    speculation: Speculation
    serving: Serving
    parallel: Parallel
    buckets: Buckets
    backend: Literal[BACKENDS]  # type: ignore[valid-type]
    backend_options: dict[str, Any]
    verify: VerifySettings


class Recipe(_Frozen):
    path: str  # absolute path of the recipe file
    sha256: str  # of the file bytes
    pairs: list[PairRecipe]


# ------------------------------------------------------------------ input schema (what YAML holds)


class _Raw(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _RawSource(_Raw):
    source: str
    gguf_file: str | None = None
    allow_pickle: bool = False


class _RawTree(_Raw):
    """``speculation.tree``: a dynamic tree (topk + num_draft_tokens) or a static one (choices)."""

    # the upper bounds (MAX_NODES, max_tree_nodes) are checked by _section_shape, which says why
    topk: int | None = Field(None, ge=1)  # children per expanded node
    num_draft_tokens: int | None = Field(None, ge=1)  # nodes verified per pass, the root included
    # TensorRT-LLM eagle_choices: each path of child ranks names one node (rank < MAX_NODES keeps topk <= MAX_NODES)
    choices: list[list[Annotated[int, Field(ge=0, le=MAX_NODES - 1)]]] | None = None


class _RawSpecSection(_Raw):
    """One ``speculation.per_batch_bucket`` entry: a whole shape (0 steps: no speculation there)."""

    num_speculative_tokens: int | None = Field(None, ge=0)  # None: only with tree.choices; <= MAX_DEPTH
    tree: _RawTree | None = None


class _RawSpeculation(_Raw):
    num_speculative_tokens: int | None = Field(None, ge=1)  # None: only with tree.choices; <= MAX_DEPTH
    tree: _RawTree | None = None
    per_batch_bucket: dict[int, _RawSpecSection] | None = None


class _RawServing(_Raw):
    max_num_seqs: int = Field(1, ge=1)
    max_model_len: int = Field(ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)


class _RawParallel(_Raw):
    tp_degree: int = Field(1, ge=1)
    padded_hidden_size: int | None = Field(None, ge=1)


class _RawBuckets(_Raw):
    prefill: list[int] | None = None
    batch: list[int] | None = None


class _RawVerify(_Raw):
    min_acceptance_length: float | None = Field(VERIFY_DEFAULTS.min_acceptance_length, ge=1)
    num_prompts: int = Field(VERIFY_DEFAULTS.num_prompts, ge=0)
    max_tokens: int = Field(VERIFY_DEFAULTS.max_tokens, ge=1)
    chat: bool = VERIFY_DEFAULTS.chat


class _RawPair(_Raw):
    name: str
    target: Any  # checked by _resolve_source (str or mapping)
    draft: Any
    dtype: Literal[MODEL_DTYPES] = "bfloat16"  # type: ignore[valid-type]
    speculation: _RawSpeculation
    serving: _RawServing
    parallel: _RawParallel = _RawParallel()
    buckets: _RawBuckets = _RawBuckets()
    backend: Literal[BACKENDS] = "export"  # type: ignore[valid-type]
    backend_options: dict[str, Any] = Field(default_factory=dict)
    verify: _RawVerify = _RawVerify()


# -------------------------------------------------------------------------------- helpers


def _fmt_key(path: tuple) -> str:
    out = ""
    for part in path:
        if isinstance(part, int) and not isinstance(part, bool):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _desc(value: Any) -> str:
    """Describe a YAML value with its YAML type, e.g. ``string '3'``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, int):
        return f"integer {value}"
    if isinstance(value, float):
        return f"float {value!r}"
    if isinstance(value, str):
        return f"string {value!r}"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"{type(value).__name__} {value!r}"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _pos_int(v: Any) -> int | None:
    return v if _is_int(v) and v >= 1 else None


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _unoptional(ann: Any) -> Any:
    """``X | None`` -> ``X`` (other annotations unchanged)."""
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(args) == 1:
            return _unoptional(args[0])
    return ann


def _is_model(ann: Any) -> bool:
    return isinstance(ann, type) and issubclass(ann, BaseModel)


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The pydantic model class that validates the value at ``loc`` (None if not a model); a
    ``dict[K, Model]`` or ``list[Model]`` field is followed through its keys / indices."""
    cur: Any = model
    for part in loc:
        cur = _unoptional(cur)
        if _is_model(cur):
            if part not in cur.model_fields:
                return None
            cur = cur.model_fields[part].annotation
        elif typing.get_origin(cur) in (dict, list) and typing.get_args(cur):
            cur = typing.get_args(cur)[-1]
        else:
            return None
    cur = _unoptional(cur)
    return cur if _is_model(cur) else None


def _pydantic_message(err: dict, model: type[BaseModel]) -> str:
    typ = err["type"]
    loc = tuple(err["loc"])
    inp = err.get("input")
    ctx = err.get("ctx") or {}
    if typ == "extra_forbidden":
        parent = _model_at(model, loc[:-1])
        allowed = ", ".join(parent.model_fields) if parent else "none"
        return f"unknown key {loc[-1]!r}; allowed keys: {allowed}"
    if typ == "missing":
        return "required key is missing"
    if typ in ("int_type", "int_parsing", "int_from_float"):
        return f"must be an integer, got {_desc(inp)}"
    if typ in ("float_type", "float_parsing"):
        return f"must be a number, got {_desc(inp)}"
    if typ in ("bool_type", "bool_parsing"):
        return f"must be true or false, got {_desc(inp)}"
    if typ in ("string_type", "string_sub_type"):
        return f"must be a string, got {_desc(inp)}"
    if typ == "list_type":
        return f"must be a list, got {_desc(inp)}"
    if typ == "dict_type" and loc[-1:] == ("per_batch_bucket",):
        return (f"must be a mapping of batch bucket sizes to sections with keys "
                f"{', '.join(_RawSpecSection.model_fields)}, got {_desc(inp)}")
    if typ in ("dict_type", "model_type", "model_attributes_type"):
        sub = _model_at(model, loc)
        keys = f" with keys {', '.join(sub.model_fields)}" if sub else ""
        return f"must be a mapping{keys}, got {_desc(inp)}"
    if typ == "literal_error":
        return f"must be one of {ctx.get('expected')}, got {_desc(inp)}"
    if typ == "greater_than_equal":
        return f"must be >= {ctx.get('ge')}, got {_desc(inp)}"
    if typ == "less_than_equal":
        return f"must be <= {ctx.get('le')}, got {_desc(inp)}"
    if typ == "greater_than":
        return f"must be > {ctx.get('gt')}, got {_desc(inp)}"
    return f"{err['msg']}, got {_desc(inp)}"


# ------------------------------------------------------------------------------- YAML positions


class _YamlLimit(Exception):
    """A recipe past one of the bounds above (line may be None)."""

    def __init__(self, line: int | None, message: str):
        super().__init__(message)
        self.line, self.message = line, message


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that stops composing a document with too many distinct nodes or too deep a nesting
    (so memory stays bounded before anything walks the node graph)."""

    def __init__(self, text: str):
        super().__init__(text)
        self.n_nodes = self.depth = 0

    def compose_node(self, parent, index):
        mark = self.peek_event().start_mark
        if not self.check_event(yaml.AliasEvent):
            self.n_nodes += 1
            if self.n_nodes > MAX_YAML_NODES:
                raise _YamlLimit(mark.line + 1, f"recipe has more than {MAX_YAML_NODES} YAML nodes")
        self.depth += 1
        if self.depth > MAX_YAML_DEPTH:
            raise _YamlLimit(mark.line + 1, f"recipe nests deeper than {MAX_YAML_DEPTH} levels")
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def _check_expansion(root: yaml.Node) -> None:
    """Refuse recursive aliases and documents whose alias expansion exceeds MAX_YAML_NODES, in time
    linear in the node graph (each node's expanded size is computed once)."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()

    def size(node: yaml.Node) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in on_path:
            raise _YamlLimit(node.start_mark.line + 1, "recursive YAML alias (a node that contains itself)")
        on_path.add(id(node))
        if isinstance(node, yaml.MappingNode):
            children = [c for pair in node.value for c in pair]
        else:
            children = node.value if isinstance(node, yaml.SequenceNode) else []
        n = 1
        for child in children:
            n = min(n + size(child), MAX_YAML_NODES + 1)  # capped: the numbers stay small
        on_path.discard(id(node))
        sizes[id(node)] = n
        return n

    if size(root) > MAX_YAML_NODES:
        raise _YamlLimit(None, f"recipe expands to more than {MAX_YAML_NODES} nodes through YAML aliases; "
                               "use anchors for shared settings, not to multiply data")


def _line_map(root: yaml.Node) -> dict[tuple, int]:
    """Map each key path (str keys, int indices) to the 1-based line of its key / list item.

    Walks aliases like the data does, so it is bounded by _check_expansion (run first)."""
    lines: dict[tuple, int] = {(): root.start_mark.line + 1}

    def walk(node: yaml.Node, path: tuple) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode):
                    p = path + (k.value,)
                    lines[p] = k.start_mark.line + 1
                    walk(v, p)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                lines[path + (i,)] = item.start_mark.line + 1
                walk(item, path + (i,))

    walk(root, ())
    return lines


def _duplicate_keys(root: yaml.Node) -> list[tuple[tuple, int, int]]:
    """(path, first_line, dup_line) for every key repeated inside one mapping (before merges)."""
    found: list[tuple[tuple, int, int]] = []
    seen_nodes: set[int] = set()

    def walk(node: yaml.Node, path: tuple) -> None:
        if id(node) in seen_nodes:
            return
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[str, int] = {}
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.value != "<<":
                    line = k.start_mark.line + 1
                    if k.value in first:
                        found.append((path + (k.value,), first[k.value], line))
                    else:
                        first[k.value] = line
                    walk(v, path + (k.value,))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, path + (i,))

    walk(root, ())
    return found


def _line_of(lines: dict[tuple, int], path: tuple) -> int | None:
    """Line of ``path``, or of its closest enclosing key that exists in the file.

    An int is a list index or an int mapping key (per_batch_bucket's ``1:``, in ``lines`` by its text)."""
    found: tuple = ()
    line = lines.get(())
    for part in path:
        cand = found + (part,)
        if cand not in lines and _is_int(part):
            cand = found + (str(part),)
        if cand not in lines:
            break
        found, line = cand, lines[cand]
    return line


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if k in out and isinstance(out[k], dict) and isinstance(v, dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _origin(defaults: dict, pair: dict, pair_abs: tuple, rel: tuple) -> tuple:
    """Document path that the merged value at ``rel`` (relative to the pair) came from."""
    d: Any = defaults
    p: Any = pair
    dcur: tuple = ("defaults",)
    pcur = pair_abs
    for i, part in enumerate(rel):
        p_has = isinstance(p, dict) and part in p
        d_has = isinstance(d, dict) and part in d
        if p_has and d_has and isinstance(p[part], dict) and isinstance(d[part], dict):
            p, d = p[part], d[part]
            pcur, dcur = pcur + (part,), dcur + (part,)
            continue
        if p_has or not d_has:
            return pcur + rel[i:]  # pair value wins, or key missing: enclosing (pair) mapping
        return dcur + rel[i:]
    return pcur


# ------------------------------------------------------------------------------------ sources


def _resolve_source(value: Any, base_dir: Path, rel: tuple, add: Callable[..., None]) -> SourceSpec | None:
    """Normalise one target/draft entry; reports problems through ``add`` and returns None if any."""
    ok = True
    if isinstance(value, str):
        uri, gguf_file, allow_pickle, src_rel = value, None, False, rel
    elif isinstance(value, dict):
        try:
            raw = _RawSource.model_validate(value)
            uri, gguf_file, allow_pickle = raw.source, raw.gguf_file, raw.allow_pickle
        except ValidationError as exc:
            for err in exc.errors():
                add(rel + tuple(err["loc"]), _pydantic_message(err, _RawSource))
            # keep checking what is usable so that every problem is reported at once
            uri, gguf_file, allow_pickle = value.get("source"), value.get("gguf_file"), False
            if not isinstance(gguf_file, str):
                gguf_file = None
            ok = False
        if not isinstance(uri, str):
            return None
        src_rel = rel + ("source",)
    else:
        add(rel, f"must be {_SOURCE_FORMS}; got {_desc(value)}")
        return None

    if gguf_file is not None and (not gguf_file.lower().endswith(".gguf") or gguf_file.startswith(("/", "\\"))):
        add(rel + ("gguf_file",), f"must be the relative name of a .gguf file, got {gguf_file!r}")
        ok = False
    if not uri.strip():
        add(src_rel, f"must not be empty; use {_SOURCE_FORMS}")
        return None

    if uri.startswith("hf://"):
        m = HF_RE.match(uri)
        if not m:
            add(src_rel, f"malformed hf:// uri {uri!r}: must be hf://org/name or hf://org/name@revision")
            return None
        if not ok:
            return None
        return SourceSpec(
            uri=uri,
            kind="hf",
            repo_id=f"{m.group(1)}/{m.group(2)}",
            revision=m.group(3) or "main",
            gguf_file=gguf_file,
            allow_pickle=allow_pickle,
        )

    if _SCHEME_RE.match(uri):
        add(src_rel, f"unsupported source {uri!r}: use a local path, hf://org/name[@revision] or a .gguf file")
        return None

    p = Path(os.path.expanduser(uri))
    if not p.is_absolute():
        p = base_dir / p
    p = Path(os.path.abspath(p))
    if gguf_file is not None:
        if uri.lower().endswith(".gguf"):
            add(rel + ("gguf_file",), "only allowed when source is a directory or an hf:// repo; source already names a .gguf file")
            return None
        if not p.is_dir():
            add(src_rel, f"local directory {uri!r} does not exist (resolved to {p})")
            return None
        if not ok:
            return None
        f = p / gguf_file
        if not f.is_file():
            add(rel + ("gguf_file",), f"GGUF file {gguf_file!r} not found in {p}")
            return None
        return SourceSpec(uri=uri, kind="gguf", path=str(f), allow_pickle=allow_pickle)
    if uri.lower().endswith(".gguf"):
        if not p.is_file():
            add(src_rel, f"GGUF file {uri!r} does not exist (resolved to {p})")
            return None
        return SourceSpec(uri=uri, kind="gguf", path=str(p), allow_pickle=allow_pickle) if ok else None
    if not p.exists():
        add(src_rel, f"local path {uri!r} does not exist (resolved to {p}; relative paths resolve against "
                     "the recipe's directory); use an existing checkpoint directory, a .gguf file or hf://org/name[@revision]")
        return None
    if not p.is_dir():
        add(src_rel, f"{uri!r} is a file; a local source must be a checkpoint directory or a .gguf file")
        return None
    return SourceSpec(uri=uri, kind="local", path=str(p), allow_pickle=allow_pickle) if ok else None


# ------------------------------------------------------------------------------------ checks


def _check_buckets(merged: dict, add: Callable[..., None], deepest: tuple[int, str] | None) -> None:
    """Bucket list shape and their relation to serving limits (only on values of valid type).

    ``deepest``: (depth, the key that gives it) of the deepest speculation shape in use (None: unknown)."""
    k, k_name = deepest if deepest is not None else (None, "")
    mml = _pos_int(_get(merged, "serving", "max_model_len"))
    serving = merged.get("serving") if isinstance(merged.get("serving"), dict) else {}
    mns = _pos_int(serving.get("max_num_seqs", 1))
    mnbt_raw = serving.get("max_num_batched_tokens")
    mnbt = _pos_int(mnbt_raw)

    if mml is not None and k is not None and mml < min_max_model_len(k):
        why = "" if k_name == _TOP_DEPTH else ", the deepest speculation shape"
        add(("serving", "max_model_len"), f"must be greater than {k_name} + 1 ({k + 1}{why}), got {mml}; "
                                          f"raise it to at least {min_max_model_len(k)}")
    if mml is not None and mnbt is not None and mnbt > mml:
        add(("serving", "max_num_batched_tokens"), f"must be <= serving.max_model_len ({mml}), got {mnbt}")

    for kind in ("prefill", "batch"):
        lst = _get(merged, "buckets", kind)
        if not isinstance(lst, list) or not all(_is_int(b) for b in lst):
            continue  # absent/null -> default; wrong types are reported by the schema
        rel = ("buckets", kind)
        if not lst:
            add(rel, "must not be empty; give ascending positive integers or omit it for the defaults")
            continue
        good = True
        for i, b in enumerate(lst):
            if b < 1:
                add(rel + (i,), f"buckets must be positive integers, got {b}")
                good = False
            elif i > 0 and b <= lst[i - 1]:
                add(rel + (i,), f"buckets must be strictly ascending, got {b} after {lst[i - 1]}")
                good = False
            elif kind == "prefill" and mml is not None and b > mml:
                add(rel + (i,), f"prefill bucket {b} exceeds serving.max_model_len ({mml})")
            elif kind == "batch" and mns is not None and b > mns:
                add(rel + (i,), f"batch bucket {b} exceeds serving.max_num_seqs ({mns}); its graphs could never "
                                "run (a batch holds at most max_num_seqs sequences)")
        if not good:
            continue
        if kind == "batch" and mns is not None and lst[-1] < mns:
            add(rel, f"largest batch bucket ({lst[-1]}) is smaller than serving.max_num_seqs ({mns}); add a bucket >= {mns}")

    mal = _get(merged, "verify", "min_acceptance_length")
    if k is not None and isinstance(mal, (int, float)) and not isinstance(mal, bool) and mal > k + 1:
        add(("verify", "min_acceptance_length"),
            f"can never be reached: acceptance length is at most the deepest speculation depth + 1 = {k + 1} "
            f"({k_name} + 1), got {mal}")


# ---------------------------------------------------------------------------- speculation shapes

_TOP_DEPTH = "speculation.num_speculative_tokens"
_TREE_FORMS = "topk and num_draft_tokens (a dynamic tree) or choices (a static tree)"


def _batch_buckets(merged: dict) -> tuple[list[int], str] | None:
    """The pair's resolved batch buckets and where they come from (None while they are invalid)."""
    buckets = merged.get("buckets")
    lst = buckets.get("batch") if isinstance(buckets, dict) else None
    if buckets is not None and not isinstance(buckets, dict):
        return None
    if lst is not None:
        good = isinstance(lst, list) and lst and all(_is_int(b) and b >= 1 for b in lst)
        return (lst, "buckets.batch") if good and all(a < b for a, b in zip(lst, lst[1:])) else None
    serving = merged.get("serving")
    mns = _pos_int(serving.get("max_num_seqs", 1)) if isinstance(serving, dict) else None
    if mns is None:
        return None
    return default_batch_buckets(mns), f"the default for serving.max_num_seqs {mns}"


def _choices_shape(choices: Any, rel: tuple, add: Callable[..., None]) -> SpecShape | None:
    """The static tree of ``choices`` (TensorRT-LLM eagle_choices), each bad path reported at its item."""
    if not isinstance(choices, list) or not all(
            isinstance(c, list) and all(_is_int(r) and 0 <= r < MAX_NODES for r in c) for c in choices):
        return None  # the schema reports it
    if not choices:
        add(rel, "must not be empty: give paths of child ranks such as [[0], [1], [0, 0]] (the root is implied)")
        return None
    ok = True
    given = {tuple(c) for c in choices}
    first: dict[tuple, int] = {}
    too_deep = False
    for i, c in enumerate(choices):
        t = tuple(c)
        if not t:
            add(rel + (i,), "an empty path [] (the root is implied); remove it")
            ok = False
        elif t in first:
            add(rel + (i,), f"{c} appears twice (first as choices[{first[t]}]); each path names one node, remove one")
            ok = False
        else:
            first[t] = i
            if len(t) > 1 and t[:-1] not in given:
                add(rel + (i,), f"{c} has no parent {list(t[:-1])} (the paths must be prefix-closed); "
                                f"add {list(t[:-1])} or remove {c}")
                ok = False
            if len(t) > MAX_DEPTH and not too_deep:
                add(rel + (i,), f"{c} is {len(t)} deep; a tree has at most {MAX_DEPTH} draft steps (the runtime's "
                                "MAX_DEPTH); shorten the paths")
                ok, too_deep = False, True
    if len(choices) + 1 > MAX_NODES:
        add(rel, f"{len(choices)} paths, at most {MAX_NODES - 1}: a verify pass holds at most {MAX_NODES} nodes "
                 "(the runtime's MAX_NODES), the root included; remove paths")
        ok = False
    if not ok:
        return None
    try:
        return static_tree(choices)
    except ValueError as exc:  # whatever static_tree refuses that the checks above did not
        add(rel, str(exc))
        return None


def _section_shape(sec: Any, rel: tuple, add: Callable[..., None], *, top: bool) -> SpecShape | None:
    """The shape of one speculation section (``speculation`` or a ``per_batch_bucket`` entry) from the merged
    YAML values, reporting its cross-key problems; None where it is unknown (a problem was reported, here
    or by the schema)."""
    if not isinstance(sec, dict):
        return None
    drel, trel = rel + ("num_speculative_tokens",), rel + ("tree",)
    d = sec.get("num_speculative_tokens")
    d_given = d is not None
    d_ok = _is_int(d) and d >= (1 if top else 0)  # else the schema reports it
    if d_ok and d > MAX_DEPTH:
        add(drel, f"must be <= {MAX_DEPTH} (the runtime drafts at most MAX_DEPTH = {MAX_DEPTH} steps), got {d}")
        d_ok = False
    tree = sec.get("tree")
    if tree is not None and not isinstance(tree, dict):
        return None
    choices = tree.get("choices") if tree else None

    if choices is not None:  # static tree
        extra = [key for key in ("topk", "num_draft_tokens") if tree.get(key) is not None]
        for key in extra:
            add(trel + (key,), f"not allowed with choices: a static tree's topk and node count come from its "
                               f"paths; drop {key}, or drop choices for a dynamic tree")
        shape = _choices_shape(choices, trel + ("choices",), add)
        if shape is None or extra or (d_given and not d_ok):
            return None
        if d_given and d != shape.depth:
            add(drel, f"must equal the depth of tree.choices ({shape.depth}), got {d}; omit it (the choices give "
                      f"the depth) or set it to {shape.depth}")
            return None
        return shape

    if not d_given:
        add(drel, "required key is missing: give the number of draft steps (the chain length, or the tree depth); "
                  "only a static tree (tree.choices) may omit it")
        return None
    if tree is None:  # a chain
        return chain(d) if d_ok else None

    topk, n = tree.get("topk"), tree.get("num_draft_tokens")
    if topk is None and n is None:
        add(trel, f"must give {_TREE_FORMS}; omit tree for a chain of num_speculative_tokens")
        return None
    if topk is None:
        add(trel + ("topk",), "required key is missing: a dynamic tree needs topk (children per expanded node) "
                              "with num_draft_tokens")
    if n is None:
        add(trel + ("num_draft_tokens",), "required key is missing: a dynamic tree needs num_draft_tokens (nodes "
                                          "verified per pass, the root included) with topk")
    k_ok = _is_int(topk) and topk >= 1
    if k_ok and topk > MAX_NODES:
        add(trel + ("topk",), f"must be <= {MAX_NODES} (a verify pass holds at most MAX_NODES = {MAX_NODES} nodes), "
                              f"got {topk}")
        k_ok = False
    n_ok = _is_int(n) and n >= 1
    if n_ok and n > MAX_NODES:
        add(trel + ("num_draft_tokens",), f"must be <= {MAX_NODES} (a verify pass holds at most MAX_NODES = "
                                          f"{MAX_NODES} nodes, the root included), got {n}")
        n_ok = False
    if not (d_ok and k_ok and n_ok):
        return None
    if d == 0:
        add(drel, "must be >= 1 with a tree (a tree drafts at least one step); for no speculation at this batch "
                  "bucket drop tree")
        return None
    most = max_tree_nodes(d, topk)
    bounds = f"[{d + 1}, {min(most, MAX_NODES)}]"
    if n < d + 1:
        add(trel + ("num_draft_tokens",), f"must be in {bounds}, got {n}: it counts the root too, so {d} draft "
                                          f"steps verify at least num_speculative_tokens + 1 = {d + 1} nodes; "
                                          f"raise num_draft_tokens or lower num_speculative_tokens")
        return None
    if n > most:
        add(trel + ("num_draft_tokens",), f"must be in {bounds}, got {n}: {d} steps of topk {topk} children can "
                                          f"grow at most {most} nodes (the root included); lower num_draft_tokens "
                                          "or raise topk or num_speculative_tokens")
        return None
    return dynamic_tree(d, topk, n)


def _given_depth(sec: Any, top: bool) -> int | None:
    """A section's valid num_speculative_tokens: its depth even where the rest of its shape is wrong."""
    d = sec.get("num_speculative_tokens") if isinstance(sec, dict) else None
    return d if _is_int(d) and (1 if top else 0) <= d <= MAX_DEPTH else None


def _depth_name(sec: dict, prefix: str) -> str:
    return f"{prefix}.num_speculative_tokens" if sec.get("num_speculative_tokens") is not None else (
        f"the depth of {prefix}.tree.choices")


def _check_speculation(merged: dict, add: Callable[..., None]) -> tuple[int, str] | None:
    """Every speculation section's problems and per_batch_bucket's keys; returns (depth, the key giving it) of
    the deepest shape in use, None when no depth in use is known (a section whose tree is wrong still counts
    with its num_speculative_tokens)."""
    spec = merged.get("speculation")
    if not isinstance(spec, dict):
        return None
    top = _section_shape(spec, ("speculation",), add, top=True)
    per = spec.get("per_batch_bucket")
    resolved = _batch_buckets(merged)
    batch = resolved[0] if resolved else None
    used: list[tuple[int, str]] = []
    overridden: set[int] = set()
    for b, sec in (per.items() if isinstance(per, dict) else ()):
        if not _is_int(b):
            continue  # the schema reports the key
        rel = ("speculation", "per_batch_bucket", b)
        known = batch is None or b in batch
        if not known:
            add(rel, f"unknown batch bucket {b}; this pair's batch buckets are {', '.join(map(str, batch))} "
                     f"({resolved[1]}); override only those")
        overridden.add(b)
        shape = _section_shape(sec, rel, add, top=False)
        depth = shape.depth if shape is not None else _given_depth(sec, top=False)
        if depth is not None and known:
            used.append((depth, _depth_name(sec, f"speculation.per_batch_bucket[{b}]")))
    depth = top.depth if top is not None else _given_depth(spec, top=True)
    if depth is not None and (batch is None or any(b not in overridden for b in batch)):
        used.insert(0, (depth, _depth_name(spec, "speculation")))  # first: it names a tie
    if used and batch is not None and len(used) == len(batch) and max(d for d, _ in used) == 0:
        add(("speculation", "per_batch_bucket"), "no batch bucket speculates (every shape has num_speculative_tokens "
                                                 "0); give at least one bucket a chain or a tree")
    return max(used, key=lambda u: u[0]) if used else None


def _raw_shape(sec: _RawSpeculation | _RawSpecSection) -> SpecShape:
    """The shape of a validated section (the checks above passed)."""
    tree = sec.tree
    if tree is not None and tree.choices is not None:
        shape = static_tree(tree.choices)
    elif not sec.num_speculative_tokens:
        shape = NO_SPECULATION
    elif tree is None:
        shape = chain(sec.num_speculative_tokens)
    else:
        shape = dynamic_tree(sec.num_speculative_tokens, tree.topk, tree.num_draft_tokens)
    return SpecShape.model_validate(shape.model_dump())  # static_tree constructs without validating


def unknown_option_message(name: str, key) -> str | None:
    """Why `key` is not a backend_options key of backend `name` (None if it is one)."""
    accepted = BACKEND_OPTIONS[name]
    if key in accepted:
        return None
    takes = f"it takes {', '.join(accepted)}" if accepted else "it takes no options"
    return f"unknown option {key!r} for backend {name} ({takes})"


def check_backend_options(name: str, options: dict | None) -> None:
    for key in options or {}:
        message = unknown_option_message(name, key)
        if message:
            raise UserError(f"backend_options.{key}: {message}")


def _check_backend_options(merged: dict, add: Callable[..., None]) -> None:
    backend, options = merged.get("backend", "export"), merged.get("backend_options")
    if backend in BACKENDS and isinstance(options, dict):
        for key in options:
            message = unknown_option_message(backend, key)
            if message:
                add(("backend_options", key), message)


def _speculation(raw: _RawPair, batch: list[int]) -> Speculation:
    """The speculation shape of every batch bucket: its per_batch_bucket entry, else the top-level section."""
    per = raw.speculation.per_batch_bucket or {}
    top = _raw_shape(raw.speculation) if any(b not in per for b in batch) else None
    shapes = {b: _raw_shape(per[b]) if b in per else top for b in batch}
    return Speculation(num_speculative_tokens=max(s.depth for s in shapes.values()), shapes=shapes)


def _build_pair(raw: _RawPair, target: SourceSpec, draft: SourceSpec) -> PairRecipe:
    mml = raw.serving.max_model_len
    mnbt = raw.serving.max_num_batched_tokens if raw.serving.max_num_batched_tokens is not None else mml
    batch = list(raw.buckets.batch) if raw.buckets.batch is not None else default_batch_buckets(raw.serving.max_num_seqs)
    return PairRecipe(
        name=raw.name,
        target=target,
        draft=draft,
        dtype=raw.dtype,
        speculation=_speculation(raw, batch),
        serving=Serving(max_num_seqs=raw.serving.max_num_seqs, max_model_len=mml, max_num_batched_tokens=mnbt),
        parallel=Parallel(tp_degree=raw.parallel.tp_degree, padded_hidden_size=raw.parallel.padded_hidden_size),
        buckets=Buckets(
            prefill=list(raw.buckets.prefill) if raw.buckets.prefill is not None else default_prefill_buckets(mnbt),
            batch=batch,
        ),
        backend=raw.backend,
        backend_options=dict(raw.backend_options),
        verify=VerifySettings(
            min_acceptance_length=raw.verify.min_acceptance_length,
            num_prompts=raw.verify.num_prompts,
            max_tokens=raw.verify.max_tokens,
            chat=raw.verify.chat,
        ),
    )


# ----------------------------------------------------------------------------------- loading


def _parse_yaml(text: str, file: str) -> tuple[Any, yaml.Node | None, list[RecipeIssue]]:
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None, []
        _check_expansion(node)  # before anything walks or constructs the aliased graph
        dups = _duplicate_keys(node)
        data = loader.construct_document(node)  # resolves merge keys (<<) in the node tree too
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        what = exc.problem or exc.context or "syntax error"
        if exc.problem and exc.context:
            ctx_line = f" started at line {exc.context_mark.line + 1}" if exc.context_mark else ""
            what += f" ({exc.context}{ctx_line})"
        line = mark.line + 1 if mark else None
        raise RecipeError([RecipeIssue(file, line, "<yaml>", f"invalid YAML: {what}")]) from exc
    except yaml.YAMLError as exc:
        raise RecipeError([RecipeIssue(file, None, "<yaml>", f"invalid YAML: {exc}")]) from exc
    except _YamlLimit as exc:
        raise RecipeError([RecipeIssue(file, exc.line, "<yaml>", exc.message)]) from exc
    finally:
        loader.dispose()
    dup_issues = [
        RecipeIssue(file, line, _fmt_key(path), f"duplicate key (first given at line {first}); each key may appear once")
        for path, first, line in dups
    ]
    return data, node, dup_issues


def _read_capped(path: Path, file: str) -> bytes:
    """The recipe's bytes; a file over MAX_RECIPE_BYTES is refused without reading the rest."""
    with open(path, "rb") as f:
        data = f.read(MAX_RECIPE_BYTES + 1)
        if len(data) > MAX_RECIPE_BYTES:
            size = max(os.fstat(f.fileno()).st_size, len(data))
            raise RecipeError([RecipeIssue(file, None, "<file>", f"recipe is {size} bytes, over the "
                                           f"{MAX_RECIPE_BYTES}-byte (1 MiB) cap; a recipe is a few kilobytes")])
    return data


def _load(path: Path, file: str) -> Recipe:
    try:
        data_bytes = _read_capped(path, file)
    except FileNotFoundError as exc:
        raise RecipeError([RecipeIssue(file, None, "<file>", "recipe file not found")]) from exc
    except IsADirectoryError as exc:
        raise RecipeError([RecipeIssue(file, None, "<file>", "is a directory, expected a recipe .yaml file")]) from exc
    except OSError as exc:
        why = f"cannot read recipe file: {exc.strerror or exc}"
        raise RecipeError([RecipeIssue(file, None, "<file>", why)]) from exc
    try:
        text = data_bytes.decode("utf-8")
    except UnicodeDecodeError as exc:
        why = f"not UTF-8 text ({exc.reason} at byte {exc.start})"
        raise RecipeError([RecipeIssue(file, None, "<file>", why)]) from exc

    data, node, dup_issues = _parse_yaml(text, file)
    if not isinstance(data, dict):
        raise RecipeError([RecipeIssue(file, 1, "<root>",
                                       f"the top level must be a mapping with keys {', '.join(_TOP_KEYS)}; got {_desc(data)}")])
    lines = _line_map(node)
    issues: list[RecipeIssue] = list(dup_issues)
    base_dir = Path(os.path.abspath(path)).parent

    for key in data:
        if key not in _TOP_KEYS:
            issues.append(RecipeIssue(file, _line_of(lines, (key,)), _fmt_key((key,)),
                                      f"unknown top-level key; allowed keys: {', '.join(_TOP_KEYS)}"))

    defaults = data.get("defaults")
    if defaults is None:
        defaults = {}
    elif not isinstance(defaults, dict):
        issues.append(RecipeIssue(file, _line_of(lines, ("defaults",)), "defaults",
                                  f"must be a mapping of pair settings, got {_desc(defaults)}"))
        defaults = {}

    pairs = data.get("pairs")
    if "pairs" not in data:
        issues.append(RecipeIssue(file, lines[()], "pairs", "required key is missing: give a non-empty list of pairs"))
        pairs = []
    elif not isinstance(pairs, list):
        issues.append(RecipeIssue(file, _line_of(lines, ("pairs",)), "pairs", f"must be a non-empty list of pairs, got {_desc(pairs)}"))
        pairs = []
    elif not pairs:
        issues.append(RecipeIssue(file, _line_of(lines, ("pairs",)), "pairs", "must not be empty: give at least one pair"))
    elif len(pairs) > MAX_PAIRS:
        issues.append(RecipeIssue(file, _line_of(lines, ("pairs",)), "pairs",
                                  f"{len(pairs)} pairs, at most {MAX_PAIRS}; split the recipe into several files"))
        pairs = []

    resolved: list[PairRecipe] = []
    names: dict[str, tuple[int, int | None]] = {}
    for i, item in enumerate(pairs):
        pair_abs = ("pairs", i)
        if not isinstance(item, dict):
            issues.append(RecipeIssue(file, _line_of(lines, pair_abs), _fmt_key(pair_abs),
                                      f"each entry of pairs must be a mapping, got {_desc(item)}"))
            continue
        merged = _deep_merge(defaults, item)
        n_before = len(issues)

        def add(rel: tuple, message: str, _item: dict = item, _pair_abs: tuple = pair_abs) -> None:
            origin = _origin(defaults, _item, _pair_abs, rel)
            if origin[0] == "defaults":
                if message.startswith("required key is missing"):
                    message += " (in a mapping given in defaults)"
                else:
                    message += " (from defaults)"
            issues.append(RecipeIssue(file, _line_of(lines, origin), _fmt_key(_pair_abs + rel), message))

        raw: _RawPair | None = None
        try:
            raw = _RawPair.model_validate(merged)
        except ValidationError as exc:
            for err in exc.errors():
                loc = tuple(err["loc"])
                if loc[-1:] == ("[key]",) and loc[:-2] == ("speculation", "per_batch_bucket"):
                    add(loc[:-1], "must be a batch bucket size (an integer key such as 1:), "
                                  f"got {_desc(err.get('input'))}")
                elif loc and loc[-1] == "[key]":  # a non-string key inside a free-form mapping
                    add(loc[:-1], f"mapping keys must be strings, got {_desc(err.get('input'))}")
                else:
                    add(loc, _pydantic_message(err, _RawPair))

        name = merged.get("name")
        if isinstance(name, str):
            if not NAME_RE.match(name):
                add(("name",), f"invalid pair name {name!r}: must match [A-Za-z0-9][A-Za-z0-9._-]* "
                               "(it names the bundle directory artifacts/<name>)")
            elif name in names:
                j, first_line = names[name]
                add(("name",), f"duplicate pair name {name!r} (already used by pairs[{j}] at line {first_line}); names must be unique")
            else:
                names[name] = (i, _line_of(lines, _origin(defaults, item, pair_abs, ("name",))))

        sources = {}
        for role in ("target", "draft"):
            if role in merged:
                sources[role] = _resolve_source(merged[role], base_dir, (role,), add)
        _check_buckets(merged, add, _check_speculation(merged, add))
        _check_backend_options(merged, add)

        if raw is not None and len(issues) == n_before and all(sources.get(r) for r in ("target", "draft")):
            resolved.append(_build_pair(raw, sources["target"], sources["draft"]))

    if issues:
        issues.sort(key=lambda x: (x.line is None, x.line or 0))
        raise RecipeError(issues)
    return Recipe(path=str(Path(os.path.abspath(path))), sha256=hashlib.sha256(data_bytes).hexdigest(), pairs=resolved)


def load_recipe(path: str | Path) -> Recipe:
    """Load, validate and resolve a recipe file; raises :class:`RecipeError` listing every problem."""
    file = str(path)
    try:
        return _load(Path(path), file)
    except RecipeError:
        raise
    except Exception as exc:  # never let a traceback reach the user
        why = f"could not load recipe: {type(exc).__name__}: {exc}"
        raise RecipeError([RecipeIssue(file, None, "<file>", why)]) from exc


def select_pair(recipe: Recipe, name: str | None) -> list[PairRecipe]:
    """All pairs for ``name=None``, else the one pair called ``name`` (RecipeError listing the names if unknown)."""
    if name is None:
        return list(recipe.pairs)
    for pair in recipe.pairs:
        if pair.name == name:
            return [pair]
    known = ", ".join(p.name for p in recipe.pairs) or "(none)"
    raise RecipeError([RecipeIssue(recipe.path, None, "pair", f"unknown pair {name!r}; pairs in this recipe: {known}")])
