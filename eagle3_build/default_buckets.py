"""Default bucket lists (vLLM-Neuron's rules); routing a request to a bucket is the runtime's
(eagle3_runtime.buckets.pick_bucket)."""
from __future__ import annotations


def _doubling(start: int, limit: int, what: str) -> list[int]:
    """start, 2 start, 4 start, ... strictly below `limit`, then `limit` itself."""
    if limit < 1:
        raise ValueError(f"{what} must be >= 1, got {limit}")
    buckets, b = [], start
    while b < limit:
        buckets.append(b)
        b *= 2
    return buckets + [limit]


def default_prefill_buckets(max_num_batched_tokens: int) -> list[int]:
    """``default_prefill_buckets(2048) == [128, 256, 512, 1024, 2048]``; ``(300) == [128, 256, 300]``;
    ``<= 128`` gives ``[max_num_batched_tokens]``."""
    return _doubling(128, max_num_batched_tokens, "max_num_batched_tokens")


def default_batch_buckets(max_num_seqs: int) -> list[int]:
    """``default_batch_buckets(2) == [1, 2]``; ``default_batch_buckets(5) == [1, 2, 4, 5]``."""
    return _doubling(1, max_num_seqs, "max_num_seqs")
