"""The adaptive-speculation chooser (eagle3_runtime.adaptive) with injected costs and acceptance: it picks
the shape with the most tokens per second, holds it under noisy rounds, switches to plain decoding when the
draft stops accepting (probing rarely), and back when it accepts again."""
import random
import time

import pytest

from eagle3_runtime.adaptive import NONE, Candidate, Chooser

DECODE_MS = 40.0
# a demo-like host: verify of 4 nodes ~1.1 decode passes, draft steps + catch-up ~0.3
CHAIN3 = Candidate("chain K 3", round_s=(1.1 + 0.3) * DECODE_MS / 1e3, reach=(0.6, 0.35, 0.2))
TREE = Candidate("tree depth 3 topk 2 nodes 8", round_s=(1.5 + 0.4) * DECODE_MS / 1e3, reach=(0.75, 0.5, 0.3))
PLAIN = Candidate(NONE, round_s=DECODE_MS / 1e3)


def chooser(*cands, **kw) -> Chooser:
    return Chooser(list(cands), **kw)


def rounds(c: Chooser, n: int, accept, rng: random.Random, cost=None) -> list[str]:
    """n engine steps; a speculative step accepts `accept(shape, rng)` drafts; each step takes `cost(shape, rng)`
    seconds (default: its warm-up prior, 5% noise); returns the shapes run."""
    ran = []
    prior = {x.name: x.round_s for x in c.candidates}
    for _ in range(n):
        name = c.next_shape()
        ran.append(name)
        if name != NONE:
            c.observe(name, accept(name, rng))
        c.observe_time(name, cost(name, rng) if cost else prior[name] * rng.uniform(0.95, 1.05))
    return ran


def from_profile(factor: float):
    """Accepted drafts sampled so that P(>= d+1 accepted) = factor * reach[d] (a drifted profile)."""
    def accept(name, rng):
        reach = {c.name: c.reach for c in (CHAIN3, TREE)}[name]
        u = rng.random()
        return sum(u < factor * r for r in reach)
    return accept


def test_picks_the_fastest_expected_shape():
    c = chooser(PLAIN, CHAIN3, TREE)
    rates = {n: c.rate(n) for n in (NONE, CHAIN3.name, TREE.name)}
    assert rates[NONE] == pytest.approx(25.0)
    assert rates[CHAIN3.name] == pytest.approx(2.15 / 0.056)
    assert c.current == max(rates, key=rates.get) == CHAIN3.name
    # the same candidates on a host where the verify pass costs three decode passes: nothing pays
    slow = [Candidate(x.name, round_s=x.round_s * 2.5, reach=x.reach) for x in (CHAIN3, TREE)]
    assert chooser(PLAIN, *slow).current == NONE
    assert "no speculation" in chooser(PLAIN, CHAIN3).reason() and "tok/s" in chooser(PLAIN, *slow).reason()


def test_holds_its_choice_under_noise():
    """Tree and chain within ~3% of each other: per-round noise (acceptance 0..3) must not make it flap."""
    near = Candidate("chain K 3", round_s=TREE.round_s * (1 + 0.75 + 0.5 + 0.3) / (1 + 0.6 + 0.35 + 0.2) / 1.03,
                     reach=CHAIN3.reach)
    c = chooser(PLAIN, near, TREE)
    start = c.current
    ran = rounds(c, 3000, lambda name, rng: from_profile(1.0)(CHAIN3.name if name == near.name else name, rng),
                 random.Random(0))
    assert c.switches == 0 and c.current == start
    probes = [n for n in ran if n != start]  # (plain decoding, then the other shape, every probe_every steps)
    assert len(probes) <= 2 * c.min_timed + 3000 // c.probe_every and NONE in probes


def test_switches_to_plain_when_acceptance_drifts_and_back_when_it_returns():
    c = chooser(PLAIN, CHAIN3, TREE, probe_every=64)
    rng = random.Random(1)
    assert c.current == CHAIN3.name
    # the draft stops accepting (a fine-tuned target): plain decoding within two half-lives
    ran = rounds(c, 400, lambda name, r: 0, rng)
    assert c.current == NONE, c.reason()
    assert ran.index(NONE) < 2 * c.half_life
    # while plain: one probing round in every 64 steps, at most
    ran = rounds(c, 2000, lambda name, r: 0, rng)
    assert c.current == NONE and ran.count(NONE) >= 2000 * (1 - 1 / 64) - 1
    # acceptance comes back: the probes see it and speculation resumes
    ran = rounds(c, 64 * 60, from_profile(1.0), rng)
    assert c.current != NONE, c.reason()
    assert 0.8 < c.drift < 1.2


