"""eagle3_runtime.sampling: target_probs filters, greedy/sampled verification, determinism, and the
statistical must-show that speculative sampling emits the target's own autoregressive distribution."""
import math

import pytest
import torch

from eagle3_runtime.sampling import (SamplingParams, Uniforms, next_token, position_uniform, sample, target_probs,
                                     verify_greedy, verify_sampled)


def draws(gen: torch.Generator):
    """Fresh uniforms from `gen`, one per call (what the statistical checks need: independent trials)."""
    return lambda j=0: float(torch.rand((), generator=gen, dtype=torch.float64))

# ---------------------------------------------------------------------------------------------
# target_probs and SamplingParams


def _vllm_reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """vLLM's apply_top_k_top_p (ascending sort, mask logits), restated independently for comparison."""
    logits = logits.float() / p.temperature
    V = logits.shape[-1]
    srt, idx = logits.sort(-1, descending=False)
    if 0 < p.top_k < V:
        thr = srt[..., V - p.top_k:V - p.top_k + 1]
        srt = srt.masked_fill(srt < thr, -math.inf)
    if p.top_p < 1:
        cum = srt.softmax(-1).cumsum(-1)
        mask = cum <= 1 - p.top_p
        mask[..., -1] = False
        srt = srt.masked_fill(mask, -math.inf)
    return srt.scatter(-1, idx, srt).softmax(-1)


def test_temperature_scaling():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    for t in (0.3, 1.0, 2.5):
        got = target_probs(logits, SamplingParams(temperature=t))
        assert got.dtype == torch.float32 and got.shape == logits.shape
        torch.testing.assert_close(got, torch.softmax(logits / t, -1))
    # lower temperature sharpens: the argmax gains mass
    lo, hi = (target_probs(logits, SamplingParams(temperature=t)).max(-1).values for t in (0.5, 2.0))
    assert (lo > hi).all()
    # half-precision logits are computed in float32
    assert target_probs(logits.bfloat16(), SamplingParams()).dtype == torch.float32


def test_top_k_keeps_exactly_k():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(1))
    for k in (1, 5, 37):
        got = target_probs(logits, SamplingParams(top_k=k))
        assert ((got > 0).sum(-1) == k).all()
        kept = got > 0
        top = logits.topk(k, -1).indices
        assert kept.gather(-1, top).all()  # the k largest, nothing else
        torch.testing.assert_close(got.sum(-1), torch.ones(4))
        # renormalised softmax restricted to the kept set
        ref = torch.softmax(logits.masked_fill(~kept, -math.inf), -1)
        torch.testing.assert_close(got, ref)
    for off in (0, -1, 100, 1000):  # off / >= V: no filtering
        torch.testing.assert_close(target_probs(logits, SamplingParams(top_k=off)), torch.softmax(logits, -1))


def test_top_k_keeps_ties():
    logits = torch.tensor([3.0, 2.0, 2.0, 1.0, 0.0])
    got = target_probs(logits, SamplingParams(top_k=2))
    assert (got > 0).tolist() == [True, True, True, False, False]


def test_top_p_keeps_nucleus():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 0.5 (1), 0.3 (3), 0.15 (2), 0.05 (0)
    logits = probs.log()
    cases = {0.01: {1}, 0.45: {1}, 0.55: {1, 3}, 0.75: {1, 3}, 0.85: {1, 3, 2}, 0.97: {0, 1, 2, 3}, 1.0: {0, 1, 2, 3}}
    for top_p, want in cases.items():
        got = target_probs(logits, SamplingParams(top_p=top_p))
        assert set(got.nonzero().flatten().tolist()) == want, top_p
        assert got.sum().item() == pytest.approx(1.0, abs=1e-6)
        ref = torch.zeros(4)
        ref[list(want)] = probs[list(want)]
        torch.testing.assert_close(got, ref / ref.sum())
    # the argmax survives any top_p, even when it alone exceeds it
    peaked = torch.tensor([10.0, 0.0, 0.0])
    assert target_probs(peaked, SamplingParams(top_p=1e-6)).tolist() == [1.0, 0.0, 0.0]


