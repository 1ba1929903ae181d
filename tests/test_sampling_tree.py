"""Tree speculative sampling keeps the target's distribution exactly (sampling.verify_tree_sampled).

For every node u of a token tree, among the trials whose emitted tokens begin with u's root path,
the next emitted token must follow the target's p_u (a total-variation check against a Monte-Carlo
null, as tests/test_sampling.py does for chains). Broken samplers must fail the same check.
"""
import pytest
import torch

from eagle3_runtime.sampling import SamplingParams, sample, target_probs, verify_tree_sampled
from eagle3_runtime.tree import Tree
from test_sampling import _null_threshold, _passes, _report, _tv, draws

V = 6
TRIALS = 20000


def _tree(probs: torch.Tensor, good: bool) -> Tree:
    """Root with 3 children (the target's 3 best / worst tokens at the root, best first), 2 children
    under the first, 1 under the second, and 1 under the first grandchild: N = 8, depth 3."""
    def ranked(u, n):
        order = probs[u].argsort(descending=good).tolist()
        return order[:n]

    tokens, parents = [0], [-1]

    def add(parent, n):
        made = []
        for t in ranked(parent, n):
            tokens.append(t)
            parents.append(parent)
            made.append(len(tokens) - 1)
        return made

    # node logits are indexed by node, so the tree is grown over placeholders first, then filled
    kids = add(0, 3)
    gk = add(kids[0], 2)
    add(kids[1], 1)
    add(gk[0], 1)
    depths = [0]
    for p in parents[1:]:
        depths.append(depths[p] + 1)
    return Tree(tokens, parents, depths)


def _paths(tree: Tree) -> list[list[int]]:
    """Every node's root path as node indices."""
    out = []
    for u in range(len(tree.tokens)):
        path, j = [], u
        while j > 0:
            path.append(j)
            j = tree.parents[j]
        out.append(path[::-1])
    return out


def _tree_checks(sampler, logits, tree, params, seed=0, trials=TRIALS):
    """For every node u: the distribution of the emitted token after u's root path, among trials whose
    output starts with that path's tokens, against p_u (plus a "stopped" category of probability 0)."""
    probs = target_probs(logits, params)
    gen = torch.Generator().manual_seed(seed)
    D = max(tree.depths) + 1
    pad = [-1] * (D + 1)
    u = draws(gen)
    outs = torch.tensor([(sampler(logits, tree, params, u)[1] + pad)[:D + 1] for _ in range(trials)])
    null_gen = torch.Generator().manual_seed(seed + 1)
    results = []
    for u, path in enumerate(_paths(tree)):
        j = len(path)
        want = torch.tensor([tree.tokens[i] for i in path], dtype=torch.long)
        ok = (outs[:, :j] == want).all(1) if j else torch.ones(trials, dtype=torch.bool)
        nxt = outs[ok, j]
        counts = torch.bincount(nxt.masked_fill(nxt < 0, V), minlength=V + 1).float()
        n = int(counts.sum())
        if n == 0:
            results.append((u, 0, float("nan"), float("nan")))
            continue
        p_u = torch.cat([probs[u], torch.zeros(1)])
        results.append((u, n, float(_tv(counts, p_u)), _null_threshold(p_u, n, null_gen)))
    return results


def _logits(N: int = 8) -> torch.Tensor:
    return torch.randn(N, V, generator=torch.Generator().manual_seed(7)) * 1.5


@pytest.mark.parametrize("which", ["good", "bad"])
def test_tree_sampling_preserves_target_distribution(which):
    logits, params = _logits(), SamplingParams(temperature=1.0)
    tree = _tree(target_probs(logits, params), which == "good")
    results = _tree_checks(verify_tree_sampled, logits, tree, params)
    _report(f"verify_tree_sampled, {which} tree {tree.tokens}", results)
    assert _passes(results), results
    assert results[0][1] == TRIALS
    if which == "good":  # every node is reached often enough for the check to have power
        assert all(n >= 300 for _, n, _, _ in results), results


def test_tree_sampling_with_filters():
    """With temperature / top-k / top-p the emitted tokens follow the filtered target, and a child the
    filter removed is never accepted."""
    logits = _logits()
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.95)
    probs = target_probs(logits, params)
    tree = _tree(probs, True)
    tree.tokens[2] = int(probs[0].argmin())  # the root's second child: filtered out (p = 0)
    assert probs[0, tree.tokens[2]] == 0
    results = _tree_checks(verify_tree_sampled, logits, tree, params, trials=10000)
    _report(f"verify_tree_sampled (T=0.8, top_k=4, top_p=0.95), tree {tree.tokens}", results)
    assert _passes(results), results
    assert results[2][1] == 0  # nothing ever passed the filtered child


def test_chain_tree_is_the_chain_sampler():
    """A chain is a tree: verify_sampled and verify_tree_sampled give the same tokens for the same uniforms."""
    from eagle3_runtime.sampling import Uniforms, verify_sampled

    logits, params = _logits(4), SamplingParams(temperature=1.0)
    drafts = target_probs(logits, params)[:3].argmax(-1).tolist()
    tree = Tree([0] + drafts, [-1, 0, 1, 2], [0, 1, 2, 3])
    for seed in range(20):
        a, new = verify_sampled(logits, drafts, params, Uniforms(seed).at(0))
        path, new2 = verify_tree_sampled(logits, tree, params, Uniforms(seed).at(0))
        assert (path, new2) == (list(range(a + 1)), new)


# broken tree samplers: the same check must reject them (proves the test can fail)

FLAWS = {
    "no_renormalise": "tries each sibling with its raw p(x) instead of the residual's r(x) / sum(r)",
    "resample_from_p": "on rejection of every child, samples p_u instead of the residual",
    "first_child_only": "tries only the first child (the residual still zeroes every child)",
}


def _flawed(flaw: str):
    """verify_tree_sampled's walk with one flaw (FLAWS)."""
    def sampler(logits, tree, params, draw):
        probs = target_probs(logits, params)
        kids = tree.children()
        path = [0]
        while True:
            u = path[-1]
            r = probs[u].clone()
            for c in kids[u][:1] if flaw == "first_child_only" else kids[u]:
                x = tree.tokens[c]
                q = probs[u, x] if flaw == "no_renormalise" else r[x] / r.sum()
                if draw() < float(q):
                    path.append(c)
                    break
                r[x] = 0.0
            else:
                for c in kids[u]:
                    r[tree.tokens[c]] = 0.0
                return path, [tree.tokens[i] for i in path[1:]] + [sample(probs[u] if flaw == "resample_from_p" else r,
                                                                          draw())]
    return sampler


@pytest.mark.parametrize("flaw", list(FLAWS))
def test_broken_tree_sampler_fails_the_check(flaw):
    logits, params = _logits(), SamplingParams(temperature=1.0)
    tree = _tree(target_probs(logits, params), True)
    results = _tree_checks(_flawed(flaw), logits, tree, params, trials=8000)
    _report(f"broken: {FLAWS[flaw]}", results)
    assert not _passes(results), results
