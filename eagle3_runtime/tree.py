"""Draft trees on the host: expansion from the draft graphs' top-k, the nodes one verify pass checks,
and the accepted path (EAGLE-2 / SGLang dynamic trees, TensorRT-LLM static trees; a chain is the
tree with topk 1).

One round per row, for a bucket's SpecShape (speculation.py):
  root       node 0 = the pending token at position p
  depth 1    the root's top-k children, from the last draft_prefill / draft_catchup
  steps      depth - 1 draft_step calls, each over `width` frontier nodes: their top-k children
             (dynamic: the frontier is the `width` best new candidates by cumulative draft log-prob;
             static: the nodes of that depth that have children in `choices`)
  nodes      dynamic: the root + the num_nodes - 1 best candidates (prefix-closed: a child never
             scores above its parent, ties keep the older node); static: every node of `choices`
Nodes are numbered parents first, so node i of a row is verified at KV slot p + i.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .speculation import SpecShape


@dataclass
class Tree:
    """The nodes of one row's tree, root first, parents before children."""

    tokens: list[int]
    parents: list[int]  # parent node index; -1 for the root
    depths: list[int]

    def mask(self) -> torch.Tensor:
        """[N, N] bool: node i sees node j iff j is i or an ancestor of i (a row is its parent's row
        plus itself: parents come first)."""
        N = len(self.tokens)
        rows: list[list[bool]] = []
        for i, p in enumerate(self.parents):
            row = list(rows[p]) if p >= 0 else [False] * N
            row[i] = True
            rows.append(row)
        return torch.tensor(rows, dtype=torch.bool).reshape(N, N)

    def children(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.tokens]
        for i, p in enumerate(self.parents):
            if p >= 0:
                out[p].append(i)
        return out


class Drafting:
    """One row's tree under construction: the candidate pool and the frontier of the next draft step."""

    def __init__(self, shape: SpecShape, root: int, top_tokens: list[int], top_logprobs: list[float]):
        self.shape = shape
        self.choices = None if shape.choices is None else {tuple(c) for c in shape.choices}
        self.expands = None if shape.choices is None else {tuple(c[:-1]) for c in shape.choices}
        # the pool, root first: token, parent (pool index, -1 = root), cumulative draft log-prob, depth, rank path
        self.tokens, self.parents, self.scores, self.depths, self.paths = [root], [-1], [0.0], [0], [()]
        self.slot: dict[int, int] = {}  # expanded node -> its place w in its draft step
        self.offset: dict[int, int] = {}  # expanded node -> its draft KV scratch offset
        self.frontier = self._frontier(self._add_children(0, top_tokens, top_logprobs))

    def _add_children(self, parent: int, tokens: list[int], logprobs: list[float]) -> list[int]:
        made = []
        for r, (t, lp) in enumerate(zip(tokens[:self.shape.topk], logprobs[:self.shape.topk])):
            path = self.paths[parent] + (r,)
            if self.choices is not None and path not in self.choices:
                continue
            made.append(len(self.tokens))
            self.tokens.append(int(t))
            self.parents.append(parent)
            self.scores.append(self.scores[parent] + min(float(lp), 0.0))  # (never above the parent)
            self.depths.append(self.depths[parent] + 1)
            self.paths.append(path)
        return made

    def _frontier(self, new: list[int]) -> list[int]:
        """The new nodes the next draft step expands (at most `width`)."""
        if self.choices is not None:
            return [i for i in new if self.paths[i] in self.expands][:self.shape.width]
        return sorted(new, key=lambda i: (-self.scores[i], i))[:self.shape.width]

    def step_inputs(self, step: int) -> tuple[list[int], list[int], list[int], torch.Tensor]:
        """Draft step `step` (1-based) over the frontier: per place w the node's token, where its parent's
        hidden is (-1: the root's, from the catch-up; else the parent's place in the previous step), its
        scratch offset, and its [M] mask row (itself and its expanded ancestors)."""
        W, M = self.shape.width, self.shape.dims()["M"]
        toks, parent_slot, offsets = [0] * W, [-1] * W, [(step - 1) * W + w for w in range(W)]
        mask = torch.zeros(W, M, dtype=torch.bool)
        mask[range(W), offsets] = True  # (places without a node see only themselves)
        for w, node in enumerate(self.frontier):
            self.slot[node], self.offset[node] = w, offsets[w]
            toks[w], parent_slot[w] = self.tokens[node], self.slot.get(self.parents[node], -1)
            j = node
            while j > 0:
                mask[w, self.offset[j]] = True
                j = self.parents[j]
        return toks, parent_slot, offsets, mask

    def expand(self, top_tokens: torch.Tensor, top_logprobs: torch.Tensor) -> None:
        """Add the frontier's children from a draft step's outputs [W, k]; pick the next frontier."""
        new = []
        for w, node in enumerate(self.frontier):
            new += self._add_children(node, top_tokens[w].tolist(), top_logprobs[w].tolist())
        self.frontier = self._frontier(new)

    def extend_chain(self, tokens: list[int]) -> None:
        """A chain's later drafts from one unrolled draft call (graph_contract: draft_chain), each the child of the
        last (topk 1: the log-probs do not choose anything)."""
        for t in tokens:
            self._add_children(len(self.tokens) - 1, [t], [0.0])

    def tree(self) -> Tree:
        """The verified nodes: the root and the num_nodes - 1 best candidates (static: all), parents first."""
        if self.choices is not None:
            keep = sorted(range(len(self.tokens)), key=lambda p: (self.depths[p], self.paths[p]))
        else:
            best = sorted(range(1, len(self.tokens)), key=lambda i: (-self.scores[i], i))[:self.shape.num_nodes - 1]
            keep = [0] + sorted(best, key=lambda i: (self.depths[i], i))
        index = {p: i for i, p in enumerate(keep)}
        return Tree([self.tokens[p] for p in keep], [index.get(self.parents[p], -1) for p in keep],
                    [self.depths[p] for p in keep])


def dummy_tree(shape: SpecShape, token: int) -> Tree:
    """The tree of a row that does not speculate this round: its pending token at node 0 (which sees
    only itself); the other nodes are chained behind it and ignored."""
    return chain_tree([0] * (shape.num_nodes - 1), token)


def chain_tree(drafts: list[int], root: int = 0) -> Tree:
    """A chain of draft tokens behind the root, as a tree (topk 1)."""
    n = len(drafts) + 1
    return Tree([root, *drafts], [-1, *range(n - 1)], list(range(n)))


def accept_greedy(tree: Tree, argmax: list[int]) -> list[int]:
    """The longest root path whose every node's token is the target's argmax at its parent: node indices."""
    kids = tree.children()
    path = [0]
    while True:
        u = path[-1]
        nxt = [c for c in kids[u] if tree.tokens[c] == argmax[u]]
        if not nxt:
            return path
        path.append(nxt[0])
