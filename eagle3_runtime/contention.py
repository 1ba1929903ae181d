"""Threads under contention: the engine's decode steps on all its threads, or on one while another process
takes part of a core.

Torch's OpenMP splits each kernel statically between its threads, so a thread whose core is shared waits at
every barrier for its turn: with a neighbour busy half of one core, two threads run slower than one. The
governor watches each decode step's time against the fastest recent time of the same kind of step at each
thread count, drops to one thread when the full count is slower than one thread would be, and probes the full
count now and then to come back once the core is free again (every `probe_every` steps, twice as long after each
probe that found the core still taken, up to `max_probe_every`). Every `explore_every` steps on the full count
one step runs on one thread, so that one thread's time is known even where the core was never free (a server
started next to its neighbour). After `idle_s` without a decode step (no work) it starts again from the full
count: what held a core then says little about now.
"""
from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class ThreadGovernor:
    """`threads`: the full count; `ratio`: one thread's step time over the full count's when uncontended (measured
    at warm-up), the estimate of a kind of step's one-thread time until it has run on one; `margin`: how much
    slower than that estimate a full-count step must be to count as contended; `patience`: contended steps
    among the last three on the full count before dropping to one thread (one slow step is noise); `window`: recent steps per (kind, threads) whose minimum is the baseline."""

    threads: int
    ratio: float
    margin: float = 0.10
    patience: int = 2
    probe_every: int = 8
    max_probe_every: int = 128
    explore_every: int = 128
    window: int = 32
    idle_s: float = 0.5
    clock: Callable[[], float] = time.monotonic
    current: int = field(init=False)
    switches: int = field(init=False, default=0)
    _times: dict = field(init=False, default_factory=dict)
    _slow: collections.deque = field(init=False, default_factory=lambda: collections.deque(maxlen=3))
    _since_probe: int = field(init=False, default=0)
    _interval: int = field(init=False, default=0)
    _last: float = field(init=False, default=-math.inf)
    _since_explore: int = field(init=False, default=0)
    _probing: bool = field(init=False, default=False)

    def __post_init__(self):
        if self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        if not (self.ratio >= 1.0 and math.isfinite(self.ratio)):
            raise ValueError(f"ratio (one thread's time over the full count's) must be >= 1, got {self.ratio}")
        self.current = self.threads
        self._interval = self.probe_every

    def next_threads(self) -> int:
        """The thread count for the next decode step: the current one, or the full count as a probe."""
        if self.current < self.threads and self.clock() - self._last > self.idle_s:
            self._interval = self.probe_every
            self._switch(self.threads)
        if self.current < self.threads:
            self._since_probe += 1
            if self._since_probe >= self._interval:
                self._since_probe, self._probing = 0, True
                return self.threads
            return self.current
        self._since_explore += 1
        if self.threads > 1 and self._since_explore >= self.explore_every:
            self._since_explore = 0
            return 1
        return self.current

    def baseline(self, kind, threads: int) -> float:
        """The fastest recent time of steps of `kind` at `threads` (inf where none ran)."""
        q = self._times.get((kind, threads))
        return min(q) if q else math.inf

    def one_thread_estimate(self, kind) -> float:
        own = self.baseline(kind, 1)
        return own if own < math.inf else self.baseline(kind, self.threads) * self.ratio

    def observe(self, kind, threads: int, seconds: float) -> None:
        """A decode step of `kind` took `seconds` on `threads` threads: update the baselines, then the count."""
        self._last = self.clock()
        q = self._times.setdefault((kind, threads), collections.deque(maxlen=self.window))
        q.append(seconds)
        if threads == self.threads and self.threads > 1:
            probe, self._probing = self._probing, False
            slow = seconds > self.one_thread_estimate(kind) * (1.0 + self.margin)
            if probe:  # (from one thread: stay on the full count if it is faster than one thread now)
                if not slow and seconds < self.one_thread_estimate(kind):
                    self._interval = self.probe_every
                    self._switch(self.threads)
                else:
                    self._interval = min(2 * self._interval, self.max_probe_every)
                return
            self._slow.append(slow)
            if sum(self._slow) >= self.patience:
                self._switch(1)
        elif threads == 1 and self.current == self.threads:  # (an exploring step: is the full count slower?)
            recent = list(self._times.get((kind, self.threads), ()))[-4:]
            if len(recent) == 4 and sorted(recent)[1] > seconds * (1.0 + self.margin):
                self._switch(1)

    def _switch(self, n: int) -> None:
        if n != self.current:
            self.current, self.switches = n, self.switches + 1
        self._slow.clear()
        self._since_probe, self._since_explore = 0, 0


GOVERNOR_ENV = "EAGLE3_THREAD_GOVERNOR"  # "off": the decode steps keep every thread


def governor_enabled(environ) -> bool:
    """$EAGLE3_THREAD_GOVERNOR: on (the default) or off; an Eagle3Error naming both otherwise."""
    from .errors import Eagle3Error

    value = environ.get(GOVERNOR_ENV, "on")
    if value not in ("on", "off"):
        raise Eagle3Error(f"${GOVERNOR_ENV} {value[:40]!r}: choose on (the default) or off")
    return value == "on"


def governor_for(bundle, environ) -> ThreadGovernor | None:
    """The governor of a warmed-up bundle served by one process on more than one thread; None otherwise (one
    thread, tensor parallelism, graphs that do not run on the host's threads, or $EAGLE3_THREAD_GOVERNOR=off)."""
    import torch

    ratio = bundle.thread_ratio
    if not governor_enabled(environ) or ratio is None or bundle.manifest.tp_degree > 1:
        return None
    threads = torch.get_num_threads()
    return ThreadGovernor(threads, ratio) if threads > 1 else None