def test_a_degraded_draft_costs_at_most_the_probes():
    """A draft that accepts almost nothing, chosen by its (wrong) build-time profile at first: after a short
    learning phase the steps are plain except one probe in probe_every."""
    c = chooser(PLAIN, CHAIN3, probe_every=64)
    ran = rounds(c, 5000, from_profile(0.03), random.Random(2))
    later = ran[500:]
    assert c.current == NONE and sum(n != NONE for n in later) <= len(later) // 64 + 1


def test_live_step_times_overrule_the_warm_up_prior():
    """The warm-up's graph times say chain K 3 pays (2.15 tokens per 1.4 decode passes) but its steps really take
    2.6 decode passes (host work per round, a smaller context than the timed one): after the plain probes it
    decodes plainly within a few dozen steps, and probes the chain rarely after. The converse (the prior says
    plain, the rounds are cheap in fact) starts speculating once its probes are timed."""
    slow = {NONE: PLAIN.round_s, CHAIN3.name: 2.6 * PLAIN.round_s}
    c = chooser(PLAIN, CHAIN3)
    assert c.current == CHAIN3.name and "warm-up graph times" in c.reason()
    ran = rounds(c, 2000, from_profile(1.0), random.Random(3), cost=lambda n, r: slow[n] * r.uniform(0.95, 1.05))
    assert c.current == NONE and c.switches == 1 and "live step times" in c.reason()
    assert ran.index(NONE) <= c.explore_after and NONE not in ran[:ran.index(NONE)]
    switched = c.min_timed * c.explore_after + 1
    assert CHAIN3.name in ran[switched:]  # (it keeps probing the chain)
    assert ran[switched:].count(CHAIN3.name) <= (2000 - switched) // c.probe_every + c.min_timed
    assert c.drift == pytest.approx(1.0, abs=0.3)  # (acceptance as profiled: the times decided)

    cheap = {NONE: PLAIN.round_s, CHAIN3.name: 1.1 * PLAIN.round_s}
    dear = Candidate(CHAIN3.name, round_s=3.0 * PLAIN.round_s, reach=CHAIN3.reach)
    c = chooser(PLAIN, dear)
    assert c.current == NONE
    ran = rounds(c, 200, from_profile(1.0), random.Random(4), cost=lambda n, r: cheap[n] * r.uniform(0.95, 1.05))
    assert c.current == CHAIN3.name and ran.index(CHAIN3.name) == c.explore_after - 1
    assert ran[c.min_timed * c.explore_after + 1:].count(NONE) <= 200 // c.probe_every + c.min_timed


def test_shapes_are_compared_within_one_context_bucket():
    """Rows grow out of the 256-slot context into the 512-slot one, where every step costs more: the chain's times
    from the shorter context must not be weighed against plain decoding's from the longer (it would flap back to
    speculating); there the chain is priced at plain decoding's time times their ratio at 256."""
    c = chooser(PLAIN, CHAIN3)
    assert c.current == CHAIN3.name
    for name, ms in ((CHAIN3.name, 48), (NONE, 19)) * c.min_timed:
        c.next_shape(256)
        c.observe_time(name, ms / 1e3)
    assert c.current == NONE and c.switches == 1  # 2.15 tokens / 48 ms < 1 / 19 ms
    for _ in range(5):
        c.next_shape(512)
        c.observe_time(NONE, 24 / 1e3)
    assert c.context == 512 and c.seconds(CHAIN3.name) == pytest.approx(24 * 48 / 19 / 1e3)
    assert c.current == NONE and c.switches == 1, c.reason()
    # (the chain is probed there every probe_every steps, and its own times there decide from then on)
    ran = [c.next_shape(512) for _ in range(c.probe_every)]
    assert ran.count(CHAIN3.name) == 1


