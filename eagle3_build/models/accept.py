"""Greedy acceptance of a verified token tree, written as graph code (fixed shapes, no host round trip).

What eagle3_runtime.tree.accept_greedy does on the host, for a batch of rows: from the root, follow the first
child whose token is the target's argmax at its parent, at most `depth` steps. The result is what the engine
needs from a round: the accepted path (node indices, root first), the tokens it emits (the path's tokens after
the root, then the target's token after the last accepted node) and the accepted length; the seed design's
on-device acceptance, for greedy requests.
"""
from __future__ import annotations

import torch


def parents_of(tree_mask: torch.Tensor) -> torch.Tensor:
    """[b, N, N] ancestor-or-self mask (tree.Tree.mask; bool or 0/1 integers) -> [b, N] parent node index (-1 for
    the root), in the mask's dtype where it is an integer. Parents come before children (tree.Tree), so a
    node's parent is its proper ancestor with the largest index."""
    N = tree_mask.shape[-1]
    idx = torch.int64 if tree_mask.dtype == torch.bool else tree_mask.dtype
    below = torch.ones(N, N, dtype=torch.bool, device=tree_mask.device).tril(-1)  # j < i: a proper ancestor
    nodes = torch.arange(N, dtype=idx, device=tree_mask.device)
    return torch.where(tree_mask.to(torch.bool) & below, nodes, torch.full_like(nodes, -1)).amax(-1)


def accept_greedy(logits: torch.Tensor, tokens: torch.Tensor, tree_mask: torch.Tensor, depth: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [b, N, V] of the verified nodes, their tokens [b, N] (node 0: the root), tree_mask [b, N, N] ->
    (accepted [b], path [b, depth + 1] node indices, next_tokens [b, depth + 1]), all in the tokens' dtype (the
    bundle's index dtype: no 64-bit integer in the graph on Neuron): row r accepts accepted[r] drafts;
    path[r, :accepted + 1] and next_tokens[r, :accepted + 1] hold its path and the tokens it emits, zero after."""
    b, N = tokens.shape
    idx = tokens.dtype
    target = logits.argmax(-1).to(idx)  # [b, N]: the target's token after each node
    parent = parents_of(tree_mask).to(idx)
    nodes = torch.arange(N, dtype=idx, device=tokens.device)
    none = torch.full_like(nodes, N)
    cur = torch.zeros(b, 1, dtype=idx, device=tokens.device)
    zero = torch.zeros_like(cur)
    alive = torch.ones(b, 1, dtype=torch.bool, device=tokens.device)
    steps, found_at = [], []
    for _ in range(depth):  # (bool masks and values-only reductions: no 64-bit integer on Neuron)
        want = target.gather(1, cur)  # [b, 1]
        match = (parent == cur) & (tokens == want) & alive
        alive = match.any(-1, keepdim=True)  # (a row that stopped stays stopped)
        first = torch.where(match, nodes, none).amin(-1, keepdim=True)  # the first matching child
        cur = torch.where(alive, first, cur)
        steps.append(torch.where(alive, first, zero))
        found_at.append(alive)
    path = torch.cat([zero, *steps], 1)  # [b, depth + 1]: zero after the accepted nodes
    accepted = torch.cat(found_at, 1).to(idx).sum(1, dtype=idx) if depth else zero[:, 0]
    emitted = torch.cat([tokens.gather(1, path[:, 1:]), zero], 1)
    last = target.gather(1, cur)  # the target's token after the last accepted node
    keep = torch.arange(depth + 1, dtype=idx, device=tokens.device)[None, :] < accepted[:, None]
    next_tokens = torch.where(keep, emitted, torch.zeros_like(emitted)).scatter(1, accepted[:, None], last)
    return accepted, path, next_tokens
