"""Bucket defaults (vLLM-Neuron rules) and bucket lookup.

This module is the single implementation of the default bucket lists; everything else
(recipe resolution, planning, runtime routing) calls into it.
"""

from __future__ import annotations

from eagle3_runtime.buckets import pick_bucket  # noqa: F401  (routing lives with the runtime)


def default_prefill_buckets(max_num_batched_tokens: int) -> list[int]:
    """Powers of two from 128 strictly below ``max_num_batched_tokens``, then that value itself.

    ``default_prefill_buckets(2048) == [128, 256, 512, 1024, 2048]``;
    ``default_prefill_buckets(300) == [128, 256, 300]``; ``<= 128`` gives ``[max_num_batched_tokens]``.
    """
    if max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
    buckets = []
    b = 128
    while b < max_num_batched_tokens:
        buckets.append(b)
        b *= 2
    buckets.append(max_num_batched_tokens)
    return buckets


def default_batch_buckets(max_num_seqs: int) -> list[int]:
    """Powers of two from 1 strictly below ``max_num_seqs``, then ``max_num_seqs`` itself.

    ``default_batch_buckets(2) == [1, 2]``; ``default_batch_buckets(5) == [1, 2, 4, 5]``.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    buckets = []
    b = 1
    while b < max_num_seqs:
        buckets.append(b)
        b *= 2
    buckets.append(max_num_seqs)
    return buckets


KV_ALIGN = 64


def kv_cache_length(max_model_len: int, num_speculative_tokens: int) -> int:
    """Positions per KV-cache row: max_model_len plus at least K scratch positions (a row past its
    speculation cutoff still rides along in a verify batch, writing K+1 positions), rounded up to a
    multiple of 64 so that the cache — and with it every graph but verify/catch-up — keeps its shape
    when only K changes (those graphs then come from the compile cache)."""
    need = max_model_len + num_speculative_tokens
    return -(-need // KV_ALIGN) * KV_ALIGN
