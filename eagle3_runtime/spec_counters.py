"""A server's speculative-decoding counters, read from its Prometheus /metrics text: eagle3-serve's
(eagle3_spec_decode_*) or vLLM's (vllm:spec_decode_*), which carry the same four counters. Two scrapes
around a run give that run's acceptance block (SpecStats: vLLM's formulas). Used by `eagle3-build verify
--server` and the serving benchmarks."""
from __future__ import annotations

import re

from .metrics import SpecStats

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")
PREFIXES = ("eagle3_spec_decode_", "vllm:spec_decode_")

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text format -> {(name, sorted labels): value}; comments and unparsable lines skipped."""
    out: dict[tuple[str, tuple], float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels = m.group(1), tuple(sorted(_LABEL.findall(m.group(3) or "")))
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        out[(name, labels)] = out.get((name, labels), 0.0) + value
    return out


def spec_counters(samples: dict[tuple[str, tuple], float]) -> dict | None:
    """{num_drafts, num_draft_tokens, num_accepted_tokens: float, per_pos: {pos: float}, metric_prefix}
    summed over every other label (e.g. model_name), or None when the server exposes none of them."""
    for prefix in PREFIXES:
        got: dict = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0, "per_pos": {}}
        found = False
        for (name, labels), v in samples.items():
            if not name.startswith(prefix) or name.endswith("_created"):
                continue
            base = name[len(prefix):].removesuffix("_total")
            if base not in COUNTERS:
                continue
            found = True
            if base == "num_accepted_tokens_per_pos":
                pos = dict(labels).get("position")
                if pos is not None and pos.isdigit():
                    got["per_pos"][int(pos)] = got["per_pos"].get(int(pos), 0.0) + v
            else:
                got[base] += v
        if found:
            got["metric_prefix"] = prefix
            return got
    return None


ZERO = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0, "per_pos": {}}


def stats_between(before: dict | None, after: dict | None) -> SpecStats | None:
    """The acceptance of what the server did between two spec_counters readings (None: no counters after;
    none before counts as zeros: a Prometheus client shows a labelled counter only once it has counted)."""
    if after is None:
        return None
    before = before or ZERO
    positions = sorted(set(before["per_pos"]) | set(after["per_pos"]))
    return SpecStats(len(positions), *(int(round(after[k] - before[k])) for k in
                                       ("num_drafts", "num_draft_tokens", "num_accepted_tokens")),
                     [int(round(after["per_pos"].get(p, 0.0) - before["per_pos"].get(p, 0.0))) for p in positions])


def spec_delta(before: dict | None, after: dict | None) -> dict | None:
    """stats_between as JSON data: counts, acceptance rate (%), acceptance length, per position (%)."""
    stats = stats_between(before, after)
    if stats is None:
        return None
    drafted = stats.num_drafts > 0
    positions = sorted(set((before or ZERO)["per_pos"]) | set(after["per_pos"]))
    return {
        "metric_prefix": after.get("metric_prefix"),
        "num_drafts": stats.num_drafts,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "accepted_per_pos": {str(p): n for p, n in zip(positions, stats.accepted_per_position)},
        "acceptance_rate": 100 * stats.acceptance_rate if stats.num_draft_tokens > 0 else None,
        "acceptance_length": stats.mean_acceptance_length if drafted else None,
        "per_position_acceptance": {str(p): 100 * r for p, r in zip(positions, stats.per_position)} if drafted else {},
    }