def test_top_k_then_top_p_order():
    # top-k=2 renormalises to [0.625, 0.375]; top_p=0.6 then keeps only the argmax (on the raw
    # distribution 0.5 < 0.6 would have kept two tokens)
    logits = torch.tensor([0.05, 0.5, 0.15, 0.3]).log()
    got = target_probs(logits, SamplingParams(top_k=2, top_p=0.6))
    assert got.tolist() == [0.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("params", [SamplingParams(top_p=0.9), SamplingParams(temperature=0.7, top_k=20),
                                    SamplingParams(temperature=1.3, top_k=50, top_p=0.8),
                                    SamplingParams(temperature=0.5, top_p=0.95)])
def test_matches_vllm_reference(params):
    g = torch.Generator().manual_seed(2)
    for V in (64, 3000):  # 3000 > the top-p candidate window: exercises both paths
        logits = torch.randn(8, V, generator=g) * 3
        torch.testing.assert_close(target_probs(logits, params), _vllm_reference(logits, params))


def test_top_p_full_sort_fallback():
    # flat distribution over a large vocab: the 1024 largest hold < top_p, so the full sort runs
    logits = torch.zeros(5000)
    logits[7] = 1.0
    got = target_probs(logits, SamplingParams(top_p=0.5))
    n = int((got > 0).sum())
    assert got[7] > 0 and 2400 < n < 2600  # roughly half of 5000 near-equal tokens


def test_greedy_params():
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.5).greedy
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(3))
    g = logits.argmax(-1)
    gp = SamplingParams(temperature=0.0, top_p=0.5, top_k=3)
    assert target_probs(logits, gp).equal(torch.nn.functional.one_hot(g, 30).float())
    assert next_token(logits[0], gp, None) == int(g[0])
    drafts = g[:3].tolist()
    assert verify_greedy(logits, drafts) == (3, drafts + [int(g[3])])
    bad = [drafts[0], (drafts[1] + 1) % 30, drafts[2]]
    assert verify_greedy(logits, bad) == (1, [drafts[0], int(g[1])])
    assert verify_greedy(logits, [(drafts[0] + 1) % 30] + drafts[1:]) == (0, [int(g[0])])
    for d in (drafts, bad):  # greedy params route verify_sampled to verify_greedy (no generator needed)
        assert verify_sampled(logits, d, gp, None) == verify_greedy(logits, d)


def test_verify_shape_checked():
    with pytest.raises(ValueError, match=r"K\+1"):
        verify_greedy(torch.randn(3, 10), [1, 2, 3])
    with pytest.raises(ValueError, match=r"K\+1"):
        verify_sampled(torch.randn(3, 10), [1, 2, 3], SamplingParams(), draws(torch.Generator()))


