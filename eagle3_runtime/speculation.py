"""Speculation shapes: what one speculative round drafts and verifies (chains, dynamic and static token
trees) and the menus of shapes a batch bucket may serve. Torch-free; the recipe checks and the manifest
state their rules through the functions here."""
from __future__ import annotations

import hashlib
import json
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

# Every batch bucket has one speculation shape (what `--speculation always` runs) and may have a menu of
# more, compiled alongside it (`--speculation auto` serves whichever is fastest on the host). A
# speculative round drafts a tree rooted at the
# pending token: the root's children are the draft's top-k at the pending position; each of
# `depth - 1` draft steps expands `width` frontier nodes by their top-k children; `num_nodes` nodes
# (the root included) are verified in one target pass. Dynamic trees (SGLang's --speculative-eagle-topk /
# --speculative-num-draft-tokens) keep the best `width` new nodes as the frontier and verify the
# num_nodes - 1 best drafted nodes by cumulative draft log-probability; static trees (TensorRT-LLM's
# eagle_choices) fix the nodes as paths of child ranks. A chain of K is the tree (K, 1, 1, K + 1).
MAX_DEPTH = 16
MAX_NODES = 128


class Strict(BaseModel):
    """A pydantic model that refuses unknown keys (the manifest's models are too)."""

    model_config = ConfigDict(extra="forbid")


def _at_most(n: int):
    """A size cap checked on the raw value, before pydantic validates any element (its own max_length
    counts after validating them all)."""
    def check(v):
        if isinstance(v, (list, dict, str)) and len(v) > n:
            raise ValueError(f"has {len(v)} items, at most {n} are allowed")
        return v
    return BeforeValidator(check)


def Capped(tp, n: int):
    return Annotated[tp, _at_most(n)]


class SpecShape(Strict):
    depth: Annotated[int, Field(ge=0, le=MAX_DEPTH)]  # draft tokens on the longest path; 0 = no speculation
    topk: Annotated[int, Field(ge=1, le=MAX_NODES)] = 1  # children per expanded node
    width: Annotated[int, Field(ge=1, le=MAX_NODES)] = 1  # nodes expanded per draft step
    num_nodes: Annotated[int, Field(ge=1, le=MAX_NODES)] = 1  # nodes per verify pass, the root included
    choices: Capped(list[Capped(list[Annotated[int, Field(ge=0, le=MAX_NODES)]], MAX_DEPTH)],
                    MAX_NODES - 1) | None = None  # static tree: paths of ranks

    @model_validator(mode="after")
    def _valid(self) -> "SpecShape":
        if self.depth == 0:
            if (self.topk, self.width, self.num_nodes, self.choices) != (1, 1, 1, None):
                raise ValueError("a shape without speculation (depth 0) has topk 1, width 1, num_nodes 1, no choices")
        elif self.choices is not None:
            if self != static_tree(self.choices):
                raise ValueError("topk / width / num_nodes / depth do not match the static tree's choices")
        elif self.width > self.topk:
            raise ValueError(f"width {self.width} exceeds topk {self.topk}")
        else:
            problems = tree_problems(self.depth, self.topk, self.num_nodes)
            if problems:
                key, message = problems[0]
                raise ValueError(f"{key}: {message}")
        return self

    @property
    def kind(self) -> str:
        return "none" if self.depth == 0 else "static" if self.choices is not None else (
            "chain" if self.topk == 1 else "dynamic")

    @property
    def speculates(self) -> bool:
        return self.depth > 0

    @property
    def scratch(self) -> int:
        """KV positions past a row's pending one that a round writes: the verify's nodes (target) and
        the draft steps' frontier nodes (draft)."""
        return max(self.num_nodes - 1, (self.depth - 1) * self.width)

    @property
    def tag(self) -> str:
        """A short name for flags and graph names: none, chain3, tree4x2x8 (depth x topk x nodes), static
        trees by depth x nodes and a digest of their paths."""
        if self.kind == "static":
            paths = hashlib.sha256(json.dumps(self.choices).encode()).hexdigest()[:6]
            return f"static{self.depth}x{self.num_nodes}-{paths}"
        return {"none": "none", "chain": f"chain{self.depth}",
                "dynamic": f"tree{self.depth}x{self.topk}x{self.num_nodes}"}[self.kind]

    def describe(self) -> str:
        return {"none": "no speculation", "chain": f"chain K {self.depth}",
                "dynamic": f"tree depth {self.depth} topk {self.topk} nodes {self.num_nodes}",
                "static": f"static tree depth {self.depth} nodes {self.num_nodes}"}[self.kind]

    def dims(self) -> dict[str, int]:
        """The shape symbols of the role table."""
        return {"N": self.num_nodes, "T": self.depth + 1, "W": self.width, "k": self.topk,
                "M": max(1, (self.depth - 1) * self.width)}


NO_SPECULATION = SpecShape(depth=0)


def chain(K: int) -> SpecShape:
    return SpecShape(depth=K, num_nodes=K + 1) if K else NO_SPECULATION


def max_tree_nodes(depth: int, topk: int) -> int:
    """The most nodes a dynamic tree can verify: the root, its topk children, then topk**2 candidates per
    further draft step."""
    return 1 + topk + (depth - 1) * topk * topk if depth else 1


# The speculation-shape rules, each stated once with the recipe key it is about: the recipe places every
# problem at its line (recipe/checks.py), a manifest raises the first.

