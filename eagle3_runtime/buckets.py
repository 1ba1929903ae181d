"""Bucket routing: the one rule for which compiled shape serves a request."""
from __future__ import annotations


def pick_bucket(buckets: list[int], n: int) -> int | None:
    """Smallest bucket >= n, or None when n exceeds every bucket (callers must refuse, never clamp)."""
    return next((b for b in sorted(buckets) if b >= n), None)
