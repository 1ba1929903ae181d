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
    """[b, N, N] bool ancestor-or-self mask (tree.Tree.mask) -> [b, N] parent node index (-1 for the root): each
    node's deepest proper ancestor."""
    N = tree_mask.shape[-1]
    eye = torch.eye(N, dtype=torch.bool, device=tree_mask.device)
    ancestors = tree_mask & ~eye
    depth = tree_mask.sum(-1)  # [b, N]: 1 for the root
    scored = torch.where(ancestors, depth[:, None, :], torch.zeros_like(depth)[:, None, :])  # [b, N, N]
    best = scored.max(-1)
    return torch.where(best.values > 0, best.indices, torch.full_like(best.indices, -1))


def accept_greedy(logits: torch.Tensor, tokens: torch.Tensor, tree_mask: torch.Tensor, depth: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [b, N, V] of the verified nodes, their tokens [b, N] (node 0: the root), tree_mask [b, N, N] ->
    (path [b, depth + 1] node indices, next_tokens [b, depth + 1], accepted [b]): row r accepts accepted[r]
    drafts; path[r, :accepted + 1] and next_tokens[r, :accepted + 1] hold its path and the tokens it emits,
    the entries after them zero."""
    b = tokens.shape[0]
    target = logits.argmax(-1)  # [b, N]: the target's token after each node
    parent = parents_of(tree_mask)
    cur = torch.zeros(b, dtype=torch.long, device=tokens.device)
    alive = torch.ones(b, dtype=torch.bool, device=tokens.device)
    steps = []
    for _ in range(depth):
        want = target.gather(1, cur[:, None])  # [b, 1]
        match = (parent == cur[:, None]) & (tokens == want) & alive[:, None]
        found = match.any(-1)
        first = match.to(torch.int32).argmax(-1)  # (the first matching child: argmax returns the first maximum)
        cur = torch.where(found, first, cur)
        alive = alive & found
        steps.append(torch.where(found, first, torch.zeros_like(first)))
    accepted = torch.stack(steps, 1).ne(0).cumprod(1).sum(1) if depth else torch.zeros_like(cur)
    path = torch.cat([torch.zeros_like(cur)[:, None], *(s[:, None] for s in steps)], 1)  # [b, depth + 1]
    emitted = torch.cat([tokens.gather(1, path[:, 1:]), torch.zeros_like(cur)[:, None]], 1)
    last = target.gather(1, cur[:, None])  # the target's token after the last accepted node
    keep = torch.arange(depth + 1, device=tokens.device)[None, :] < accepted[:, None]
    next_tokens = torch.where(keep, emitted, torch.zeros_like(emitted)).scatter(1, accepted[:, None], last)
    return path, next_tokens, accepted  # (path: zero after the accepted nodes, as no step found a child there)
