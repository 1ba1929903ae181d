"""The recipe's data: the frozen models a loaded recipe is made of, the schema its YAML is checked against
(unknown keys refused; a section whose YAML is already its final form — serving, parallel, buckets, verify —
is its own schema, defaults drawn from other keys filled in before validation; the `Raw*` models only hold
the two sections the loader resolves into another form: a source string into a location, a speculation
section into one SpecShape per batch bucket), its errors, and how a pydantic error reads as a recipe line."""
from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from eagle3_runtime.backends.facts import BACKENDS, DEFAULT_BACKEND
from eagle3_runtime.graph_contract import ACCEPT
from eagle3_runtime.manifest import MAX_DIM, MODEL_DTYPES
from eagle3_runtime.speculation import MAX_NODES, SpecShape, all_shapes

from ..default_buckets import default_batch_buckets, default_prefill_buckets
from ..errors import UserError


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


class KeyLines(dict):
    """Where a loaded pair's keys are in its recipe: {key path: RecipeIssue holding the message's suffix}, for
    problems found after loading (`issue_at`). Not part of the pair's value: any two compare equal."""

    def __eq__(self, other) -> bool:
        return isinstance(other, KeyLines)

    __hash__ = None


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
    num_speculative_tokens: int  # the deepest shape's depth (menus too)
    shapes: dict[int, SpecShape]  # per batch bucket (speculation.SpecShape)
    menu: dict[int, list[SpecShape]] = {}  # per speculating batch bucket: more shapes (manifest.Manifest.menu)
    accept: Literal[ACCEPT] = "graph"  # type: ignore[valid-type]  # greedy acceptance (manifest.Manifest.accept)
    unroll_draft: bool = True  # chains draft in one graph call (manifest.Manifest.unroll_draft)

    def scratch(self) -> int:
        return max(s.scratch for s in all_shapes(self.shapes, self.menu))


class _Section(_Frozen):
    """A recipe section that is its own schema: YAML types as written (strict: `true` is not 1)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


MAX_COUNT = 1 << 24  # sequences, positions, ranks: the most a bundle's manifest records (manifest.Count)
MAX_BUCKETS = 64  # entries of a bucket list (the manifest's cap)
MAX_PROMPTS = 100_000  # verify.num_prompts


class Serving(_Section):
    max_num_seqs: int = Field(1, ge=1, le=MAX_COUNT)
    max_model_len: int = Field(ge=1, le=MAX_COUNT)
    max_num_batched_tokens: int = Field(ge=1, le=MAX_COUNT)  # default: max_model_len (RawPair fills it in)


class Parallel(_Section):
    tp_degree: int = Field(1, ge=1, le=MAX_COUNT)
    padded_hidden_size: int | None = Field(None, ge=1, le=MAX_DIM)


class Buckets(_Section):
    # defaults (default_buckets.py, filled in by RawPair): doublings up to the serving limits
    prefill: list[int] = Field(max_length=MAX_BUCKETS)
    batch: list[int] = Field(max_length=MAX_BUCKETS)
    # KV slots the decode loop's target graphs also read only (NxDI's token-generation buckets): per entry c,
    # target_decode and target_verify graphs over slots 0..c-1, called while a batch's rows fit in c
    context: list[int] = Field([], max_length=MAX_BUCKETS)


class VerifySettings(_Section):
    """The pair's ``verify`` section. These defaults are the only ones: ``eagle3-build verify`` (for a
    manifest whose recipe lacks a key) takes them from here too."""

    min_acceptance_length: float | None = Field(None, ge=1)  # the gate; None: no gate
    num_prompts: int = Field(4, ge=0, le=MAX_PROMPTS)  # 0: compile skips verify
    max_tokens: int = Field(32, ge=1, le=MAX_COUNT)  # per prompt
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
    _lines: KeyLines = PrivateAttr(default_factory=KeyLines)  # (set by the loader; `issue_at` reads it)


class Recipe(_Frozen):
    path: str  # absolute path of the recipe file
    sha256: str  # of the file bytes
    pairs: list[PairRecipe]


# ------------------------------------------------------------------ input schema (what YAML holds)


class Raw(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class RawSource(Raw):
    source: str
    gguf_file: str | None = None
    allow_pickle: bool = False


class RawTree(Raw):
    """``speculation.tree``: a dynamic tree (topk + num_draft_tokens) or a static one (choices)."""

    # the upper bounds (MAX_NODES, max_tree_nodes) are checked by _section_shape, which says why
    topk: int | None = Field(None, ge=1)  # children per expanded node
    num_draft_tokens: int | None = Field(None, ge=1)  # nodes verified per pass, the root included
    # TensorRT-LLM eagle_choices: each path of child ranks names one node (rank < MAX_NODES keeps topk <= MAX_NODES)
    choices: list[list[Annotated[int, Field(ge=0, le=MAX_NODES - 1)]]] | None = None


class RawSpecSection(Raw):
    """One ``speculation.per_batch_bucket`` entry: a whole shape (0 steps: no speculation there)."""

    num_speculative_tokens: int | None = Field(None, ge=0)  # None: only with tree.choices; <= MAX_DEPTH
    tree: RawTree | None = None


class RawSpeculation(Raw):
    num_speculative_tokens: int | None = Field(None, ge=1)  # None: only with tree.choices; <= MAX_DEPTH
    tree: RawTree | None = None
    per_batch_bucket: dict[int, RawSpecSection] | None = None
    # more shapes for every speculating batch bucket, chosen among on the serving host (--speculation auto):
    # "auto" (checks.AUTO_MENU) or a list of sections (chains or trees); checked by check_speculation
    menu: Any = None
    # where greedy rows accept: "graph" (in the verify graph: a few integers per row come back) or "host" (from the
    # full logits); sampled rows always accept on the host
    accept: Literal[ACCEPT] = "graph"  # type: ignore[valid-type]
    # chains run their depth - 1 draft steps in one graph call (draft_chain) instead of one call each
    unroll_draft: bool = True


class RawPair(Raw):
    name: str
    target: Any  # checked by resolve_source (str or mapping)
    draft: Any
    dtype: Literal[MODEL_DTYPES] = "bfloat16"  # type: ignore[valid-type]
    speculation: RawSpeculation
    serving: Serving
    parallel: Parallel = Parallel()
    buckets: Buckets
    backend: Literal[BACKENDS] = DEFAULT_BACKEND  # type: ignore[valid-type]
    backend_options: dict[str, Any] = Field(default_factory=dict)
    verify: VerifySettings = VerifySettings()

    @model_validator(mode="before")
    @classmethod
    def _defaults_from_serving(cls, data: Any) -> Any:
        """serving.max_num_batched_tokens defaults to max_model_len; buckets.prefill to doublings up to it,
        buckets.batch to doublings up to max_num_seqs. A default whose source key is invalid is [1] / 1: that
        key's own error is the one reported."""
        if not isinstance(data, dict) or not isinstance(data.get("serving"), dict):
            return data
        serving = dict(data["serving"])
        if serving.get("max_num_batched_tokens") is None:
            serving["max_num_batched_tokens"] = count(serving.get("max_model_len")) or 1
        buckets = data.get("buckets", {})
        if not isinstance(buckets, dict):
            return {**data, "serving": serving}
        buckets = dict(buckets)
        if buckets.get("prefill") is None:
            buckets["prefill"] = default_prefill_buckets(count(serving["max_num_batched_tokens"]) or 1)
        if buckets.get("batch") is None:
            buckets["batch"] = default_batch_buckets(count(serving.get("max_num_seqs", 1)) or 1)
        return {**data, "serving": serving, "buckets": buckets}


