"""The blocked GEMM form's micro-kernel variants side by side: Inductor's register blocking as the build compiles it,
another of Inductor's blockings for this ISA, or a prefetch experiment, over the projections of one forward pass.

    python benchmarks/blocking_ab.py [--rows 1,4,5,8] [--variants inductor,8x8] [--threads 2] [--repeats 20]
        [--save-result blocking_ab.json]

Variants:
  inductor    the form the build measures today (eagle3_build/backends/gemm.py `blocked_pass`): Inductor's
              register blocking for the shape, our tuned micro-kernel (lowerings.tuned_kernel)
  BMxBN       the same kernel with Inductor's register blocking BM x BN (e.g. 8x8, 4x16 on AVX2: the weight
              copy laid out for that block_n, as the build's "blocked:8x8" form); left out where this ISA has no
              such float32 blocking
  next-tile   Inductor's blocking, the micro-kernel also prefetching the next weight tile into L2

Every projection of SmolLM2-135M (30 layers' q, k, v, o, gate, up, down and the lm_head; random float32 weights),
x of `rows` token rows; each (rows, variant) compiled as one AOTInductor package, then all of them called
interleaved; median ms per pass, and each against the 1-row pass of the first variant. JSON (CPU named) on stdout's
last line and with --save-result.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from eagle3_build.backends import gemm, lowerings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from linear_layout import SMOLLM2, projection_shapes  # noqa: E402
from spec_report import machine  # noqa: E402

_PREFETCH = "                __builtin_prefetch(B + (k + {ahead}) * ldb + col * W, 0, 3);\n"
NAMED = ("inductor", "next-tile")


def forced_blocking(name: str) -> tuple[int, int] | None:
    """BM x BN of a `BMxBN` variant, None for a named one."""
    return None if name in NAMED else tuple(int(x) for x in name.split("x"))


def variant_list(text: str) -> list[str]:
    """--variants: names from NAMED or BMxBN, comma-separated (argparse's type: a bad one is one usage line, exit 2)."""
    names = text.split(",")
    for n in names:
        parts = n.split("x")
        if n not in NAMED and not (len(parts) == 2 and all(p.isdigit() and int(p) > 0 for p in parts)):
            raise argparse.ArgumentTypeError(f"{n!r} is not a variant: inductor, next-tile or BMxBN (e.g. 8x8)")
    return names


def row_list(text: str) -> list[int]:
    """--rows: positive token row counts, comma-separated."""
    if not all(r.isdigit() and int(r) > 0 for r in text.split(",")):
        raise argparse.ArgumentTypeError(f"{text!r}: give positive row counts, comma-separated (e.g. 1,4,8)")
    return [int(r) for r in text.split(",")]


@contextlib.contextmanager
def variant(name: str):
    """Inside: the blocked form's micro-kernel is as `name` says (a BMxBN variant: the blocking its copies' block_n
    names, as the build compiles it)."""
    shipped_src = lowerings.tuned_kernel
    try:
        if name == "next-tile":
            src = lowerings.tuned_kernel()
            line = _PREFETCH.format(ahead=lowerings.AHEAD)
            if src is None or src.count(line) != 1:
                raise SystemExit("next-tile: this torch's micro-kernel is not the one it edits")
            src = src.replace(line, line + "                __builtin_prefetch(B + (K + k) * ldb + col * W, 0, 2);\n")
            lowerings.tuned_kernel = lambda: src
        yield
    finally:
        lowerings.tuned_kernel = shipped_src


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=row_list, default="1,4,5,8")
    ap.add_argument("--variants", type=variant_list, default="inductor,8x8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--save-result", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows, names = args.rows, args.variants
    layer, head = projection_shapes(SMOLLM2)
    torch.manual_seed(0)
    weights = [torch.rand(o, i) - 0.5 for o, i in layer + [head]]
    runs, block_ns = {}, {}
    for r in rows:
        xs = {w.shape[1]: torch.rand(r, w.shape[1]) for w in weights}
        for v in names:
            with variant(v):
                forced = forced_blocking(v)
                bn = lowerings.block_n(r, *weights[0].shape, args.threads, forced)
                if bn is None:
                    print(f"rows {r} {v}: no such float32 blocking on this CPU, left out", file=sys.stderr)
                    continue
                t0 = time.perf_counter()
                runs[(r, v)], block_ns[f"{r}:{v}"] = gemm.blocked_pass(weights, r, xs, forced), bn
            print(f"rows {r} {v} (block_n {bn}): compiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    ms: dict = {k: [] for k in runs}
    with torch.inference_mode():
        for rep in range(args.repeats + 1):
            for k, run in runs.items():
                t0 = time.perf_counter()
                run()
                if rep:
                    ms[k].append((time.perf_counter() - t0) * 1e3)
    med = {f"{r}:{v}": round(statistics.median(x), 2) for (r, v), x in ms.items()}
    first = med.get(f"{rows[0]}:{names[0]}")
    print(f"median ms per pass ({len(weights)} GEMMs), {args.threads} thread(s), {machine(args.threads)['cpu']}")
    for r in rows:
        print(f"rows {r:>2}: " + "   ".join(f"{v} {med[f'{r}:{v}']}" + (f" ({med[f'{r}:{v}'] / first:.2f}x)" if first else "")
                                          for v in names if f"{r}:{v}" in med))
    result = {"benchmark": "blocking_ab", "machine": machine(args.threads), "repeats": args.repeats,
              "kernel": lowerings.kernel_tag(), "block_n": block_ns, "median_ms": med}
    if args.save_result:
        args.save_result.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