def test_an_untimed_shape_is_priced_at_the_live_over_prior_ratio():
    c = chooser(PLAIN, CHAIN3, TREE)
    for _ in range(c.min_timed):
        c.observe_time(CHAIN3.name, 2 * CHAIN3.round_s)
    assert c.seconds(CHAIN3.name) == pytest.approx(2 * CHAIN3.round_s)
    assert c.seconds(TREE.name) == pytest.approx(2 * TREE.round_s) and c.seconds(NONE) == pytest.approx(2 * PLAIN.round_s)
    c.observe_time(NONE, float("nan"))  # (ignored)
    assert not c.live(NONE)


@pytest.mark.parametrize("bad, words", [
    ([CHAIN3], "must include plain decoding"),
    ([PLAIN, CHAIN3, CHAIN3], "names repeat"),
    ([PLAIN, Candidate("x", round_s=0.0, reach=(0.5,))], "positive number"),
    ([PLAIN, Candidate("x", round_s=0.1, reach=(0.2, 0.5))], "non-increasing"),
])
def test_bad_candidates_are_refused(bad, words):
    with pytest.raises(ValueError, match=words):
        Chooser(bad)


def test_round_seconds_from_a_bundle_manifest(tiny):
    """A real tiny bundle's manifest (chain K 3 at batch 1, its draft unrolled) and injected per-graph times: a
    round costs verify + the unrolled draft + catch-up, plain decoding one decode pass; a graph without a time is
    named."""
    from eagle3_runtime.adaptive import round_seconds
    from eagle3_runtime.manifest import MANIFEST, Manifest

    m = Manifest.model_validate_json((tiny.bundle().path / MANIFEST).read_text())
    ms = {"target_decode": 40, "target_verify": 44, "draft_chain": 6, "draft_catchup": 5, "target_prefill": 90,
          "draft_prefill": 9}
    secs = {g.name: ms[g.role] / 1e3 for g in m.graphs}
    got = round_seconds(m, secs, 1)
    assert got == pytest.approx({NONE: 0.040, "chain K 3": 0.044 + 0.006 + 0.005})
    c = Chooser([Candidate(n, s, () if n == NONE else (0.6, 0.35, 0.2)) for n, s in got.items()])
    assert c.current == "chain K 3"
    del secs[m.graph("draft_chain", 1).name]
    with pytest.raises(KeyError, match="draft_chain"):
        round_seconds(m, secs, 1)


def test_engine_auto_serves_what_costs_and_acceptance_favour_and_stays_lossless(tiny):
    """The engine with --speculation auto on a real tiny bundle: the warm-up times the decode loop's graphs
    (costs); with injected costs and a recorded acceptance profile it speculates where that pays and decodes
    plainly where not (saying so in its report and metrics) — the same tokens either way."""
    from prometheus_client import generate_latest

    from eagle3_runtime.bundle import Bundle
    from eagle3_runtime.engine import Engine
    from eagle3_runtime.graph_contract import BATCH_ROLES

    b = Bundle(tiny.bundle().path)
    b.warm_up()
    m = b.manifest
    assert set(b.costs) == {g.name for g in m.graphs if g.role in BATCH_ROLES} and min(b.costs.values()) > 0
    shape = m.speculation[1].describe()
    ids = list(range(5, 21))
    ref = Engine(b, speculation="always").generate(ids, 24)
    assert ref.stats.num_drafts > 0
    ms = {"target_decode": 40, "target_verify": 44, "draft_chain": 6, "draft_catchup": 5}
    b.backend.costs = {g.name: ms[g.role] / 1e3 for g in m.graphs if g.role in ms}
    for reach, served in (([0.9, 0.8, 0.7], shape), ([0.02, 0.0, 0.0], NONE)):
        m.build["acceptance"] = {shape: {"reach": reach}}
        e = Engine(b, speculation="auto")
        assert e.choosers[1].current == served and e.speculation_report()[0].startswith(f"speculation at batch 1: {served}")
        gen = e.generate(ids, 24)
        assert gen.token_ids == ref.token_ids
        # (decoding plainly: speculative rounds only as probes, the first min_timed of them every explore_after)
        assert gen.stats.num_drafts > e.choosers[1].min_timed if served != NONE else \
            0 < gen.stats.num_drafts <= e.choosers[1].min_timed
        # (live step times may overrule the injected costs later on: the gauge says what the chooser serves now)
        now = e.choosers[1].current
        assert f'eagle3_speculation_shape{{bucket="1",shape="{now}"}} 1.0' in generate_latest(e.metrics.registry).decode()
    none = Engine(b, speculation="none")
    assert none.speculation_report() == ["speculation: none (--speculation none)"]
    assert none.generate(ids, 24).token_ids == ref.token_ids


