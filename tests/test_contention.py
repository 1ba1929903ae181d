"""The thread governor: decode steps drop to one thread while a neighbour holds part of a core, come back when
it leaves, and start again from every thread after an idle gap. Driven by a simulated host whose two-thread
steps stall while a neighbour runs (as measured: a 20 ms step takes ~70 ms), and on a real bundle's engine."""
from __future__ import annotations

import math

import pytest
import torch

from eagle3_runtime.contention import GOVERNOR_ENV, ThreadGovernor, governor_for

STEP = {2: 0.020, 1: 0.034}  # seconds per decode step alone (ratio 1.7, as on a 2-core AMD EPYC)
STALLED = 0.070  # two threads while the neighbour runs


class Host:
    """Step times by thread count, with or without a neighbour; a clock that the steps advance."""

    def __init__(self):
        self.neighbour, self.now = False, 0.0

    def step(self, gov: ThreadGovernor, kind=("speculative", 1)) -> int:
        n = gov.next_threads()
        seconds = STALLED if (self.neighbour and n == 2) else STEP[n]
        self.now += seconds
        gov.observe(kind, n, seconds)
        return n

    def run(self, gov: ThreadGovernor, steps: int) -> list[int]:
        return [self.step(gov) for _ in range(steps)]


def governor(host: Host, **kw) -> ThreadGovernor:
    return ThreadGovernor(2, STEP[1] / STEP[2], clock=lambda: host.now, **kw)


def test_alone_it_keeps_every_thread():
    host = Host()
    gov = governor(host)
    threads = host.run(gov, 200)
    assert gov.switches == 0 and threads.count(1) == 200 // gov.explore_every  # (its exploring steps only)


def test_a_neighbour_drops_it_to_one_thread_and_its_leaving_brings_every_thread_back():
    host = Host()
    gov = governor(host)
    host.run(gov, 20)
    host.neighbour = True
    threads = host.run(gov, 400)
    assert threads[:3] == [2, 2, 1]  # two stalled steps, then one thread
    probes = [i for i, n in enumerate(threads[1:], 1) if n == 2]
    assert probes and all(b - a >= 8 for a, b in zip(probes, probes[1:]))
    assert probes[-1] - probes[-2] == gov.max_probe_every  # (probes that find the core taken back off)
    stalled = sum(n == 2 for n in threads)
    seconds = stalled * STALLED + (len(threads) - stalled) * STEP[1]
    assert seconds < 1.05 * len(threads) * STEP[1]  # within 5% of one thread's speed under the neighbour
    host.neighbour = False
    after = host.run(gov, gov.max_probe_every + 2)
    assert after[-1] == 2 and gov.current == 2


def test_a_server_started_beside_its_neighbour_finds_one_thread_faster():
    host = Host()
    gov = governor(host)
    host.neighbour = True  # (from the first step: no uncontended time to compare with)
    threads = host.run(gov, 200)
    assert threads[gov.explore_every - 1] == 1 and gov.current == 1  # one exploring step on one thread, then one
    assert sum(n == 2 for n in threads) < gov.explore_every + 4


def test_an_idle_gap_starts_again_from_every_thread():
    host = Host()
    gov = governor(host)
    host.run(gov, 10)
    host.neighbour = True
    host.run(gov, 50)
    assert gov.current == 1
    host.neighbour, host.now = False, host.now + 1.0  # (no request for a second)
    assert host.step(gov) == 2 and gov.current == 2


def test_each_kind_of_step_has_its_own_baseline():
    host = Host()
    gov = governor(host)
    for _ in range(10):  # a cheap kind (plain decode at batch 1) and a dear one (a verify at batch 4)
        gov.observe(("decode", 1), 2, 0.012)
        gov.observe(("speculative", 4), 2, 0.045)
    gov.observe(("speculative", 4), 2, 0.046)  # its own usual time: not contended, though 3.8x the cheap kind's
    assert gov.current == 2
    gov.observe(("decode", 1), 2, 0.030)  # 2.5x its own: slower than one thread would be; once is noise
    assert gov.current == 2
    gov.observe(("decode", 1), 2, 0.012)
    gov.observe(("decode", 1), 2, 0.031)  # twice in three steps: contended
    assert gov.current == 1
    assert math.isclose(gov.one_thread_estimate(("speculative", 4)), 0.045 * gov.ratio)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="ratio"):
        ThreadGovernor(2, 0.5)
    with pytest.raises(ValueError, match="threads"):
        ThreadGovernor(0, 1.5)


class _Bundle:
    def __init__(self, ratio, tp=1):
        self.thread_ratio = ratio
        self.manifest = type("M", (), {"tp_degree": tp})()


def test_a_bad_governor_setting_is_one_line_naming_the_choices(tmp_path):
    import subprocess
    import sys

    from eagle3_runtime.contention import governor_enabled
    from eagle3_runtime.errors import Eagle3Error

    assert governor_enabled({}) and not governor_enabled({GOVERNOR_ENV: "off"})
    with pytest.raises(Eagle3Error, match="choose on"):
        governor_enabled({GOVERNOR_ENV: "sometimes"})
    r = subprocess.run([sys.executable, "-m", "eagle3_runtime.server", str(tmp_path), "--port", "8"], capture_output=True,
                       text=True, timeout=120, env={**__import__("os").environ, GOVERNOR_ENV: "sometimes"})
    assert r.returncode == 2 and "EAGLE3_THREAD_GOVERNOR" in r.stderr and "Traceback" not in r.stderr


def test_governor_for_needs_threads_a_ratio_one_rank_and_not_off(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert governor_for(_Bundle(1.6), {}).threads == 2
    assert governor_for(_Bundle(1.6), {GOVERNOR_ENV: "off"}) is None
    assert governor_for(_Bundle(None), {}) is None  # (no warm-up, or one thread)
    assert governor_for(_Bundle(1.6, tp=2), {}) is None
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert governor_for(_Bundle(1.6), {}) is None


def test_the_engine_runs_each_decode_step_on_the_governors_threads(tiny_bundles):
    from eagle3_runtime.bundle import Bundle
    from eagle3_runtime.engine import Engine

    _, path = tiny_bundles.get("speculators", 3)
    threads = torch.get_num_threads()
    bundle = Bundle(path)
    try:
        torch.set_num_threads(2)
        bundle.warm_up()
        assert bundle.thread_ratio is not None and bundle.thread_ratio >= 1.0 and torch.get_num_threads() == 2
        plain = Engine(bundle).generate([1, 2, 3, 4], 24).token_ids

        class Scripted(ThreadGovernor):  # one thread from the third step on, whatever the times
            def next_threads(self):
                self.calls = getattr(self, "calls", 0) + 1
                return 2 if self.calls <= 2 else 1

        seen = []
        gov = Scripted(2, 1.5)
        gov.observe = lambda kind, n, s: seen.append((kind, n, torch.get_num_threads()))
        engine = Engine(bundle, governor=gov)
        assert engine.generate([1, 2, 3, 4], 24).token_ids == plain  # (the same tokens on any thread count)
        assert [n for _, n, _ in seen][:3] == [2, 2, 1] and all(n == t for _, n, t in seen)
        assert {kind[0] for kind, _, _ in seen} <= {"speculative", "decode"} and seen[0][0][1] == 1
        assert b"eagle3_decode_threads" in engine.metrics.render()
    finally:
        torch.set_num_threads(threads)
