"""Adaptive speculation: of the speculation shapes a batch bucket can run (its own and its menu's, all compiled
offline), the one that yields the most tokens per second on this host. A shape's cost per step starts as the
warm-up's graph times (the backend times its graphs) and becomes what live steps of it take (the median of its
last steps: graphs, host work and the context the requests really use), so a shape whose rounds cost more in
fact than its graphs say is dropped; its acceptance comes from the profile `verify` recorded at build time,
scaled by what live rounds show (a decaying average). Plain decoding is always a candidate, so the choice is
never slower than it for long; a switch needs a margin (hysteresis), and the alternative is probed now and then
(plain decoding while speculating, the best speculative shape while not), sooner while it has no live times.

    tokens per round  = 1 + drift * sum(reach)      (reach[d] = P(a round accepts at least d + 1 drafts))
    rate              = tokens per round / seconds per step
    drift             = decaying average of accepted / expected-accepted over the served shape's rounds
"""
from __future__ import annotations

import collections
import math
import re
import statistics
from dataclasses import dataclass, field

from .graph_contract import draft_unrolled

NONE = "none"


@dataclass(frozen=True)
class Candidate:
    name: str
    round_s: float  # the warm-up's prior for one step at this batch bucket: verify + draft steps + catch-up
    # graph times (none: one decode pass)
    reach: tuple[float, ...] = ()  # the build-time profile, non-increasing; () for plain decoding

    @property
    def expected_accepted(self) -> float:
        return sum(self.reach)