def tree_problems(depth: int, topk: int, num_nodes: int) -> list[tuple[str, str]]:
    """A dynamic tree of `depth` draft steps, `topk` children per expanded node and `num_nodes` nodes per
    verify pass (the root included), each within its own bounds: [(recipe key, message)]."""
    if depth == 0:
        return [("num_speculative_tokens", "must be >= 1 with a tree (a tree drafts at least one step); for no "
                                           "speculation at this batch bucket drop tree")]
    most = max_tree_nodes(depth, topk)
    bounds = f"[{depth + 1}, {min(most, MAX_NODES)}]"
    if num_nodes < depth + 1:
        return [("num_draft_tokens", f"must be in {bounds}, got {num_nodes}: it counts the root too, so {depth} draft "
                                     f"steps verify at least num_speculative_tokens + 1 = {depth + 1} nodes; raise "
                                     "num_draft_tokens or lower num_speculative_tokens")]
    if num_nodes > most:
        return [("num_draft_tokens", f"must be in {bounds}, got {num_nodes}: {depth} steps of topk {topk} children "
                                     f"can grow at most {most} nodes (the root included); lower num_draft_tokens or "
                                     "raise topk or num_speculative_tokens")]
    return []


def choices_problems(choices: list[list[int]]) -> list[tuple[int | None, str]]:
    """A static tree's paths of child ranks (TensorRT-LLM eagle_choices), each rank below MAX_NODES:
    [(index of the bad path, or None for the list, message)]."""
    if not choices:
        return [(None, "must not be empty: give paths of child ranks such as [[0], [1], [0, 0]] (the root is "
                       "implied)")]
    out: list[tuple[int | None, str]] = []
    given = {tuple(c) for c in choices}
    first: dict[tuple, int] = {}
    too_deep = False
    for i, c in enumerate(choices):
        t = tuple(c)
        if not t:
            out.append((i, "an empty path [] (the root is implied); remove it"))
        elif t in first:
            out.append((i, f"{list(t)} appears twice (first as choices[{first[t]}]); each path names one node, "
                           "remove one"))
        else:
            first[t] = i
            if len(t) > 1 and t[:-1] not in given:
                out.append((i, f"{list(t)} has no parent {list(t[:-1])} (the paths must be prefix-closed); add "
                               f"{list(t[:-1])} or remove {list(t)}"))
            if len(t) > MAX_DEPTH and not too_deep:
                out.append((i, f"{list(t)} is {len(t)} deep; a tree has at most {MAX_DEPTH} draft steps (the "
                               "runtime's MAX_DEPTH); shorten the paths"))
                too_deep = True
    if len(choices) + 1 > MAX_NODES:
        out.append((None, f"{len(choices)} paths, at most {MAX_NODES - 1}: a verify pass holds at most {MAX_NODES} "
                          "nodes (the runtime's MAX_NODES), the root included; remove paths"))
    return out


def dynamic_tree(depth: int, topk: int, num_nodes: int) -> SpecShape:
    return SpecShape(depth=depth, topk=topk, width=topk, num_nodes=num_nodes) if topk > 1 else chain(depth)


def static_tree(choices: list[list[int]]) -> SpecShape:
    """The shape of a static tree given as TensorRT-LLM's eagle_choices: each path of child ranks names
    one node; the set must be prefix-closed. Raises ValueError naming the first bad path (choices_problems)."""
    problems = choices_problems(choices)
    if problems:
        where, message = problems[0]
        raise ValueError(f"choices{'' if where is None else f'[{where}]'}: {message}")
    paths = [tuple(c) for c in choices]
    depth = max(len(c) for c in paths)
    parents = {c[:-1] for c in paths if len(c) > 1}
    width = max([sum(len(p) == m for p in parents) for m in range(1, depth)] or [1])
    return SpecShape.model_construct(depth=depth, topk=max(c[-1] for c in paths) + 1, width=width,
                                     num_nodes=len(paths) + 1, choices=sorted_choices(paths))


def sorted_choices(choices) -> list[list[int]]:
    """Static-tree paths in node order: by depth, then by ranks (parents before children)."""
    return [list(c) for c in sorted(map(tuple, choices), key=lambda c: (len(c), c))]


# ------------------------------------------------------------------ menus

MAX_MENU = 16  # shapes on one batch bucket's menu besides its own


def merged_shape(shapes) -> SpecShape:
    """What a graph shared by several shapes is built for: the deepest, with the largest topk of any (the
    prefill graphs over every shape of the bundle, a bucket's draft_catchup over its menu: they propose
    the root's children for whichever shape drafts next, and catch up on its longest accepted path)."""
    shapes = list(shapes)
    deepest = max(shapes, key=lambda s: (s.depth, s.topk))
    k = max(s.topk for s in shapes)
    return deepest if deepest.topk == k else deepest.model_copy(update={"topk": k})


def bucket_shapes(speculation: dict[int, SpecShape], menu: dict[int, list[SpecShape]] | None,
                  bucket: int) -> list[SpecShape]:
    """A batch bucket's shapes: its own first, then its menu."""
    return [speculation[bucket], *(menu or {}).get(bucket, [])]


def all_shapes(speculation: dict[int, SpecShape], menu: dict[int, list[SpecShape]] | None) -> list[SpecShape]:
    return [s for b in speculation for s in bucket_shapes(speculation, menu, b)]

