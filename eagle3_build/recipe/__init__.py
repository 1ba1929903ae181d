"""Recipe loading: YAML file -> validated, fully resolved :class:`Recipe`.

A recipe pairs target models with EAGLE3 drafts (see ``recipes/*.yaml``).  ``load_recipe``
collects every problem of a file and raises one :class:`RecipeError` listing them all, each with
the file, the 1-based line, the dotted key path and what is allowed.  Nothing else escapes it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from pydantic import ValidationError

from eagle3_runtime.graph_contract import min_max_model_len

from .schema import (PairRecipe, Recipe, RecipeError, RecipeIssue, SourceSpec, Speculation, Serving,
    Parallel, Buckets, VerifySettings, VERIFY_DEFAULTS, RawPair, KeyLines, MAX_COUNT, MAX_PROMPTS, describe_value,
    fmt_key, issue_at, pydantic_message)
from .yaml_io import (MAX_PAIRS, deep_merge, line_map, line_of, origin_of, parse_yaml, read_capped,
    MAX_RECIPE_BYTES, MAX_YAML_NODES)
from .checks import (NAME_RE, build_pair, check_pair_backend_options, check_buckets, check_speculation,
    resolve_source, check_backend_options, check_target_limits, target_positions)

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
    "check_backend_options",
    "check_target_limits",
    "issue_at",
    "load_recipe",
    "MAX_COUNT",
    "MAX_PROMPTS",
    "MAX_RECIPE_BYTES",
    "MAX_YAML_NODES",
    "min_max_model_len",
    "select_pair",
    "target_positions",
]


_TOP_KEYS = ("defaults", "pairs")


def _load(path: Path, file: str) -> Recipe:
    data_bytes = _read(path, file)
    data, node, dup_issues = parse_yaml(data_bytes.decode("utf-8"), file)
    if not isinstance(data, dict):
        raise RecipeError([RecipeIssue(file, 1, "<root>",
                                       f"the top level must be a mapping with keys {', '.join(_TOP_KEYS)}; got {describe_value(data)}")])
    lines = line_map(node)
    issues: list[RecipeIssue] = list(dup_issues)
    defaults, pairs = _top_level(data, lines, file, issues)
    base_dir = Path(os.path.abspath(path)).parent
    resolved: list[PairRecipe] = []
    names: dict[str, tuple[int, int | None]] = {}
    for i, item in enumerate(pairs):
        pair = _load_pair(i, item, defaults, lines, file, base_dir, names, issues)
        if pair is not None:
            resolved.append(pair)
    if issues:
        issues.sort(key=lambda x: (x.line is None, x.line or 0))
        raise RecipeError(issues)
    return Recipe(path=str(Path(os.path.abspath(path))), sha256=hashlib.sha256(data_bytes).hexdigest(), pairs=resolved)


def _read(path: Path, file: str) -> bytes:
    """The recipe's bytes, UTF-8 checked; one issue naming the file otherwise."""
    try:
        data_bytes = read_capped(path, file)
    except FileNotFoundError as exc:
        raise RecipeError([RecipeIssue(file, None, "<file>", "recipe file not found")]) from exc
    except IsADirectoryError as exc:
        raise RecipeError([RecipeIssue(file, None, "<file>", "is a directory, expected a recipe .yaml file")]) from exc
    except OSError as exc:
        why = f"cannot read recipe file: {exc.strerror or exc}"
        raise RecipeError([RecipeIssue(file, None, "<file>", why)]) from exc
    try:
        data_bytes.decode("utf-8")
    except UnicodeDecodeError as exc:
        why = f"not UTF-8 text ({exc.reason} at byte {exc.start})"
        raise RecipeError([RecipeIssue(file, None, "<file>", why)]) from exc
    return data_bytes


