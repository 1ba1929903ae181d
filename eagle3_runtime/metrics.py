"""Speculative-decoding counters (SpecStats: the one implementation of the acceptance formulas, read by
requests, /metrics, benchmarks, training and tests) and the Prometheus metrics of the engine and the HTTP
server (names follow vLLM's, prefixed eagle3_)."""
from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # no *_created series: they only double the scrape size


@dataclass
class SpecStats:
    """Speculative-decoding counters (one generation, or totals), reported in vLLM's format."""

    k: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # per depth
    per_shape: dict[str, list[int]] = field(default_factory=dict)  # shape -> [rounds, accepted tokens]

    def __post_init__(self):
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.k

    def record(self, accepted: int, drafted: int | None = None, shape: str | None = None) -> None:
        """One speculative round: `accepted` draft tokens of `drafted` (default k: a chain) verified, in
        the speculation shape named `shape` (SpecShape.describe())."""
        self.num_drafts += 1
        self.num_draft_tokens += self.k if drafted is None else drafted
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_position[i] += 1
        if shape is not None:
            rounds = self.per_shape.setdefault(shape, [0, 0])
            rounds[0] += 1
            rounds[1] += accepted

    def add(self, other: "SpecStats") -> None:
        """Fold another generation's counters (same K) into these: totals over a prompt set."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.accepted_per_position = [a + b for a, b in zip(self.accepted_per_position, other.accepted_per_position)]
        for name, (n, a) in other.per_shape.items():
            mine = self.per_shape.setdefault(name, [0, 0])
            mine[0] += n
            mine[1] += a

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def per_position(self) -> list[float]:
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_position]

    def to_dict(self) -> dict:
        return {"num_speculative_tokens": self.k, "num_drafts": self.num_drafts,
                "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "acceptance_rate": self.acceptance_rate,
                "mean_acceptance_length": self.mean_acceptance_length,
                "per_position_acceptance_rate": self.per_position,
                "per_shape": {name: {"num_drafts": n, "mean_acceptance_length": 1 + a / n}
                              for name, (n, a) in self.per_shape.items()}}

    def format(self) -> str:
        pos = ", ".join(f"{r:.3f}" for r in self.per_position)
        return (f"SpecDecoding metrics: Mean acceptance length: {self.mean_acceptance_length:.2f}, "
                f"Accepted: {self.num_accepted_tokens} tokens, Drafted: {self.num_draft_tokens} tokens, "
                f"Per-position acceptance rate: {pos}, Avg Draft acceptance rate: {100 * self.acceptance_rate:.1f}%"
                + "".join(f"; {name}: {n} rounds, acceptance length {1 + a / n:.2f}"
                          for name, (n, a) in self.per_shape.items()))


LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    def __init__(self, k: int):
        self.k = k
        r = self.registry = CollectorRegistry()
        self.requests = Counter("eagle3_request_success", "Finished requests by finish reason",
                                ["finished_reason"], registry=r)
        self.http_requests = Counter("eagle3_http_requests", "HTTP requests by endpoint and status code",
                                     ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("eagle3_prompt_tokens", "Prefilled prompt tokens", registry=r)
        self.generation_tokens = Counter("eagle3_generation_tokens", "Generated tokens", registry=r)
        self.num_drafts = Counter("eagle3_spec_decode_num_drafts", "Speculative rounds", registry=r)
        self.num_draft_tokens = Counter("eagle3_spec_decode_num_draft_tokens", "Proposed draft tokens", registry=r)
        self.num_accepted = Counter("eagle3_spec_decode_num_accepted_tokens", "Accepted draft tokens", registry=r)
        self.accepted_per_pos = Counter("eagle3_spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by draft position", ["position"], registry=r)
        self.shape_drafts = Counter("eagle3_spec_decode_shape_num_drafts", "Speculative rounds by speculation shape",
                                    ["shape"], registry=r)
        self.shape_accepted = Counter("eagle3_spec_decode_shape_num_accepted_tokens",
                                      "Accepted draft tokens by speculation shape", ["shape"], registry=r)
        self.acceptance_rate = Gauge("eagle3_spec_decode_acceptance_rate",
                                     "Accepted / proposed draft tokens since start", registry=r)
        self.acceptance_length = Gauge("eagle3_spec_decode_mean_acceptance_length",
                                       "1 + accepted tokens per speculative round since start", registry=r)
        self.per_pos_rate = Gauge("eagle3_spec_decode_per_position_acceptance_rate",
                                  "Acceptance rate of each draft position since start", ["position"], registry=r)
        self.queue_depth = Gauge("eagle3_num_requests_waiting", "Requests waiting for a KV-cache row", registry=r)
        self.running = Gauge("eagle3_num_requests_running", "Requests holding a KV-cache row", registry=r)
        self.step_latency = Histogram("eagle3_step_latency_seconds", "Engine step latency by kind",
                                      ["kind"], buckets=LATENCY_BUCKETS, registry=r)
        self.threads = Gauge("eagle3_decode_threads", "Threads of the decode steps now (fewer while another process "
                             "takes part of a core: the thread governor)", registry=r)
        self.thread_switches = Counter("eagle3_decode_thread_switches", "Times the thread governor changed the "
                                       "decode steps' thread count", registry=r)
        self.graph_latency = Histogram("eagle3_graph_latency_seconds", "Compiled graph call latency by role and bucket",
                                       ["role", "bucket"], buckets=LATENCY_BUCKETS, registry=r)
        self.speculation = Gauge("eagle3_speculation_shape", "The speculation shape served per batch bucket (1: "
                                 "served; --speculation auto chooses it by expected tokens per second on this host)",
                                 ["bucket", "shape"], registry=r)
        self.speculation_rate = Gauge("eagle3_speculation_expected_tokens_per_second", "Expected tokens per second "
                                      "per sequence of each candidate shape (measured graph costs x acceptance)",
                                      ["bucket", "shape"], registry=r)
        self.speculation_switches = Counter("eagle3_speculation_switches", "Changes of the served speculation shape",
                                            ["bucket"], registry=r)
        self.warmup = Gauge("eagle3_graph_warmup_seconds", "First call of each compiled graph on this host "
                            "(warm-up at start)", ["role", "bucket"], registry=r)
        self.ttft = Histogram("eagle3_time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.spec = SpecStats(k)  # the totals behind the gauges
        for i in range(k):
            self.accepted_per_pos.labels(str(i))
            self.per_pos_rate.labels(str(i))

    def record_draft(self, accepted: int, drafted: int | None = None, shape: str | None = None) -> None:
        """One speculative round: `accepted` of `drafted` draft tokens (default k: a chain), in the
        speculation shape `shape` (SpecShape.describe(): per-shape counters besides vLLM's totals)."""
        if shape is not None:
            self.shape_drafts.labels(shape).inc()
            self.shape_accepted.labels(shape).inc(accepted)
        self.spec.record(accepted, drafted)
        self.num_drafts.inc()
        self.num_draft_tokens.inc(self.k if drafted is None else drafted)
        self.num_accepted.inc(accepted)
        for i in range(accepted):
            self.accepted_per_pos.labels(str(i)).inc()
        self.acceptance_rate.set(self.spec.acceptance_rate)
        self.acceptance_length.set(self.spec.mean_acceptance_length)
        for i, rate in enumerate(self.spec.per_position):
            self.per_pos_rate.labels(str(i)).set(rate)

    def record_warmup(self, manifest, timings: dict[str, float]) -> None:
        """The warm-up's first-call time of every graph (graph name -> seconds), by role (a menu shape's graph:
        role:tag) and bucket."""
        for g in manifest.graphs:
            if g.name in timings:
                self.warmup.labels(g.role if g.shape is None else f"{g.role}:{g.shape.tag}", str(g.bucket)).set(
                    timings[g.name])

    def record_choice(self, bucket: int, chooser) -> None:
        """A batch bucket's speculation choice (adaptive.Chooser): which shape is served, each one's rate."""
        for c in chooser.candidates:
            self.speculation.labels(str(bucket), c.name).set(1 if c.name == chooser.current else 0)
            self.speculation_rate.labels(str(bucket), c.name).set(round(chooser.rate(c.name), 3))

    def record_graph(self, role: str, bucket: int, seconds: float) -> None:
        self.graph_latency.labels(role, str(bucket)).observe(seconds)

    def graph_profile(self, since: dict | None = None) -> dict[str, dict]:
        """{"role/bucket": {"calls", "total_s", "mean_ms"}} from the graph-latency histogram: where the
        engine's time went (minus an earlier profile `since`)."""
        acc: dict[str, list] = {}
        for metric in self.graph_latency.collect():
            for smp in metric.samples:
                kind = smp.name.rsplit("_", 1)[-1]
                if kind in ("count", "sum"):
                    key = f"{smp.labels['role']}/{smp.labels['bucket']}"
                    acc.setdefault(key, [0, 0.0])[kind == "sum"] += smp.value
        out = {}
        for key, (n, t) in sorted(acc.items()):
            if since and key in since:
                n, t = n - since[key]["calls"], t - since[key]["total_s"]
            if n > 0:
                out[key] = {"calls": int(n), "total_s": round(t, 4), "mean_ms": round(1e3 * t / n, 3)}
        return out

    def finished(self, reason: str) -> None:
        self.requests.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