def test_recorded_acceptance_is_clipped_to_a_profile(tiny):
    from eagle3_runtime.adaptive import PRIOR_REACH, acceptance_profile
    from eagle3_runtime.manifest import MANIFEST, Manifest

    m = Manifest.model_validate_json((tiny.bundle().path / MANIFEST).read_text())
    shape = m.speculation[1]
    assert acceptance_profile(m, shape) == tuple(PRIOR_REACH ** (d + 1) for d in range(shape.depth))
    m.build["acceptance"] = {shape.describe(): {"reach": [1.7, 0.9, float("nan"), 0.5]}}
    assert acceptance_profile(m, shape) == (1.0, 0.9, 0.0)
    m.build["acceptance"] = {shape.describe(): {"reach": "high"}}
    assert acceptance_profile(m, shape)[0] == PRIOR_REACH


def test_speculation_flags(monkeypatch):
    from argparse import ArgumentParser

    from eagle3_runtime.adaptive import add_speculation_arg, speculation_mode
    from eagle3_runtime.errors import Eagle3Error

    ap = ArgumentParser()
    add_speculation_arg(ap)
    assert speculation_mode(ap.parse_args([]), {}) == "auto"
    assert speculation_mode(ap.parse_args([]), {"EAGLE3_SPECULATION": "always"}) == "always"
    assert speculation_mode(ap.parse_args(["--speculation", "none"]), {"EAGLE3_SPECULATION": "always"}) == "none"
    assert speculation_mode(ap.parse_args(["--no-spec", "--speculation", "auto"]), {}) == "none"
    with pytest.raises(Eagle3Error, match=r"--speculation 'fast': choose one of auto, always, none"):
        speculation_mode(ap.parse_args(["--speculation", "fast"]), {})
    with pytest.raises(Eagle3Error, match=r"\$EAGLE3_SPECULATION 'yes'"):
        speculation_mode(ap.parse_args([]), {"EAGLE3_SPECULATION": "yes"})


@pytest.mark.parametrize("record", [None, [], {"rows": [1, 2]}, {"rows": {"1": "plain"}}, {"rows": {"1": {"choice": 7}}, "cpu": {}}])
def test_a_malformed_gemm_record_is_described_or_skipped_never_raises(record):
    from eagle3_runtime.packing import describe_choice

    line = describe_choice(record)
    assert line is None or line.startswith("GEMM per token row count")


def test_the_preferred_shape_starts_when_it_is_within_the_margin():
    """Start-up timing noise must not pick among near-equal shapes: the bucket's own shape starts unless
    another is more than the margin faster; it never starts where plain decoding is faster."""
    near = Candidate("chain K 1", round_s=CHAIN3.round_s * (1 + 0.6) / (1 + 0.6 + 0.35 + 0.2) / 1.03, reach=(0.6,))
    far = Candidate("chain K 1", round_s=near.round_s / 1.1, reach=(0.6,))
    assert chooser(PLAIN, CHAIN3, near).current == "chain K 1"
    assert chooser(PLAIN, CHAIN3, near, preferred=CHAIN3.name).current == CHAIN3.name
    assert chooser(PLAIN, CHAIN3, far, preferred=CHAIN3.name).current == "chain K 1"
    slow = [Candidate(x.name, round_s=x.round_s * 2.5, reach=x.reach) for x in (CHAIN3, near)]
    assert chooser(PLAIN, *slow, preferred=CHAIN3.name).current == NONE
    # within the margin of the best but slower than plain decoding: the best starts, never the slower one
    best = Candidate("chain K 1", round_s=PLAIN.round_s * 1.6 / 1.02, reach=(0.6,))  # 1.02x plain
    under = Candidate(CHAIN3.name, round_s=PLAIN.round_s * 2.15 / 0.99, reach=CHAIN3.reach)  # 0.99x plain
    assert chooser(PLAIN, under, best, preferred=CHAIN3.name).current == "chain K 1"


