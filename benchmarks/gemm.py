"""The projections of one forward pass (every layer's q, k, v, o, gate, up, down, then the lm_head; random float32
weights of a Llama config's shapes) for x of `rows` token rows: the work of a decode (1 row) or verify step without
attention. `gemm` times the GEMM formats the aoti backend chooses among (the builder's own timing code) beside
F.linear; `gemm-blocking` the blocked format's micro-kernel variants, each compiled as one AOTInductor package."""
from __future__ import annotations

import contextlib
import statistics
import sys
import time

from . import host as hosts
from .timing import interleaved_ms

SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "vocab_size": 49152}
NAMED_VARIANTS = ("inductor", "next-tile")
_PREFETCH = "                __builtin_prefetch(B + (k + {ahead}) * ldb + col * W, 0, 3);\n"


def projection_shapes(cfg: dict) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """(out, in) of every layer projection, then the lm_head's, read the way the builder reads a target."""
    from eagle3_build.models.llama import llama_args

    a = llama_args(cfg, "target")
    H, q, kv = a.hidden_size, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    layer = [(q, H), (kv, H), (kv, H), (H, q), (a.intermediate_size, H), (a.intermediate_size, H),
             (H, a.intermediate_size)]
    return layer * a.num_layers, (a.vocab_size, H)


def formats(cfg: dict, host: dict, rows: list[int], repeats: int, lm_head: bool) -> dict:
    """F.linear, weight-stationary plain and every packing format this torch has (exact float32), interleaved,
    per row count: medians in ms, the fastest and what the builder would choose."""
    import torch

    from eagle3_build.backends.cpu.gemm import F_LINEAR, PLAIN, ROUNDS, pick_fastest, time_formats
    from eagle3_build.models.linear import SMALL_ROWS
    from eagle3_runtime.packing import PACK_FORMATS, pack_available

    torch.manual_seed(0)
    layer_shapes, head = projection_shapes(cfg)
    shapes = layer_shapes + ([head] if lm_head else [])
    weights = [torch.randn(n, k) for n, k in shapes]
    names = [F_LINEAR, PLAIN] + [f for f in PACK_FORMATS if pack_available(f)]
    mb = sum(w.numel() for w in weights) * 4 / 2**20
    print(f"{len(weights)} projections, {mb:.0f} MiB float32, {hosts.summary(host)}; the aoti backend chooses per "
          f"row count up to {SMALL_ROWS} rows among {', '.join(names[1:])}")
    print(f"{'rows':>4} " + " ".join(f"{f + ' ms':>13}" for f in names) + "  fastest / chosen")
    results = []
    for r in rows:
        rounds = time_formats(shapes, r, names, repeats, weights=weights, rounds=ROUNDS)
        chosen = pick_fastest({f: v for f, v in rounds.items() if f != F_LINEAR})
        ms = {f: round(statistics.median(v), 3) for f, v in rounds.items()}
        results.append({"rows": r, "ms": ms, "fastest": min(ms, key=ms.get), "chosen": chosen})
        print(f"{r:>4} " + " ".join(f"{ms[f]:>13.1f}" for f in names) + f"  {results[-1]['fastest']} / {chosen}",
              flush=True)
    return {"benchmark": "gemm", "projections": len(weights), "weights_mib": round(mb, 1), "repeats": repeats,
            "small_rows": SMALL_ROWS, "formats": names, "results": results}


# ---------------------------------------------------------------------------------------------------- blocking

def forced_blocking(name: str) -> tuple[int, int] | None:
    """BM x BN of a `BMxBN` variant, None for a named one."""
    return None if name in NAMED_VARIANTS else tuple(int(x) for x in name.split("x"))


@contextlib.contextmanager
def kernel_variant(name: str):
    """Inside: the blocked format's micro-kernel is as `name` says (next-tile: also prefetching the next weight tile
    into L2; a BMxBN variant: the blocking its copies' block_n names, as the build compiles it)."""
    from eagle3_build.backends.cpu import inductor_internals as kernels

    shipped = kernels.tuned_kernel
    try:
        if name == "next-tile":
            src = kernels.tuned_kernel()
            line = _PREFETCH.format(ahead=kernels.AHEAD)
            if src is None or src.count(line) != 1:
                raise SystemExit("next-tile: this torch's micro-kernel is not the one it edits")
            src = src.replace(line, line + "                __builtin_prefetch(B + (K + k) * ldb + col * W, 0, 2);\n")
            kernels.tuned_kernel = lambda: src
        yield
    finally:
        kernels.tuned_kernel = shipped


def blocking(host: dict, rows: list[int], variants: list[str], repeats: int) -> dict:
    """Each (rows, variant) compiled, then all called interleaved: median ms per pass, each against the first."""
    import torch

    from eagle3_build.backends.cpu import gemm as builder_gemm
    from eagle3_build.backends.cpu import inductor_internals as kernels

    layer, head = projection_shapes(SMOLLM2)
    torch.manual_seed(0)
    weights = [torch.rand(o, i) - 0.5 for o, i in layer + [head]]
    threads = torch.get_num_threads()
    runs, block_ns = {}, {}
    for r in rows:
        xs = {w.shape[1]: torch.rand(r, w.shape[1]) for w in weights}
        for v in variants:
            with kernel_variant(v):
                forced = forced_blocking(v)
                bn = kernels.block_n(r, *weights[0].shape, threads, forced)
                if bn is None:
                    print(f"rows {r} {v}: no such float32 blocking on this CPU, left out", file=sys.stderr)
                    continue
                t0 = time.perf_counter()
                runs[f"{r}:{v}"], block_ns[f"{r}:{v}"] = builder_gemm.blocked_pass(weights, r, xs, forced), bn
            print(f"rows {r} {v} (block_n {bn}): compiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    with torch.inference_mode():
        ms = interleaved_ms(runs, repeats)
    med = {k: round(statistics.median(x), 2) for k, x in ms.items()}
    first = med.get(f"{rows[0]}:{variants[0]}")
    print(f"median ms per pass ({len(weights)} GEMMs), {hosts.summary(host)}")
    for r in rows:
        print(f"rows {r:>2}: " + "   ".join(f"{v} {med[f'{r}:{v}']}" + (f" ({med[f'{r}:{v}'] / first:.2f}x)" if first
                                                                        else "")
                                          for v in variants if f"{r}:{v}" in med))
    return {"benchmark": "gemm-blocking", "repeats": repeats, "kernel": kernels.kernel_tag(), "block_n": block_ns,
            "median_ms": med}
