"""Per-graph latency of one or more bundles, measured side by side in one run.

    python benchmarks/graph_latency.py BUNDLE [BUNDLE ...] [--graphs target_decode_b1,target_verify_b1]
        [--position 256] [--repeats 30] [--threads 1] [--save-result graph_latency.json]

Loads every bundle through the runtime (`eagle3_runtime.bundle.Bundle`: the same loaders, weights and
KV caches a server uses) and calls each named graph (default: every batch-bucket graph the bundles
share) with inputs built from its manifest entry: token ids drawn from the vocabulary, positions at
--position (the KV cache holds zeros below it; attention reads the whole static cache either way), draft
hidden states / aux states drawn from a normal distribution. Calls are interleaved graph by graph and
bundle by bundle, so a slow moment of a noisy host hits every contender alike; after one warm-up call,
--repeats calls each. Prints median ms per call and, per graph, each bundle's ratio to the first
(> 1: faster than the first); JSON on stdout's last line and with --save-result.

Use it to A/B a code-generation change: build the same recipe twice into two bundles (a different
model rule means different graph keys, so both builds go through the compile cache side by side) and
pass both directories.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

# 2 MB pages for both bundles' memory (PyTorch's CPU allocator, read at its first allocation): with 4 KB pages
# the bundle loaded first into a process ran slower than the one loaded after it (README, "engine_ab's bias")
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402
from eagle3_runtime.bundle import DTYPES, Bundle  # noqa: E402

POSITION_INPUTS = ("pos", "start", "positions", "slots")


def graph_inputs(bundle: Bundle, name: str, position: int, gen: torch.Generator) -> list[torch.Tensor]:
    entry = bundle.backend.graphs[name].entry
    m = bundle.manifest
    out = []
    for spec in entry.inputs[1:]:  # the rank is bound by the Graph
        dtype = DTYPES[spec.dtype]
        if dtype.is_floating_point:
            out.append(torch.randn(spec.shape, generator=gen, dtype=torch.float32).to(dtype))
        elif spec.name in POSITION_INPUTS:
            out.append(torch.full(spec.shape, position, dtype=dtype))
        elif spec.name in ("slot", "last"):
            out.append(torch.zeros(spec.shape, dtype=dtype))
        elif spec.name == "tree_mask":  # a chain's (lower-triangular over the last two dims)
            out.append(torch.ones(spec.shape[-2:], dtype=dtype).tril().expand(spec.shape).contiguous())
        else:  # token ids
            out.append(torch.randint(0, m.vocab_size, spec.shape, generator=gen, dtype=dtype))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundles", nargs="+", type=Path)
    ap.add_argument("--graphs", help="comma-separated graph names (default: the batch-bucket graphs all bundles have)")
    ap.add_argument("--position", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--save-result", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bundles = [Bundle(b) for b in args.bundles]
    names = [{g.name: g.role for g in b.manifest.graphs} for b in bundles]
    common = [n for n in names[0] if all(n in other for other in names[1:])]
    wanted = args.graphs.split(",") if args.graphs else [n for n in common if not names[0][n].endswith("prefill")]
    unknown = [n for n in wanted if n not in common]
    if unknown:
        sys.exit(f"graphs {unknown} are not in every bundle (common: {', '.join(common)})")
    for b in bundles:
        if args.position >= b.manifest.max_model_len - 16:
            sys.exit(f"--position {args.position} leaves no room in {b.root} (max_model_len {b.manifest.max_model_len})")
    gen = torch.Generator().manual_seed(0)
    calls = {}
    for n in wanted:
        inputs = graph_inputs(bundles[0], n, args.position, gen)
        calls[n] = [(b.backend.graphs[n], inputs) for b in bundles]
    ms = {n: [[] for _ in bundles] for n in wanted}
    with torch.inference_mode():
        for rep in range(args.repeats + 1):
            for n in wanted:
                for i, (graph, inputs) in enumerate(calls[n]):
                    t0 = time.perf_counter()
                    graph(*inputs)
                    if rep:
                        ms[n][i].append((time.perf_counter() - t0) * 1e3)
    result = {"benchmark": "graph_latency", "bundles": [str(b) for b in args.bundles], "threads": args.threads,
              "position": args.position, "repeats": args.repeats, "torch": torch.__version__, "graphs": {}}
    print(f"median ms per call, {args.repeats} interleaved calls each, {args.threads} thread(s), position {args.position}")
    print(f"{'graph':<30}" + "".join(f"{b.name[-28:]:>30}" for b in args.bundles))
    for n in wanted:
        med = [statistics.median(v) for v in ms[n]]
        result["graphs"][n] = [{"median_ms": round(m, 2), "ratio_to_first": round(med[0] / m, 3)} for m in med]
        print(f"{n:<30}" + "".join(f"{m:>20.1f} ({med[0] / m:4.2f}x)" for m in med))
    print(json.dumps(result))
    if args.save_result:
        args.save_result.parent.mkdir(parents=True, exist_ok=True)
        args.save_result.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