# -------------------------------------------------------------------------------- helpers


def issue_at(pair: PairRecipe, rel: tuple, message: str) -> RecipeError:
    """A problem found after loading (against the target's config, this host's memory), reported like the loader's
    own: at the key's line in the recipe (`file:line: pairs[i].serving.max_model_len: message`)."""
    at = pair._lines.get(rel)
    if at is None:  # (a pair not read from a recipe file)
        return RecipeError([RecipeIssue(f"pair {pair.name}", None, fmt_key(rel), message)])
    return RecipeError([RecipeIssue(at.file, at.line, at.key, message + at.message)])


def fmt_key(path: tuple) -> str:
    out = ""
    for part in path:
        if isinstance(part, int) and not isinstance(part, bool):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def describe_value(value: Any) -> str:
    """Describe a YAML value with its YAML type, e.g. ``string '3'``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, int):
        if abs(value) >= 10**20:  # (no int->str of thousands of digits)
            return f"integer {'-' if value < 0 else ''}of about {int(abs(value).bit_length() * 0.30103) + 1} digits"
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


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def pos_int(v: Any) -> int | None:
    return v if is_int(v) and v >= 1 else None


def count(v: Any) -> int | None:
    """A valid count of sequences, positions or ranks (1..MAX_COUNT), else None."""
    return v if is_int(v) and 1 <= v <= MAX_COUNT else None


def get_path(d: Any, *keys: str) -> Any:
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


def pydantic_message(err: dict, model: type[BaseModel]) -> str:
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
        return f"must be an integer, got {describe_value(inp)}"
    if typ in ("float_type", "float_parsing"):
        return f"must be a number, got {describe_value(inp)}"
    if typ in ("bool_type", "bool_parsing"):
        return f"must be true or false, got {describe_value(inp)}"
    if typ in ("string_type", "string_sub_type"):
        return f"must be a string, got {describe_value(inp)}"
    if typ == "list_type":
        return f"must be a list, got {describe_value(inp)}"
    if typ == "dict_type" and loc[-1:] == ("per_batch_bucket",):
        return (f"must be a mapping of batch bucket sizes to sections with keys "
                f"{', '.join(RawSpecSection.model_fields)}, got {describe_value(inp)}")
    if typ in ("dict_type", "model_type", "model_attributes_type"):
        sub = _model_at(model, loc)
        keys = f" with keys {', '.join(sub.model_fields)}" if sub else ""
        return f"must be a mapping{keys}, got {describe_value(inp)}"
    if typ == "literal_error":
        return f"must be one of {ctx.get('expected')}, got {describe_value(inp)}"
    if typ == "greater_than_equal":
        return f"must be >= {ctx.get('ge')}, got {describe_value(inp)}"
    if typ == "less_than_equal":
        return f"must be <= {ctx.get('le')}, got {describe_value(inp)}"
    if typ == "too_long":
        return f"must have at most {ctx.get('max_length')} entries, got {ctx.get('actual_length')}"
    if typ == "greater_than":
        return f"must be > {ctx.get('gt')}, got {describe_value(inp)}"
    return f"{err['msg']}, got {describe_value(inp)}"