@dataclass
class Chooser:
    """Picks among `candidates` (one of them NONE), follows live acceptance (`observe`) and live step times
    (`observe_time`). `half_life`: rounds for an acceptance observation's weight to halve; `margin`: how much
    faster (fraction) another shape must look before a switch; `probe_every`: steps between two probes of the
    alternative (plain decoding while speculating, the best speculative shape while not); `explore_after`: the
    same while the alternative has run fewer than `min_timed` steps; `window`: live step times kept per shape
    and KV context bucket (their median is its cost there once it has `min_timed`: a longer context costs every
    shape more, so shapes are compared within one); `preferred`: the shape to start on when it looks within the
    margin of the best speculative one and faster than plain decoding (the bucket's own: start-up timing noise
    must not pick among near-equal shapes)."""

    candidates: list[Candidate]
    half_life: float = 100.0
    margin: float = 0.05
    probe_every: int = 64
    explore_after: int = 4
    window: int = 8
    min_timed: int = 3
    drift: float = 1.0
    preferred: str | None = None
    current: str = field(init=False)
    switches: int = field(init=False, default=0)
    _since_probe: int = field(init=False, default=0)

    def __post_init__(self):
        names = [c.name for c in self.candidates]
        if NONE not in names:
            raise ValueError("the candidates must include plain decoding ('none')")
        if len(set(names)) != len(names):
            raise ValueError(f"candidate names repeat: {names}")
        for c in self.candidates:
            if not (c.round_s > 0 and math.isfinite(c.round_s)):
                raise ValueError(f"{c.name}: round time must be a positive number, got {c.round_s}")
            if any(not 0.0 <= r <= 1.0 for r in c.reach) or list(c.reach) != sorted(c.reach, reverse=True):
                raise ValueError(f"{c.name}: reach must be non-increasing probabilities, got {list(c.reach)}")
        self._by_name = {c.name: c for c in self.candidates}
        self._alpha = 1.0 - 0.5 ** (1.0 / self.half_life)
        self._times: dict[tuple[str, int], collections.deque] = {}  # (shape, context) -> its last live step times
        self._runs: collections.Counter = collections.Counter()  # shape -> steps run
        self.context = 0  # the KV context bucket of the last step (0: whole cache / not given)
        self.current = self.best()
        p = self.preferred
        if p in self._by_name and p != self.current and self.current != NONE and self.rate(p) > self.rate(NONE) \
                and self.rate(p) * (1.0 + self.margin) >= self.rate(self.current):
            self.current = p

    def tokens_per_round(self, name: str) -> float:
        return 1.0 + self.drift * self._by_name[name].expected_accepted

    def live(self, name: str, context: int | None = None) -> bool:
        """Whether `name` has live step times at `context` (default: the current one)."""
        ts = self._times.get((name, self.context if context is None else context))
        return ts is not None and len(ts) >= self.min_timed

    def _median(self, name: str, context: int) -> float:
        return statistics.median(self._times[(name, context)])

    def seconds(self, name: str) -> float:
        """Seconds per step of `name` at the current context: the median of its last live steps there; else the
        live time there of a shape it was timed next to in another context, scaled by how the two compared
        there; with nothing timed here, its own time in the nearest context timed; else its warm-up prior times
        the median live/prior ratio of the shapes timed here (host work the graph times leave out); else the
        prior."""
        ctx = self.context
        if self.live(name):
            return self._median(name, ctx)
        here = sorted((n for n in self._by_name if self.live(n)), key=lambda n: n != self.current)
        for ref in here:
            both = [c for (n, c) in self._times if n == name and self.live(n, c) and self.live(ref, c)]
            if both:
                c = max(both, key=lambda c: len(self._times[(name, c)]))
                return self._median(ref, ctx) * self._median(name, c) / self._median(ref, c)
        elsewhere = [c for (n, c) in self._times if n == name and self.live(n, c)]
        if not here and elsewhere:
            return self._median(name, min(elsewhere, key=lambda c: abs(c - ctx)))
        ratios = [self._median(n, ctx) / self._by_name[n].round_s for n in here] or \
            [self._median(n, c) / self._by_name[n].round_s for (n, c) in self._times if self.live(n, c)]
        return self._by_name[name].round_s * (statistics.median(ratios) if ratios else 1.0)

    def rate(self, name: str) -> float:
        """Expected tokens per second per sequence with shape `name`."""
        return self.tokens_per_round(name) / self.seconds(name)

    def best(self, speculative_only: bool = False) -> str:
        names = [c.name for c in self.candidates if not (speculative_only and c.name == NONE)]
        return max(names, key=self.rate)

    def _alternative(self) -> str:
        """What a probe runs: while speculating plain decoding until it has live times, then the best other
        shape; while decoding plainly the best speculative shape."""
        if self.current == NONE:
            return self.best(speculative_only=True)
        if self._runs[NONE] < self.min_timed:
            return NONE
        return max((c.name for c in self.candidates if c.name != self.current), key=self.rate)

    def next_shape(self, context: int | None = None) -> str:
        """The shape to run this step (at KV context bucket `context`, if given): the current one, or a probe of
        the alternative every `probe_every` steps (every `explore_after` while it has run fewer than `min_timed`
        steps)."""
        if context is not None:
            self.context = context
        name = self.current
        if len(self.candidates) > 1:
            self._since_probe += 1
            alt = self._alternative()
            few = self._runs[alt] < self.min_timed
            if self._since_probe >= (self.explore_after if few else self.probe_every):
                self._since_probe, name = 0, alt
        self._runs[name] += 1
        return name

    def observe(self, name: str, accepted: int) -> None:
        """One speculative round of shape `name` accepted `accepted` drafts: update the drift, then switch
        if another shape now looks faster by more than the margin."""
        expected = self._by_name[name].expected_accepted
        if expected > 0:
            self.drift += self._alpha * (accepted / expected - self.drift)
        self._reconsider()

    def observe_time(self, name: str, seconds: float) -> None:
        """One step of shape `name` (NONE: a plain decode step) at the current context took `seconds` on this
        host, everything included but a catch-up of positions decoded plainly before it; then reconsider."""
        if seconds > 0 and math.isfinite(seconds):
            self._times.setdefault((name, self.context), collections.deque(maxlen=self.window)).append(seconds)
            self._reconsider()

    def _reconsider(self) -> None:
        best = self.best()
        if best != self.current and self.rate(best) > self.rate(self.current) * (1.0 + self.margin):
            self.current = best
            self.switches += 1
            self._since_probe = 0

    def reason(self) -> str:
        """Why the current shape: its expected rate next to plain decoding's, from the costs measured here."""
        c = self._by_name[self.current]
        line = (f"{c.name}: {self.tokens_per_round(c.name):.2f} tokens per {1e3 * self.seconds(c.name):.1f} ms "
                f"step = {self.rate(c.name):.1f} tok/s per sequence")
        if c.name != NONE:
            line += f" vs no speculation {self.rate(NONE):.1f} tok/s ({1e3 * self.seconds(NONE):.1f} ms per decode step)"
        else:
            spec = self.best(speculative_only=True) if len(self.candidates) > 1 else None
            if spec:
                line += f"; best speculative shape {spec} would give {self.rate(spec):.1f} tok/s"
        timed = "live step times" if self.live(self.current) else "warm-up graph times"
        return line + f" (costs: {timed}; acceptance at {self.drift:.2f}x the build-time profile)"


def round_seconds(manifest, seconds: dict[str, float], bucket: int) -> dict[str, float]:
    """Seconds per step at batch bucket `bucket` from per-graph times on this host (graph name -> s): plain
    decoding (one target_decode) and each speculation shape of the bucket (its target_verify + its draft_chain,
    else depth - 1 of its draft_step + the bucket's draft_catchup), keyed by SpecShape.describe()."""
    def t(role: str, shape=None) -> float:
        name = manifest.graph(role, bucket, shape).name
        if name not in seconds:
            raise KeyError(f"no time measured for graph {name}")
        return seconds[name]

    out = {NONE: t("target_decode")}
    for shape in manifest.shapes(bucket):
        if shape.speculates:
            if draft_unrolled(shape, manifest.unroll_draft):
                steps = t("draft_chain", shape)
            else:
                steps = (shape.depth - 1) * t("draft_step", shape) if shape.depth > 1 else 0.0
            out[shape.describe()] = t("target_verify", shape) + steps + t("draft_catchup")
    return out


