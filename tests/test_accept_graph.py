"""Greedy acceptance as graph code (eagle3_build/models/accept.py) gives what the engine's host-side rule
(eagle3_runtime.tree.accept_greedy) gives, on chains and trees, row by row, and exports as a static graph."""
from __future__ import annotations

import random

import pytest
import torch

from eagle3_build.models.accept import accept_greedy, parents_of
from eagle3_runtime import tree as host


def random_tree(rng: random.Random, n: int, vocab: int) -> host.Tree:
    parents, depths = [-1], [0]
    for _ in range(1, n):
        p = rng.randrange(len(parents))
        parents.append(p)
        depths.append(depths[p] + 1)
    tokens = [rng.randrange(vocab) for _ in range(n)]
    for u in range(n):  # siblings carry distinct tokens (a draft's top-k)
        kids = [c for c, p in enumerate(parents) if p == u]
        for c, t in zip(kids, rng.sample(range(vocab), len(kids))):
            tokens[c] = t
    return host.Tree(tokens, parents, depths)


def logits_for(rng: random.Random, t: host.Tree, vocab: int) -> torch.Tensor:
    """Random logits whose argmax at a node is one of its children's tokens more often than not."""
    out = torch.randn(len(t.tokens), vocab)
    for u, kids in enumerate(t.children()):
        if kids and rng.random() < 0.7:
            out[u, t.tokens[rng.choice(kids)]] = 10.0
    return out


def test_in_graph_acceptance_matches_the_host_rule():
    rng = random.Random(0)
    vocab, checked = 6, 0
    for n in [4, 6, 8, 1] * 12:
        rows = [random_tree(rng, n, vocab) for _ in range(3)]
        depth = max(max(t.depths) for t in rows)
        logits = torch.stack([logits_for(rng, t, vocab) for t in rows])
        tokens = torch.tensor([t.tokens for t in rows])
        mask = torch.stack([t.mask() for t in rows])
        assert parents_of(mask).tolist() == [t.parents for t in rows]
        accepted, path, nxt = accept_greedy(logits, tokens, mask, depth)
        for r, t in enumerate(rows):
            g = logits[r].argmax(-1).tolist()
            want = host.accept_greedy(t, g)
            a = len(want) - 1
            assert accepted[r].item() == a
            assert path[r, :a + 1].tolist() == want and not path[r, a + 1:].any()
            assert nxt[r, :a + 1].tolist() == [t.tokens[i] for i in want[1:]] + [g[want[-1]]]
            checked += a
    assert checked > 50  # (the trees accept something)


def test_chains_accept_their_longest_matching_prefix():
    drafts = [5, 7, 9]
    t = host.chain_tree(drafts, root=1)
    logits = torch.full((1, 4, 12), -1.0)
    for node, target in enumerate([5, 7, 3, 11]):  # the target agrees on 2 drafts, then says 3
        logits[0, node, target] = 1.0
    accepted, path, nxt = accept_greedy(logits, torch.tensor([t.tokens]), t.mask()[None], 3)
    assert accepted.tolist() == [2] and path.tolist() == [[0, 1, 2, 0]] and nxt.tolist() == [[5, 7, 3, 0]]


def test_it_exports_as_a_static_graph():
    class Accept(torch.nn.Module):
        def forward(self, logits, tokens, mask):
            return accept_greedy(logits, tokens, mask, 3)

    rng = random.Random(1)
    rows = [random_tree(rng, 6, 5) for _ in range(2)]
    args = (torch.stack([logits_for(rng, t, 5) for t in rows]), torch.tensor([t.tokens for t in rows]),
            torch.stack([t.mask() for t in rows]))
    ep = torch.export.export(Accept(), args, strict=False)
    for got, want in zip(ep.module()(*args), accept_greedy(*args, 3)):
        assert torch.equal(got, want)


def test_an_int32_index_dtype_stays_int32():
    """Neuron's index dtype: the integer mask and tokens it passes give the same answers, in int32."""
    rng = random.Random(2)
    rows = [random_tree(rng, 7, 6) for _ in range(4)]
    logits = torch.stack([logits_for(rng, t, 6) for t in rows])
    tokens, mask = torch.tensor([t.tokens for t in rows]), torch.stack([t.mask() for t in rows])
    want = accept_greedy(logits, tokens, mask, 4)
    got = accept_greedy(logits, tokens.int(), mask.int(), 4)
    assert all(g.dtype == torch.int32 and torch.equal(g.long(), w) for g, w in zip(got, want))


TREE = {"speculation": {"num_speculative_tokens": 3, "tree": {"topk": 2, "num_draft_tokens": 7}}}
PROMPTS = [[0, 477, 158, 341, 32, 193, 35], [0, 39, 90, 82, 78, 383, 314, 259], [0, 5, 17, 301, 44, 402]]


def test_bundles_accepting_in_the_graph_and_on_the_host_serve_the_targets_tokens(tiny):
    """A tree bundle of each kind (recipe speculation.accept): the verify graph's outputs as the manifest says,
    greedy output equal to plain decoding in both, with drafts accepted; a manifest whose `accept` disagrees
    with its verify graphs is refused."""
    from eagle3_runtime.bundle import Bundle
    from eagle3_runtime.engine import Engine
    from eagle3_runtime.manifest import Manifest

    graph = Bundle(tiny.bundle(recipe=TREE).path)
    host_ = Bundle(tiny.bundle(recipe={"speculation": {**TREE["speculation"], "accept": "host"}}).path)
    assert (graph.manifest.accept, host_.manifest.accept) == ("graph", "host")
    outputs = {b.manifest.accept: [o.name for o in b.manifest.graph("target_verify", 1).outputs] for b in (graph, host_)}
    assert outputs == {"graph": ["logits", "aux", "accepted", "path", "next_tokens"], "host": ["logits", "aux"]}
    plain = Engine(graph, speculative=False)
    for b in (graph, host_):
        e = Engine(b)
        n_tokens = 0
        for p in PROMPTS:
            got = e.generate(p, 24).token_ids
            assert got == plain.generate(p, 24).token_ids
            n_tokens += len(got)
        assert e.target_passes < n_tokens - len(PROMPTS)  # (speculation accepted drafts)
    data = graph.manifest.model_dump(mode="json") | {"accept": "host"}
    with pytest.raises(ValueError, match="target_verify.*outputs"):
        Manifest.model_validate(data)
