"""A chain's draft steps unrolled in one graph (graph_contract: draft_chain; recipe speculation.unroll_draft):
the graphs a bundle has, the same tokens as per-step drafting and plain decoding, one draft call per round."""
from __future__ import annotations

import collections

import pytest

from eagle3_runtime.bundle import Bundle
from eagle3_runtime.engine import Engine

MENU = {"speculation": {"num_speculative_tokens": 3,
                        "menu": [{"num_speculative_tokens": 2}, {"tree": {"topk": 2, "num_draft_tokens": 5},
                                                                 "num_speculative_tokens": 2}]}}
PROMPTS = [[0, 477, 158, 341, 32, 193, 35], [0, 39, 90, 82, 78, 383, 314, 259], [0, 5, 17, 301, 44, 402]]


@pytest.fixture(scope="module")
def bundles(tiny):
    return {unroll: Bundle(tiny.bundle(recipe={"speculation": {**MENU["speculation"], "unroll_draft": unroll}}).path)
            for unroll in (True, False)}


def _draft_roles(b: Bundle) -> dict[str, str]:
    return {g.name: g.role for g in b.manifest.graphs if g.role in ("draft_step", "draft_chain")}


def test_chains_get_one_draft_graph_and_trees_keep_their_steps(bundles):
    assert _draft_roles(bundles[True]) == {"draft_chain_b1": "draft_chain", "draft_chain_b1_chain2": "draft_chain",
                                           "draft_step_b1_tree2x2x5": "draft_step"}
    assert _draft_roles(bundles[False]) == {"draft_step_b1": "draft_step", "draft_step_b1_chain2": "draft_step",
                                            "draft_step_b1_tree2x2x5": "draft_step"}
    assert bundles[True].manifest.unroll_draft and not bundles[False].manifest.unroll_draft
    chain = bundles[True].manifest.graph("draft_chain", 1)
    assert [(o.name, o.shape) for o in chain.outputs] == [("tokens", [1, 2])]


def _calls(e: Engine) -> collections.Counter:
    """Graph calls per role (metrics labels: role[:tag]/bucket)."""
    out = collections.Counter()
    for key, v in e.metrics.graph_profile().items():
        out[key.split("/")[0].split(":")[0]] += v["calls"]
    return out


@pytest.mark.parametrize("speculation,depth", [("chain3", 3), ("chain2", 2), ("tree2x2x5", 2)])
def test_unrolled_and_stepped_drafts_give_the_same_tokens(bundles, speculation, depth):
    plain = Engine(bundles[False], speculative=False)
    runs = {}
    for unroll, b in bundles.items():
        e = Engine(b, speculation=speculation)
        runs[unroll] = [e.generate(p, 20) for p in PROMPTS]
        calls = _calls(e)
        rounds = calls["target_verify"]
        if unroll and speculation.startswith("chain"):
            assert rounds and calls["draft_chain"] == rounds and calls["draft_step"] == 0
        else:
            assert rounds and calls["draft_step"] == rounds * (depth - 1) and calls["draft_chain"] == 0
    for p, a, b in zip(PROMPTS, runs[True], runs[False]):
        assert a.token_ids == b.token_ids == plain.generate(p, 20).token_ids
        assert a.stats.num_accepted_tokens == b.stats.num_accepted_tokens  # (the same drafts, accepted alike)
