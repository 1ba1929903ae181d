"""Prompts past a prefill bucket: the first chunk through a prefill graph, the rest through the verify graph as
chains (engine._prefill), lossless against transformers; the plan weighs padding to a larger bucket against
continuing from a smaller one by the warm-up's graph costs."""
import pytest
from test_spine import hf_greedy

from eagle3_runtime.bundle import Bundle
from eagle3_runtime.engine import Engine, Request, RequestError

TWO_BUCKETS = {"buckets": {"prefill": [16, 64]}}


@pytest.fixture(scope="module")
def long_ids(tiny_bundles):
    from eagle3_runtime.tokenizer import BundleTokenizer

    _, bundle_dir = tiny_bundles.get("speculators", 3)
    return BundleTokenizer(bundle_dir).encode("the quick brown fox jumps over a lazy dog " * 40)


def test_a_prompt_past_the_largest_bucket_is_continued_through_verify(tiny_bundles, long_ids):
    """Largest bucket 64, max_model_len 256: a 150-token prompt is served (64 by prefill, 86 by verify calls of
    4), the same tokens as transformers with and without speculation; the draft, caught up on the 86 it did not
    prefill, still accepts; a prompt of max_model_len tokens is refused in one line."""
    pair, bundle_dir = tiny_bundles.get("speculators", 3)
    bundle = Bundle(bundle_dir)
    engine = Engine(bundle)
    assert bundle.manifest.prefill_buckets == [64] and bundle.manifest.longest_prompt() == engine.max_len - 1
    ids = long_ids[:150]
    ref = hf_greedy(pair / "target", ids, 24)
    passes = engine.target_passes
    spec = engine.generate(ids, 24)
    assert spec.token_ids == ref
    assert spec.stats.mean_acceptance_length > 1.5
    assert engine.target_passes - passes >= 1 + 22  # the prefill, 22 verify chunks, then the rounds
    assert engine.generate(ids, 24, speculative=False).token_ids == ref
    with pytest.raises(RequestError, match="max_model_len is 256"):
        engine.generate(long_ids[:256], 1)


def test_the_prefill_plan_weighs_padding_against_continuing(tiny, long_ids):
    """Buckets 16 and 64: with costs where a verify call is cheap, a 20-token prompt runs bucket 16 + one verify
    call and a 60-token one pads to 64 (11 calls would cost more); without times, the smallest bucket that holds
    the prompt. Both plans give transformers' tokens."""
    built = tiny.bundle(recipe=TWO_BUCKETS)
    bundle = Bundle(built.path)
    m = bundle.manifest
    engine = Engine(bundle)
    chain = engine.chunk_shapes[1]
    assert chain.num_nodes == 4 and engine._prefill_plan(20, 1, True) == (64, None)  # (nothing timed yet)
    costs = {m.graph("target_prefill", 16).name: 1.0, m.graph("target_prefill", 64).name: 10.0,
             m.graph("draft_prefill", 16).name: 0.1, m.graph("draft_prefill", 64).name: 0.4,
             m.graph("target_verify", 1, chain).name: 1.0, m.graph("draft_catchup", 1).name: 0.05}
    bundle.backend.timings, bundle.backend.costs = {}, costs
    assert engine._prefill_plan(20, 1, True) == (16, chain)  # 1.1 + 1 + 0.05 against 10.4
    assert engine._prefill_plan(60, 1, True) == (64, None)  # 1.1 + 11 + 0.55 against 10.4
    assert engine._prefill_plan(16, 1, True) == (16, None)
    for n in (20, 60):
        ids = long_ids[:n]
        assert engine.generate(ids, 16).token_ids == hf_greedy(built.pair / "target", ids, 16)
    # the draft after a continued prompt's catch-up is where a padded prefill leaves it: the verify chunks' aux
    # states are the prefill's, fed to the draft at the positions it did not prefill
    ids, state = long_ids[:23], {}
    for plan, c in (("continued", costs), ("padded", {})):
        bundle.backend.costs = c
        engine._prefill(Request(ids, 4))
        seq = engine.active[0]
        assert len(seq.gap) == (7 if plan == "continued" else 0)
        engine._catch_up_gaps(1)
        state[plan] = seq.draft_top, seq.draft_hidden
        engine.active.clear()
    assert state["continued"][0][0] == state["padded"][0][0]  # the same top-k tokens
    assert state["continued"][0][1] == pytest.approx(state["padded"][0][1], abs=1e-4)
    assert (state["continued"][1] - state["padded"][1]).abs().max() < 1e-4


def test_a_long_prompt_admitted_beside_a_decoding_row(bundle, tiny_pair, long_ids):
    """The server's bundle (two rows): a 150-token prompt admitted while another row decodes continues through the
    batch-2 verify graph, the other row putting its pending token at its own position; both rows give
    transformers' tokens."""
    engine = Engine(Bundle(bundle))
    prompts = [long_ids[:10], long_ids[:150]]
    both = engine.generate_many(prompts, 20)
    target = tiny_pair().parent / "target"
    assert [g.token_ids for g in both] == [hf_greedy(target, p, 20) for p in prompts]
