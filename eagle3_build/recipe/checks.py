"""The recipe's rules beyond its schema: sources, buckets, speculation shapes (chains, trees, one per
batch bucket, a menu of more), backend options, and a checked pair built into a PairRecipe."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable

from pydantic import ValidationError

from eagle3_runtime.backends.facts import BACKENDS, DEFAULT_BACKEND, backend_facts
from eagle3_runtime.graph_contract import min_max_model_len
from eagle3_runtime.speculation import (MAX_DEPTH, MAX_MENU, MAX_NODES, NO_SPECULATION, SpecShape, all_shapes, chain,
                                        choices_problems, dynamic_tree, static_tree, tree_problems)

from ..default_buckets import default_batch_buckets
from ..errors import UserError
from .schema import (PairRecipe, RawPair, RawSource, RawSpecSection, RawSpeculation, SourceSpec, Speculation,
                     describe_value, get_path, is_int, issue_at, pos_int, pydantic_message)

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")
HF_RE = re.compile(r"hf://([A-Za-z0-9][A-Za-z0-9._-]*)/([A-Za-z0-9][A-Za-z0-9._-]*)(?:@([^\s@]+))?\Z")
_SCHEME_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_SOURCE_FORMS = (
    "a local checkpoint directory, hf://org/name[@revision], a path to a .gguf file, "
    "or a mapping with keys source, gguf_file, allow_pickle"
)


def resolve_source(value: Any, base_dir: Path, rel: tuple, add: Callable[..., None]) -> SourceSpec | None:
    """Normalise one target/draft entry; reports problems through ``add`` and returns None if any."""
    fields = _source_fields(value, rel, add)
    if fields is None:
        return None
    uri, gguf_file, allow_pickle, src_rel, ok = fields
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
        return SourceSpec(uri=uri, kind="hf", repo_id=f"{m.group(1)}/{m.group(2)}", revision=m.group(3) or "main",
                          gguf_file=gguf_file, allow_pickle=allow_pickle) if ok else None
    if _SCHEME_RE.match(uri):
        add(src_rel, f"unsupported source {uri!r}: use a local path, hf://org/name[@revision] or a .gguf file")
        return None
    return _local_source(uri, gguf_file, allow_pickle, base_dir, rel, src_rel, add, ok)


def _source_fields(value: Any, rel: tuple, add: Callable[..., None]) -> tuple | None:
    """(uri, gguf_file, allow_pickle, the uri's path in the recipe, whether the entry validated) of a string or
    mapping entry; None where no uri can be read from it."""
    if isinstance(value, str):
        return value, None, False, rel, True
    if not isinstance(value, dict):
        add(rel, f"must be {_SOURCE_FORMS}; got {describe_value(value)}")
        return None
    try:
        raw = RawSource.model_validate(value)
    except ValidationError as exc:
        for err in exc.errors():
            add(rel + tuple(err["loc"]), pydantic_message(err, RawSource))
        # keep checking what is usable so that every problem is reported at once
        uri, gguf_file = value.get("source"), value.get("gguf_file")
        return (uri, gguf_file if isinstance(gguf_file, str) else None, False, rel + ("source",), False) \
            if isinstance(uri, str) else None
    return raw.source, raw.gguf_file, raw.allow_pickle, rel + ("source",), True


def _local_source(uri: str, gguf_file: str | None, allow_pickle: bool, base_dir: Path, rel: tuple, src_rel: tuple,
                  add: Callable[..., None], ok: bool) -> SourceSpec | None:
    """A local directory, a .gguf file, or a .gguf file in a directory (relative paths against the recipe's);
    None where a problem was reported (`ok`: none was before)."""
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


def check_buckets(merged: dict, add: Callable[..., None], deepest: tuple[int, str] | None) -> None:
    """Bucket list shape and their relation to serving limits (only on values of valid type).

    ``deepest``: (depth, the key that gives it) of the deepest speculation shape in use (None: unknown)."""
    k, k_name = deepest if deepest is not None else (None, "")
    mml = pos_int(get_path(merged, "serving", "max_model_len"))
    serving = merged.get("serving") if isinstance(merged.get("serving"), dict) else {}
    mns = pos_int(serving.get("max_num_seqs", 1))
    mnbt_raw = serving.get("max_num_batched_tokens")
    mnbt = pos_int(mnbt_raw)

    if mml is not None and k is not None and mml < min_max_model_len(k):
        why = "" if k_name == _TOP_DEPTH else ", the deepest speculation shape"
        add(("serving", "max_model_len"), f"must be greater than {k_name} + 1 ({k + 1}{why}), got {mml}; "
                                          f"raise it to at least {min_max_model_len(k)}")
    if mml is not None and mnbt is not None and mnbt > mml:
        add(("serving", "max_num_batched_tokens"), f"must be <= serving.max_model_len ({mml}), got {mnbt}")

    for kind in ("prefill", "batch", "context"):
        lst = get_path(merged, "buckets", kind)
        if not isinstance(lst, list) or not all(is_int(b) for b in lst):
            continue  # absent/null -> default; wrong types are reported by the schema
        rel = ("buckets", kind)
        if not lst and kind == "context":
            continue  # (no context buckets: the decode loop attends over the whole cache)
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
            elif kind == "context" and mml is not None and b >= mml:
                add(rel + (i,), f"context bucket {b} must be below serving.max_model_len ({mml}): the graphs over "
                                "the whole KV cache are always built; drop it")
            elif kind == "context" and k is not None and b < min_max_model_len(k):
                add(rel + (i,), f"context bucket {b} is below {min_max_model_len(k)} (a verify's {k_name} + 1 KV slots "
                                "past the pending one); raise it or drop it")
            elif kind == "batch" and mns is not None and b > mns:
                add(rel + (i,), f"batch bucket {b} exceeds serving.max_num_seqs ({mns}); its graphs could never "
                                "run (a batch holds at most max_num_seqs sequences)")
        if not good:
            continue
        if kind == "batch" and mns is not None and lst[-1] < mns:
            add(rel, f"largest batch bucket ({lst[-1]}) is smaller than serving.max_num_seqs ({mns}); add a bucket >= {mns}")

    mal = get_path(merged, "verify", "min_acceptance_length")
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
        good = isinstance(lst, list) and lst and all(is_int(b) and b >= 1 for b in lst)
        return (lst, "buckets.batch") if good and all(a < b for a, b in zip(lst, lst[1:])) else None
    serving = merged.get("serving")
    mns = pos_int(serving.get("max_num_seqs", 1)) if isinstance(serving, dict) else None
    if mns is None:
        return None
    return default_batch_buckets(mns), f"the default for serving.max_num_seqs {mns}"


def _choices_shape(choices: Any, rel: tuple, add: Callable[..., None]) -> SpecShape | None:
    """The static tree of ``choices`` (TensorRT-LLM eagle_choices), each bad path reported at its item
    (speculation.choices_problems: the rules the runtime holds a manifest to)."""
    if not isinstance(choices, list) or not all(
            isinstance(c, list) and all(is_int(r) and 0 <= r < MAX_NODES for r in c) for c in choices):
        return None  # the schema reports it
    problems = choices_problems(choices)
    for where, message in problems:
        add(rel if where is None else rel + (where,), message)
    return None if problems else static_tree(choices)


def _section_shape(sec: Any, rel: tuple, add: Callable[..., None], *, top: bool) -> SpecShape | None:
    """The shape of one speculation section (``speculation`` or a ``per_batch_bucket`` entry) from the merged
    YAML values, reporting its cross-key problems; None where it is unknown (a problem was reported, here
    or by the schema)."""
    if not isinstance(sec, dict):
        return None
    drel, trel = rel + ("num_speculative_tokens",), rel + ("tree",)
    d = sec.get("num_speculative_tokens")
    d_given = d is not None
    d_ok = is_int(d) and d >= (1 if top else 0)  # else the schema reports it
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
    k_ok = is_int(topk) and topk >= 1
    if k_ok and topk > MAX_NODES:
        add(trel + ("topk",), f"must be <= {MAX_NODES} (a verify pass holds at most MAX_NODES = {MAX_NODES} nodes), "
                              f"got {topk}")
        k_ok = False
    n_ok = is_int(n) and n >= 1
    if n_ok and n > MAX_NODES:
        add(trel + ("num_draft_tokens",), f"must be <= {MAX_NODES} (a verify pass holds at most MAX_NODES = "
                                          f"{MAX_NODES} nodes, the root included), got {n}")
        n_ok = False
    if not (d_ok and k_ok and n_ok):
        return None
    problems = tree_problems(d, topk, n)  # (the rules the runtime holds a manifest to)
    for key, message in problems:
        add(drel if key == "num_speculative_tokens" else trel + (key,), message)
    return None if problems else dynamic_tree(d, topk, n)


def _given_depth(sec: Any, top: bool) -> int | None:
    """A section's valid num_speculative_tokens: its depth even where the rest of its shape is wrong."""
    d = sec.get("num_speculative_tokens") if isinstance(sec, dict) else None
    return d if is_int(d) and (1 if top else 0) <= d <= MAX_DEPTH else None


def _depth_name(sec: dict, prefix: str) -> str:
    return f"{prefix}.num_speculative_tokens" if sec.get("num_speculative_tokens") is not None else (
        f"the depth of {prefix}.tree.choices")


def check_speculation(merged: dict, add: Callable[..., None]) -> tuple[int, str] | None:
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
        if not is_int(b):
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
    used += _check_menu(spec.get("menu"), add)
    return max(used, key=lambda u: u[0]) if used else None


AUTO_MENU = tuple(chain(k) for k in (1, 2, 3, 4))  # `menu: auto`: the chains vLLM users sweep K over


def _check_menu(menu: Any, add: Callable[..., None]) -> list[tuple[int, str]]:
    """``speculation.menu``'s problems; (depth, key) of each entry with a known depth."""
    rel = ("speculation", "menu")
    if menu is None or menu == "auto":
        return [(max(s.depth for s in AUTO_MENU), "speculation.menu (auto)")] if menu else []
    if not isinstance(menu, list) or not menu:
        add(rel, f"must be auto or a non-empty list of shapes (each like a speculation section: "
                 f"num_speculative_tokens, tree), got {describe_value(menu)}")
        return []
    if len(menu) > MAX_MENU:
        add(rel, f"{len(menu)} shapes, at most {MAX_MENU}; keep the ones worth compiling")
        return []
    used, seen = [], {}
    for i, sec in enumerate(menu):
        at = rel + (i,)
        try:
            RawSpecSection.model_validate(sec)
        except ValidationError as e:
            for err in e.errors():
                add(at + tuple(err["loc"]), pydantic_message(err, RawSpecSection))
            continue
        if sec.get("num_speculative_tokens") == 0:
            add(at + ("num_speculative_tokens",), "must be >= 1: plain decoding is always on the menu; drop this "
                                                  "entry")
            continue
        shape = _section_shape(sec, at, add, top=True)
        if shape is None:
            continue
        if shape.tag in seen:
            add(at, f"{shape.describe()} is already speculation.menu[{seen[shape.tag]}]; list each shape once")
        seen.setdefault(shape.tag, i)
        used.append((shape.depth, _depth_name(sec, f"speculation.menu[{i}]")))
    return used


def _menu(raw: RawSpeculation, shapes: dict[int, SpecShape]) -> dict[int, list[SpecShape]]:
    """Each speculating batch bucket's menu: the recipe's shapes other than its own."""
    if raw.menu is None:
        return {}
    listed = list(AUTO_MENU) if raw.menu == "auto" else [_raw_shape(RawSpecSection.model_validate(s))
                                                         for s in raw.menu]
    return {b: [s for s in listed if s.tag != own.tag] for b, own in shapes.items()
            if own.speculates and any(s.tag != own.tag for s in listed)}


def _raw_shape(sec: RawSpeculation | RawSpecSection) -> SpecShape:
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
    """Why `key` is not a backend_options key of backend `name` (None if it is one); checked here with the
    recipe line, and by get_backend."""
    accepted = backend_facts(name).options
    if key in accepted:
        return None
    takes = f"it takes {', '.join(accepted)}" if accepted else "it takes no options"
    return f"unknown option {key!r} for backend {name} ({takes})"


# ----------------------------------------------------------------------- against the target's config


def target_positions(config: dict) -> tuple[int, str] | None:
    """The most positions the target supports and where that comes from: its config's max_position_embeddings,
    times the rope_scaling factor of a scaling that extends it at run time (yarn: of its original length,
    linear, dynamic; as vLLM reads it); None where the config gives none."""
    mpe = config.get("max_position_embeddings")
    if not is_int(mpe) or mpe < 1:
        return None
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = (rope.get("rope_type") or rope.get("type")) if isinstance(rope, dict) else None
    factor = rope.get("factor") if isinstance(rope, dict) else None
    if kind in ("yarn", "linear", "dynamic") and isinstance(factor, (int, float)) and 1 <= factor <= 1024:
        base = rope.get("original_max_position_embeddings") if kind == "yarn" else None
        base = base if is_int(base) and base >= 1 else mpe
        return max(mpe, int(base * factor)), f"max_position_embeddings with its {kind} rope_scaling (factor {factor:g})"
    return mpe, "max_position_embeddings"


def check_target_limits(pair: PairRecipe, config: dict) -> None:
    """serving.max_model_len within the positions the target supports (RecipeError at its line)."""
    limit = target_positions(config)
    mml = pair.serving.max_model_len
    if limit is not None and mml > limit[0]:
        raise issue_at(pair, ("serving", "max_model_len"),
                       f"{mml} is more than the target supports: {limit[0]} positions ({limit[1]} in its "
                       f"config.json); lower it to at most {limit[0]}")


def check_backend_options(name: str, options: dict | None) -> None:
    for key in options or {}:
        message = unknown_option_message(name, key)
        if message:
            raise UserError(f"backend_options.{key}: {message}")


def check_pair_backend_options(merged: dict, add: Callable[..., None]) -> None:
    backend, options = merged.get("backend", DEFAULT_BACKEND), merged.get("backend_options")
    if backend in BACKENDS and isinstance(options, dict):
        for key in options:
            message = unknown_option_message(backend, key)
            if message:
                add(("backend_options", key), message)


def _speculation(raw: RawPair, batch: list[int]) -> Speculation:
    """The speculation shape of every batch bucket: its per_batch_bucket entry, else the top-level section."""
    per = raw.speculation.per_batch_bucket or {}
    top = _raw_shape(raw.speculation) if any(b not in per for b in batch) else None
    shapes = {b: _raw_shape(per[b]) if b in per else top for b in batch}
    menu = _menu(raw.speculation, shapes)
    return Speculation(num_speculative_tokens=max(s.depth for s in all_shapes(shapes, menu)), shapes=shapes,
                       menu=menu, accept=raw.speculation.accept, unroll_draft=raw.speculation.unroll_draft)


def build_pair(raw: RawPair, target: SourceSpec, draft: SourceSpec) -> PairRecipe:
    return PairRecipe(
        name=raw.name,
        target=target,
        draft=draft,
        dtype=raw.dtype,
        speculation=_speculation(raw, raw.buckets.batch),
        serving=raw.serving,
        parallel=raw.parallel,
        buckets=raw.buckets,
        backend=raw.backend,
        backend_options=dict(raw.backend_options),
        verify=raw.verify,
    )


