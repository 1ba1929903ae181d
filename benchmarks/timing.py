"""Warm-up and interleaved timing: every contender gets a first call outside the figures, and the timed calls
alternate contender by contender, so a slow moment of a shared host hits every contender alike."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable


def interleaved_ms(calls: dict[Hashable, Callable[[], object]], repeats: int) -> dict[Hashable, list[float]]:
    """ms per call of each contender: one warm-up round, then `repeats` rounds calling each in turn."""
    ms: dict[Hashable, list[float]] = {k: [] for k in calls}
    for rep in range(repeats + 1):
        for k, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            if rep:
                ms[k].append((time.perf_counter() - t0) * 1e3)
    return ms


def median(xs: list[float], digits: int = 3) -> float | None:
    return round(statistics.median(xs), digits) if xs else None


def warm_engine(engine, ids: list[int], max_tokens: int) -> None:
    """A first call of every graph a generation uses (prefill, draft, verify, catch-up, plain decode)."""
    for spec in (True, False):
        engine.generate(ids, min(4, max_tokens), speculative=spec)