def _top_level(data: dict, lines, file: str, issues: list[RecipeIssue]) -> tuple[dict, list]:
    """`defaults` and `pairs`, each checked for its shape (an empty stand-in where it is wrong)."""
    for key in data:
        if key not in _TOP_KEYS:
            issues.append(RecipeIssue(file, line_of(lines, (key,)), fmt_key((key,)),
                                      f"unknown top-level key; allowed keys: {', '.join(_TOP_KEYS)}"))
    defaults = data.get("defaults")
    if defaults is None:
        defaults = {}
    elif not isinstance(defaults, dict):
        issues.append(RecipeIssue(file, line_of(lines, ("defaults",)), "defaults",
                                  f"must be a mapping of pair settings, got {describe_value(defaults)}"))
        defaults = {}
    pairs = data.get("pairs")
    if "pairs" not in data:
        issues.append(RecipeIssue(file, lines[()], "pairs", "required key is missing: give a non-empty list of pairs"))
        pairs = []
    elif not isinstance(pairs, list):
        issues.append(RecipeIssue(file, line_of(lines, ("pairs",)), "pairs", f"must be a non-empty list of pairs, got {describe_value(pairs)}"))
        pairs = []
    elif not pairs:
        issues.append(RecipeIssue(file, line_of(lines, ("pairs",)), "pairs", "must not be empty: give at least one pair"))
    elif len(pairs) > MAX_PAIRS:
        issues.append(RecipeIssue(file, line_of(lines, ("pairs",)), "pairs",
                                  f"{len(pairs)} pairs, at most {MAX_PAIRS}; split the recipe into several files"))
        pairs = []
    return defaults, pairs


def _load_pair(i: int, item, defaults: dict, lines, file: str, base_dir: Path,
               names: dict[str, tuple[int, int | None]], issues: list[RecipeIssue]) -> PairRecipe | None:
    """pairs[i] merged over the defaults, validated and resolved; None (with its issues added) when wrong."""
    pair_abs = ("pairs", i)
    if not isinstance(item, dict):
        issues.append(RecipeIssue(file, line_of(lines, pair_abs), fmt_key(pair_abs),
                                  f"each entry of pairs must be a mapping, got {describe_value(item)}"))
        return None
    merged = deep_merge(defaults, item)
    n_before = len(issues)

    def add(rel: tuple, message: str) -> None:
        origin = origin_of(defaults, item, pair_abs, rel)
        if origin[0] == "defaults":
            if message.startswith("required key is missing"):
                message += " (in a mapping given in defaults)"
            else:
                message += " (from defaults)"
        issues.append(RecipeIssue(file, line_of(lines, origin), fmt_key(pair_abs + rel), message))

    def where(rel: tuple) -> RecipeIssue:  # (for problems found after loading: schema.issue_at)
        origin = origin_of(defaults, item, pair_abs, rel)
        return RecipeIssue(file, line_of(lines, origin), fmt_key(pair_abs + rel),
                           " (from defaults)" if origin[0] == "defaults" else "")

    raw: RawPair | None = None
    try:
        raw = RawPair.model_validate(merged)
    except ValidationError as exc:
        for err in exc.errors():
            loc = tuple(err["loc"])
            if loc[-1:] == ("[key]",) and loc[:-2] == ("speculation", "per_batch_bucket"):
                add(loc[:-1], "must be a batch bucket size (an integer key such as 1:), "
                              f"got {describe_value(err.get('input'))}")
            elif loc and loc[-1] == "[key]":  # a non-string key inside a free-form mapping
                add(loc[:-1], f"mapping keys must be strings, got {describe_value(err.get('input'))}")
            else:
                add(loc, pydantic_message(err, RawPair))

    name = merged.get("name")
    if isinstance(name, str):
        if not NAME_RE.match(name):
            add(("name",), f"invalid pair name {name!r}: must match [A-Za-z0-9][A-Za-z0-9._-]* "
                           "(it names the bundle directory artifacts/<name>)")
        elif name in names:
            j, first_line = names[name]
            add(("name",), f"duplicate pair name {name!r} (already used by pairs[{j}] at line {first_line}); names must be unique")
        else:
            names[name] = (i, line_of(lines, origin_of(defaults, item, pair_abs, ("name",))))

    sources = {role: resolve_source(merged[role], base_dir, (role,), add) for role in ("target", "draft")
               if role in merged}
    check_buckets(merged, add, check_speculation(merged, add))
    check_pair_backend_options(merged, add)
    if raw is not None and len(issues) == n_before and all(sources.get(r) for r in ("target", "draft")):
        pair = build_pair(raw, sources["target"], sources["draft"])
        pair._lines = KeyLines({rel: where(rel) for rel in LATER_CHECKED})
        return pair
    return None


# the keys checked after loading, against the target's config and this host (schema.issue_at)
LATER_CHECKED = (("serving", "max_model_len"), ("serving", "max_num_seqs"), ("parallel", "tp_degree"))


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