@pytest.mark.parametrize("kw, msg", [({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
                                     ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_p": -1}, "top_p"),
                                     ({"top_k": -2}, "top_k"), ({"top_k": 2.5}, "top_k"), ({"seed": "x"}, "seed")])
def test_validate_errors(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw).validate()


def test_validate_ok():
    for kw in ({}, {"temperature": 0}, {"top_p": 1.0, "top_k": -1}, {"top_k": 0}, {"top_p": 0.01, "top_k": 5, "seed": 0}):
        SamplingParams(**kw).validate()


def _extreme_logits(V: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    out = [torch.randn(V, generator=g) * s for s in (1e-6, 1.0, 30.0, 1e4, 1e30)]
    out.append(torch.zeros(V))  # every token tied
    one = torch.full((V,), -math.inf)
    one[3] = 0.0
    out.append(one)  # one finite logit (a masked vocabulary)
    huge = torch.randn(V, generator=g)
    huge[5], huge[6] = float("inf"), 3e38
    out.append(huge)
    return out


@pytest.mark.parametrize("temperature", [1e-5, 1e-3, 0.5, 1.0, 1e6, 1e30])
def test_sampling_is_safe_at_extreme_values(temperature):
    """Whatever the logits and the filters: a finite distribution summing to 1 that keeps the most likely
    token (a top_p or top_k that would leave nothing keeps it), and every uniform draws a token it gives mass."""
    V = 40
    for logits in _extreme_logits(V):
        base = target_probs(logits, SamplingParams(temperature=temperature))
        for top_p in (5e-324, 1e-300, 1e-45, 1e-7, 0.3, 1.0):
            for top_k in (-1, 0, 1, 2, V - 1, V, 10 ** 9):
                p = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
                p.validate()
                probs = target_probs(logits, p)
                assert torch.isfinite(probs).all() and (probs >= 0).all(), (logits, p)
                assert abs(float(probs.sum()) - 1) < 1e-5, (logits, p, probs)
                assert base[probs > 0].max() == base.max(), (logits, p, probs)  # a most likely token is kept
                for u in (0.0, 0.5, 1 - 2 ** -53):
                    assert probs[sample(probs, u)] > 0
                if top_k == 1 or top_p < 1e-7:  # only the most likely token (or tokens tied with it) is left
                    assert bool((base[probs > 0] == base.max()).all()), (logits, p, probs)


def test_sample_never_picks_zero_probability():
    u = draws(torch.Generator().manual_seed(4))
    probs = torch.tensor([0.0, 0.3, 0.0, 0.7, 0.0])
    seen = {sample(probs, u()) for _ in range(2000)}
    assert seen == {1, 3}
    assert sample(torch.tensor([0.0, 0.0, 2.0, 0.0]), u()) == 2  # unnormalised, single mass
    assert sample(probs, 0.0) == 1 and sample(probs, 0.35) == 3 and sample(probs, 1 - 2 ** -53) == 3


def test_certain_drafts_always_accepted():
    logits = torch.full((4, 6), -1e4)
    drafts = [2, 5, 0]
    for i, d in enumerate(drafts):
        logits[i, d] = 0.0
    logits[3, 1] = 0.0
    u = draws(torch.Generator().manual_seed(5))
    for _ in range(200):
        assert verify_sampled(logits, drafts, SamplingParams(), u) == (3, drafts + [1])


# ---------------------------------------------------------------------------------------------
# determinism


def test_same_seed_same_outputs():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(6))
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1234)

    def run(stream: Uniforms):
        out = [verify_sampled(logits, [0, 1, 2, 3], params, stream.at(t)) for t in range(100)]
        return out + [next_token(logits[0], params, stream.at(t)) for t in range(100)]

    a, b = run(params.uniforms()), run(params.uniforms())
    assert a == b
    assert run(SamplingParams(seed=99).uniforms()) != a
    assert SamplingParams(seed=-1).uniforms().seed == SamplingParams(seed=2 ** 64 - 1).uniforms().seed  # 64-bit wrap
    # seed None: fresh entropy, two streams differ
    x, y = SamplingParams().uniforms(), SamplingParams().uniforms()
    assert [x.at(t)() for t in range(8)] != [y.at(t)() for t in range(8)]


def test_position_uniforms_are_uniform_and_independent_of_order():
    """One uniform per (seed, position): the same whichever positions were drawn before, in [0, 1), and
    uniform (a chi-square over 20 bins of 100k draws across seeds and positions)."""
    assert Uniforms(7).at(5)(2) == position_uniform(7, 7) == Uniforms(7).at(7)()
    us = torch.tensor([position_uniform(s, t) for s in range(1000) for t in range(100)])
    assert 0 <= float(us.min()) and float(us.max()) < 1
    counts = torch.histc(us, bins=20, min=0, max=1)
    chi2 = float(((counts - len(us) / 20) ** 2 / (len(us) / 20)).sum())
    assert chi2 < 43.8  # 19 degrees of freedom, p = 0.001


# ---------------------------------------------------------------------------------------------
# statistical must-show: emitted tokens follow the target's autoregressive distribution

V, K = 6, 3
TRIALS = 20000
NULL_REPS = 200
QUANTILE = 0.999


def _tv(counts: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Total-variation distance between empirical counts [..., C] and the distribution p [C]."""
    n = counts.sum(-1, keepdim=True).clamp(min=1)
    return 0.5 * (counts / n - p).abs().sum(-1)


def _null_threshold(p: torch.Tensor, n: int, gen: torch.Generator) -> float:
    """99.9th percentile of the TV statistic for n samples drawn directly from p (NULL_REPS repetitions;
    with 200 that is about the largest null value, i.e. a false-alarm rate of ~1/200 per check)."""
    draws = torch.multinomial(p.expand(NULL_REPS, -1), n, replacement=True, generator=gen)  # [R, n]
    counts = torch.zeros(NULL_REPS, p.numel()).scatter_add_(1, draws, torch.ones_like(draws, dtype=torch.float))
    return float(torch.quantile(_tv(counts, p), QUANTILE))


def _conditional_checks(sampler, logits, drafts, params, seed=0, trials=TRIALS):
    """Run `sampler` `trials` times; for each position j compare the distribution of emitted token j
    among trials whose first j tokens are d_1..d_j with p_j. A trial that stopped after exactly
    those j tokens counts in an extra "stopped" category (target probability 0).
    Returns [(j, n_j, tv_j, threshold_j)]."""
    probs = target_probs(logits, params)
    gen = torch.Generator().manual_seed(seed)
    pad = [-1] * (K + 1)
    u = draws(gen)
    outs = torch.tensor([(sampler(logits, drafts, params, u)[1] + pad)[:K + 1] for _ in range(trials)])
    d = torch.tensor(drafts)
    null_gen = torch.Generator().manual_seed(seed + 1)
    results = []
    for j in range(K + 1):
        prefix_ok = (outs[:, :j] == d[:j]).all(1)
        nxt = outs[prefix_ok, j]
        counts = torch.bincount(nxt.masked_fill(nxt < 0, V), minlength=V + 1).float()  # V = stopped
        n = int(counts.sum())
        if n == 0:
            results.append((j, 0, float("nan"), float("nan")))
            continue
        p_j = torch.cat([probs[j], torch.zeros(1)])
        results.append((j, n, float(_tv(counts, p_j)), _null_threshold(p_j, n, null_gen)))
    return results


def _passes(results) -> bool:
    return all(n == 0 or tv <= thr for _, n, tv, thr in results)


def _fixed_logits():
    return torch.randn(K + 1, V, generator=torch.Generator().manual_seed(2024))


def _good_drafts(probs):
    return probs[:K].argmax(-1).tolist()


def _bad_drafts(probs):
    return probs[:K].argmin(-1).tolist()


def _report(name, results):
    print(f"\n{name}: " + "; ".join(f"pos {j}: n={n} TV={tv:.4f} thr={thr:.4f}" for j, n, tv, thr in results))


@pytest.mark.parametrize("which", ["good", "bad"])
def test_speculative_sampling_preserves_target_distribution(which):
    logits, params = _fixed_logits(), SamplingParams(temperature=1.0)
    probs = target_probs(logits, params)
    drafts = _good_drafts(probs) if which == "good" else _bad_drafts(probs)
    results = _conditional_checks(verify_sampled, logits, drafts, params)
    _report(f"verify_sampled, {which} draft {drafts}", results)
    assert _passes(results), results
    # (a bad chain's full acceptance has probability ~1e-4: positions 0..K-1 are reached, K may not be)
    assert results[0][1] == TRIALS and all(n > 0 for _, n, _, _ in results[:K])
    if which == "good":  # enough samples at every position for the check to have power
        assert all(n >= 500 for _, n, _, _ in results)


def test_speculative_sampling_with_filters():
    """Same must-show with temperature/top-k/top-p: the emitted tokens follow the *filtered* target,
    including draft tokens the filter removed (always rejected)."""
    logits = _fixed_logits()
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)
    probs = target_probs(logits, params)
    drafts = _good_drafts(probs)
    drafts[1] = int(probs[1].argmin())  # filtered out: p = 0, must always be rejected
    assert probs[1, drafts[1]] == 0
    results = _conditional_checks(verify_sampled, logits, drafts, params, trials=10000)
    _report(f"verify_sampled (T=0.7, top_k=4, top_p=0.9), drafts {drafts}", results)
    assert _passes(results), results
    assert results[2][1] == 0  # nothing got past the filtered draft


# broken samplers: the same check must reject them (proves the test can fail)

def _always_accept(logits, drafts, params, u):
    probs = target_probs(logits, params)
    return len(drafts), list(drafts) + [sample(probs[-1], u())]


def _resample_from_p(logits, drafts, params, u):
    """Classic bug: on rejection sample from p_i instead of the residual (p_i without the draft)."""
    probs = target_probs(logits, params)
    for i, d in enumerate(drafts):
        if u() >= probs[i, d]:
            return i, list(drafts[:i]) + [sample(probs[i], u())]
    return len(drafts), list(drafts) + [sample(probs[-1], u())]


def _bonus_from_wrong_position(logits, drafts, params, u):
    """Off-by-one: the bonus token drawn from p_{K-1} instead of p_K."""
    a, out = verify_sampled(logits, drafts, params, u)
    if a == len(drafts):
        out[-1] = sample(target_probs(logits, params)[-2], u())
    return a, out


@pytest.mark.parametrize("broken, trials", [(_always_accept, 5000), (_resample_from_p, 5000),
                                            (_bonus_from_wrong_position, TRIALS)])
def test_broken_sampler_fails_the_check(broken, trials):
    logits, params = _fixed_logits(), SamplingParams(temperature=1.0)
    probs = target_probs(logits, params)
    results = _conditional_checks(broken, logits, _good_drafts(probs), params, trials=trials)
    _report(f"broken {broken.__name__}", results)
    assert not _passes(results), results
