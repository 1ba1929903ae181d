"""Reading a recipe file: size-capped, parsed with bounded nodes / depth / alias expansion, duplicate keys
found, every key path mapped to its 1-based line (a default merged into a pair keeps its origin)."""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import yaml

from .schema import RecipeError, RecipeIssue, fmt_key, is_int


# Hostile-input bounds (a real recipe is a few KB, a few hundred nodes, nested ~5 deep)
MAX_RECIPE_BYTES = 1 << 20  # refused before parsing
MAX_YAML_NODES = 100_000  # counted with every alias expanded (billion laughs)
MAX_YAML_DEPTH = 64
MAX_PAIRS = 100  # defaults are merged into every pair: this bounds that work too
MAX_INT = 2**63 - 1  # a recipe's numbers are far smaller; past this an int is refused where it is written

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


def line_map(root: yaml.Node) -> dict[tuple, int]:
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


def line_of(lines: dict[tuple, int], path: tuple) -> int | None:
    """Line of ``path``, or of its closest enclosing key that exists in the file.

    An int is a list index or an int mapping key (per_batch_bucket's ``1:``, in ``lines`` by its text)."""
    found: tuple = ()
    line = lines.get(())
    for part in path:
        cand = found + (part,)
        if cand not in lines and is_int(part):
            cand = found + (str(part),)
        if cand not in lines:
            break
        found, line = cand, lines[cand]
    return line


def deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if k in out and isinstance(out[k], dict) and isinstance(v, dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def origin_of(defaults: dict, pair: dict, pair_abs: tuple, rel: tuple) -> tuple:
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


def _number_issues(loader: yaml.SafeLoader, root: yaml.Node, file: str) -> list[RecipeIssue]:
    """Every number that cannot be read (an int of more digits than Python converts, a date that is none) or
    is too large to mean anything (an int past MAX_INT, a float that overflows to infinity), at its key and
    line: found before the document is constructed, which would stop at the first with no place to name."""
    issues: list[RecipeIssue] = []
    seen: set[int] = set()

    def check(node: yaml.ScalarNode, path: tuple) -> None:
        kind = node.tag.rsplit(":", 1)[-1]
        if kind not in ("int", "float", "timestamp"):
            return
        text = node.value.strip()
        shown = text if len(text) <= 24 else f"{text[:12]}… ({len(text)} characters)"
        try:
            value = getattr(loader, f"construct_yaml_{kind}")(node)
        except (ValueError, OverflowError) as e:
            why = ("is too long to read as a number; give a number of at most "
                   f"{len(str(MAX_INT))} digits") if kind == "int" else f"is not a valid {kind} ({e})"
            issues.append(RecipeIssue(file, node.start_mark.line + 1, fmt_key(path), f"{shown} {why}"))
            return
        if kind == "int" and abs(value) > MAX_INT:
            why = f"is too large (more than {MAX_INT}); a recipe's sizes are far smaller"
        elif kind == "float" and math.isinf(value) and "inf" not in text.lower():
            why = "is too large a number (it overflows to infinity); a recipe's numbers are far smaller"
        else:
            return
        issues.append(RecipeIssue(file, node.start_mark.line + 1, fmt_key(path), f"{shown} {why}"))

    def walk(node: yaml.Node, path: tuple) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            check(node, path)
        elif isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                walk(k, path)
                walk(v, path + (k.value if isinstance(k, yaml.ScalarNode) else "<key>",))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, path + (i,))

    walk(root, ())
    return issues


# ----------------------------------------------------------------------------------- loading


def parse_yaml(text: str, file: str) -> tuple[Any, yaml.Node | None, list[RecipeIssue]]:
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None, []
        _check_expansion(node)  # before anything walks or constructs the aliased graph
        dups = _duplicate_keys(node)
        numbers = _number_issues(loader, node, file)
        if numbers:
            raise RecipeError(numbers)
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
        RecipeIssue(file, line, fmt_key(path), f"duplicate key (first given at line {first}); each key may appear once")
        for path, first, line in dups
    ]
    return data, node, dup_issues


def read_capped(path: Path, file: str) -> bytes:
    """The recipe's bytes; a file over MAX_RECIPE_BYTES is refused without reading the rest."""
    with open(path, "rb") as f:
        data = f.read(MAX_RECIPE_BYTES + 1)
        if len(data) > MAX_RECIPE_BYTES:
            size = max(os.fstat(f.fileno()).st_size, len(data))
            raise RecipeError([RecipeIssue(file, None, "<file>", f"recipe is {size} bytes, over the "
                                           f"{MAX_RECIPE_BYTES}-byte (1 MiB) cap; a recipe is a few kilobytes")])
    return data


