"""Prometheus metrics of the engine and the HTTP server (names follow vLLM's, prefixed eagle3_)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # no *_created series: they only double the scrape size

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
        self.graph_latency = Histogram("eagle3_graph_latency_seconds", "Compiled graph call latency by role and bucket",
                                       ["role", "bucket"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("eagle3_time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self._drafts = self._accepted = self._drafted = 0
        self._per_pos = [0] * k
        for i in range(k):
            self.accepted_per_pos.labels(str(i))
            self.per_pos_rate.labels(str(i))

    def record_draft(self, accepted: int, drafted: int | None = None, shape: str | None = None) -> None:
        """One speculative round: `accepted` of `drafted` draft tokens (default k: a chain), in the
        speculation shape `shape` (SpecShape.describe(): per-shape counters besides vLLM's totals)."""
        if shape is not None:
            self.shape_drafts.labels(shape).inc()
            self.shape_accepted.labels(shape).inc(accepted)
        self._drafts += 1
        self._accepted += accepted
        self._drafted += self.k if drafted is None else drafted
        self.num_drafts.inc()
        self.num_draft_tokens.inc(self.k if drafted is None else drafted)
        self.num_accepted.inc(accepted)
        for i in range(accepted):
            self._per_pos[i] += 1
            self.accepted_per_pos.labels(str(i)).inc()
        self.acceptance_rate.set(self._accepted / self._drafted)
        self.acceptance_length.set(1 + self._accepted / self._drafts)
        for i in range(self.k):
            self.per_pos_rate.labels(str(i)).set(self._per_pos[i] / self._drafts)

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