def test_each_batch_bucket_chooses_from_its_own_costs(bundle):
    """A bundle with batch buckets 1 and 2 and injected per-graph costs: where the verify of two rows costs what it
    brings (a compute-bound batch) the bucket decodes plainly, while batch 1 speculates; two requests at once run in
    the batch-2 bucket without speculation and give the tokens each gives alone."""
    from eagle3_runtime.bundle import Bundle
    from eagle3_runtime.engine import Engine

    b = Bundle(bundle)
    b.warm_up()
    m = b.manifest
    assert m.batch_buckets == [1, 2]
    shape = {k: s.describe() for k, s in m.speculation.items()}
    ms = {1: {"target_decode": 40, "target_verify": 44, "draft_chain": 6, "draft_catchup": 5},
          2: {"target_decode": 42, "target_verify": 120, "draft_chain": 8, "draft_catchup": 7}}
    b.backend.costs = {g.name: ms[g.bucket][g.role] / 1e3 for g in m.graphs
                       if g.role in ms[1] and g.bucket in ms}
    m.build["acceptance"] = {s: {"reach": [0.6, 0.35, 0.2]} for s in shape.values()}
    e = Engine(b, speculation="auto")
    assert e.choosers[1].current == shape[1] and e.choosers[2].current == NONE
    report = e.speculation_report()
    assert report[0].startswith(f"speculation at batch 1: {shape[1]}") and report[1].startswith("speculation at batch 2: none")
    prompts = [list(range(5, 21)), list(range(30, 41))]
    alone = [Engine(b, speculation="none").generate(p, 16).token_ids for p in prompts]
    together = e.generate_many(prompts, 16)
    assert [g.token_ids for g in together] == alone
    from prometheus_client import generate_latest

    text = generate_latest(e.metrics.registry).decode()  # (batch 1 speculated; the steps of two rows were plain)
    assert 'eagle3_step_latency_seconds_count{kind="decode"}' in text and \
        float(text.split('eagle3_step_latency_seconds_count{kind="decode"} ')[1].split()[0]) > 0
    assert sum(g.stats.num_drafts for g in together) > 0


class _Slowed:
    """A graph that takes `seconds` longer than it does (a host where that step costs more than warm-up said)."""

    def __init__(self, graph, seconds: float):
        self.graph, self.entry, self.seconds = graph, graph.entry, seconds

    def __call__(self, *args):
        time.sleep(self.seconds)
        return self.graph(*args)


def test_engine_auto_follows_what_steps_really_cost(tiny):
    """A real tiny bundle whose injected warm-up costs favour speculation while its verify really takes 30 ms more
    (and then the converse: costs favour plain decoding, the decode pass is the slow one): --speculation auto
    probes the alternative, times the steps live and serves the faster one, saying why — the same tokens."""
    from prometheus_client import generate_latest

    from eagle3_runtime.bundle import Bundle
    from eagle3_runtime.engine import Engine

    b = Bundle(tiny.bundle().path)
    b.warm_up()
    m = b.manifest
    shape = m.speculation[1].describe()
    ids = list(range(5, 21))
    ref = Engine(b, speculation="none").generate(ids, 48)
    m.build["acceptance"] = {shape: {"reach": [0.9, 0.8, 0.7]}}
    graphs, role = dict(b.backend.graphs), {g.name: g.role for g in m.graphs}
    try:
        for slow_role, ms, served in (("target_verify", {"target_decode": 40, "target_verify": 44}, NONE),
                                      ("target_decode", {"target_decode": 40, "target_verify": 400}, shape)):
            ms = {**ms, "draft_chain": 6, "draft_catchup": 5}
            b.backend.costs = {g.name: ms[g.role] / 1e3 for g in m.graphs if g.role in ms}
            b.backend.graphs = {n: _Slowed(g, 0.03) if role[n] == slow_role else g
                                for n, g in graphs.items()}
            e = Engine(b, speculation="auto")
            c = e.choosers[1]
            assert c.current != served
            gen = e.generate(ids, 48)
            assert gen.token_ids == ref.token_ids
            assert c.current == served and c.switches >= 1, e.speculation_report()
            assert "live step times" in e.speculation_report()[0]
            text = generate_latest(e.metrics.registry).decode()
            assert f'eagle3_speculation_shape{{bucket="1",shape="{served}"}} 1.0' in text
            assert 'eagle3_speculation_switches_total{bucket="1"}' in text
    finally:
        b.backend.graphs = graphs
        m.build.pop("acceptance", None)