MODES = ("auto", "always", "none")  # --speculation: choose by measurement / the bundle's shape every round / plain
TAG_RE = re.compile(r"chain\d{1,2}|tree\d{1,2}x\d{1,3}x\d{1,3}|static\d{1,2}x\d{1,3}-[0-9a-f]{6}")  # SpecShape.tag
PRIOR_REACH = 0.5  # no recorded profile: each depth assumed to accept half of what reaches it


def _recorded(manifest, name: str) -> list[float] | None:
    """The reach per depth `verify` recorded for shape `name`, as non-increasing probabilities (it is data)."""
    try:
        raw = [min(max(float(x), 0.0), 1.0) for x in manifest.build["acceptance"][name]["reach"]]
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    reach, low = [], 1.0
    for x in raw:
        low = min(low, x if math.isfinite(x) else 0.0)
        reach.append(low)
    return reach or None


def acceptance_profile(manifest, shape) -> tuple[float, ...]:
    """reach per depth for `shape`, as `verify` recorded it in the manifest's build record ("acceptance":
    {shape: {"reach": [...]}}); for a chain without its own record, the deepest recorded chain's (a greedy
    chain's first drafts are the same whatever its length), extended past its depth at its last depth's
    conditional acceptance; else the prior."""
    reach = _recorded(manifest, shape.describe())
    if reach is None and shape.kind == "chain":
        chains = [s for b in manifest.batch_buckets for s in manifest.shapes(b)
                  if s.kind == "chain" and _recorded(manifest, s.describe())]
        if chains:
            deepest = max(chains, key=lambda s: s.depth)
            reach = _recorded(manifest, deepest.describe())[:deepest.depth]
    if reach is None:
        return tuple(PRIOR_REACH ** (d + 1) for d in range(shape.depth))
    ratio = reach[-1] / reach[-2] if len(reach) > 1 and reach[-2] > 0 else reach[-1]
    while len(reach) < shape.depth:
        reach.append(reach[-1] * ratio)
    return tuple(reach[:shape.depth])



def bucket_chooser(manifest, seconds: dict[str, float], bucket: int) -> Chooser | None:
    """The chooser of one batch bucket among plain decoding and the bucket's shapes (its own, its menu), from
    per-graph seconds measured on this host; None where the bucket has no speculation."""
    shapes = [s for s in manifest.shapes(bucket) if s.speculates]
    if not shapes:
        return None
    secs = round_seconds(manifest, seconds, bucket)
    return Chooser([Candidate(NONE, secs[NONE])] + [
        Candidate(s.describe(), secs[s.describe()], acceptance_profile(manifest, s)) for s in shapes],
        preferred=manifest.speculation[bucket].describe())


SPECULATION_ENV = "EAGLE3_SPECULATION"


def add_speculation_arg(ap) -> None:
    """--speculation and --no-spec of eagle3-run and eagle3-serve (argparse)."""
    ap.add_argument("--speculation", default=None, metavar="MODE",
                    help="auto: per batch bucket, plain decoding or one of the bundle's speculation shapes there (its "
                         "own and its menu), whichever is expected to be fastest on this host (graph costs timed "
                         "at start x acceptance, followed live); always: the bucket's own shape every round; none: "
                         "plain decoding; a shape's tag (chain2, tree4x2x8: `eagle3-build inspect` lists them): "
                         f"that shape every round (default: ${SPECULATION_ENV} if set, else auto)")
    ap.add_argument("--no-spec", action="store_true", help="plain decoding, no draft (= --speculation none)")


def speculation_mode(args, environ) -> str:
    """The mode the flags (or $EAGLE3_SPECULATION) ask for; an Eagle3Error naming the choices otherwise."""
    from .errors import Eagle3Error

    if args.no_spec:
        return "none"
    mode, origin = (args.speculation, "--speculation") if args.speculation is not None else \
        (environ.get(SPECULATION_ENV, "auto"), f"${SPECULATION_ENV}")
    if mode not in MODES and not TAG_RE.fullmatch(mode):
        raise Eagle3Error(f"{origin} {mode[:40]!r}: choose one of {', '.join(MODES)} or a shape's tag (chain3, "
                          "tree4x2x8: `eagle3-build inspect BUNDLE` lists a bundle's)")
    return mode
