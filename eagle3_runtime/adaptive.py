"""Adaptive speculation: of the speculation shapes a batch bucket can run (its own and its menu's, all compiled
offline), the one that yields the most tokens per second on this host. Each candidate's cost is measured here
(the backend's warm-up times its graphs); its acceptance comes from the profile `verify` recorded at build
time, scaled by what live rounds show (a decaying average). Plain decoding is always a candidate, so by the
model the choice is never slower than it; a switch needs a margin (hysteresis), and while plain decoding is
served a speculative round is probed now and then so that a draft which starts accepting again is noticed.

    tokens per round  = 1 + drift * sum(reach)      (reach[d] = P(a round accepts at least d + 1 drafts))
    rate              = tokens per round / seconds per round
    drift             = decaying average of accepted / expected-accepted over the served shape's rounds
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from .graph_contract import draft_unrolled

NONE = "none"


@dataclass(frozen=True)
class Candidate:
    name: str
    round_s: float  # one step at this batch bucket: verify + draft steps + catch-up (none: one decode pass)
    reach: tuple[float, ...] = ()  # the build-time profile, non-increasing; () for plain decoding

    @property
    def expected_accepted(self) -> float:
        return sum(self.reach)


@dataclass
class Chooser:
    """Picks among `candidates` (one of them NONE) and follows live acceptance. `half_life`: rounds for an
    observation's weight to halve; `margin`: how much faster (fraction) another shape must look before a
    switch; `probe_every`: steps of plain decoding between two probing rounds of the best speculative shape;
    `preferred`: the shape to start on when it looks within the margin of the best speculative one and faster
    than plain decoding (the bucket's own: start-up timing noise must not pick among near-equal shapes)."""

    candidates: list[Candidate]
    half_life: float = 100.0
    margin: float = 0.05
    probe_every: int = 64
    drift: float = 1.0
    preferred: str | None = None
    current: str = field(init=False)
    switches: int = field(init=False, default=0)
    _plain_steps: int = field(init=False, default=0)

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
        self.current = self.best()
        p = self.preferred
        if p in self._by_name and p != self.current and self.current != NONE and self.rate(p) > self.rate(NONE) \
                and self.rate(p) * (1.0 + self.margin) >= self.rate(self.current):
            self.current = p

    def tokens_per_round(self, name: str) -> float:
        return 1.0 + self.drift * self._by_name[name].expected_accepted

    def rate(self, name: str) -> float:
        """Expected tokens per second per sequence with shape `name`."""
        return self.tokens_per_round(name) / self._by_name[name].round_s

    def best(self, speculative_only: bool = False) -> str:
        names = [c.name for c in self.candidates if not (speculative_only and c.name == NONE)]
        return max(names, key=self.rate)

    def next_shape(self) -> str:
        """The shape to run this step: the current one, or (serving plain decoding) a probe every
        `probe_every` steps."""
        if self.current != NONE or len(self.candidates) == 1:
            return self.current
        self._plain_steps += 1
        if self._plain_steps >= self.probe_every:
            self._plain_steps = 0
            return self.best(speculative_only=True)
        return NONE

    def observe(self, name: str, accepted: int) -> None:
        """One speculative round of shape `name` accepted `accepted` drafts: update the drift, then switch
        if another shape now looks faster by more than the margin."""
        expected = self._by_name[name].expected_accepted
        if expected > 0:
            self.drift += self._alpha * (accepted / expected - self.drift)
        self._reconsider()

    def _reconsider(self) -> None:
        best = self.best()
        if best != self.current and self.rate(best) > self.rate(self.current) * (1.0 + self.margin):
            self.current = best
            self.switches += 1
            self._plain_steps = 0

    def reason(self) -> str:
        """Why the current shape: its expected rate next to plain decoding's, from the measured costs."""
        c, plain = self._by_name[self.current], self._by_name[NONE]
        line = (f"{c.name}: {self.tokens_per_round(c.name):.2f} tokens per {1e3 * c.round_s:.1f} ms round = "
                f"{self.rate(c.name):.1f} tok/s per sequence")
        if c.name != NONE:
            line += f" vs no speculation {self.rate(NONE):.1f} tok/s ({1e3 * plain.round_s:.1f} ms per decode pass)"
        else:
            spec = self.best(speculative_only=True) if len(self.candidates) > 1 else None
            if spec:
                line += f"; best speculative shape {spec} would give {self.rate(spec):.1f} tok/s"
        return line + f" (acceptance at {self.drift:.2f}x the build-time profile)"


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
