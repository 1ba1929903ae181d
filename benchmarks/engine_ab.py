"""Two bundles' decoding in the engine loop, interleaved in one process: what a change does end to end.

    python benchmarks/engine_ab.py BUNDLE_A BUNDLE_B [--prompts heldout] [--num-prompts 3] [--max-tokens 128]
        [--repeats 2] [--threads 2] [--no-chat] [--save-result engine_ab.json]

Both bundles load into one process (`Engine(Bundle(dir), speculation="always")`: each bundle's own shape every
round) and generate the same prompts, speculative and plain, alternating A and B per generation (the order flips
every repeat), so a slow stretch of the host lands on both alike; runs one after the other (demo_speed twice)
differ by this host's drift, ~10% between minutes. Prints decode tok/s per bundle and mode, B over A, each graph's
median ms per call inside the loop (wrapping each graph's compiled function: the loop's real inputs, positions
and context buckets), and whether the two bundles generated the same tokens. JSON on stdout's last line and with
--save-result. graph_latency.py times the same graphs called alone.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

# 2 MB pages for both bundles' memory (PyTorch's CPU allocator, read at its first allocation): with 4 KB pages
# the bundle loaded first into a process ran slower than the one loaded after it (README, "engine_ab's bias")
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_report import encode_prompts, machine, prompt_texts  # noqa: E402


def timed_graphs(bundle, times: dict[str, list[float]]) -> None:
    """Record every call of the bundle's graphs (seconds, by graph name) into `times`."""
    for name, graph in bundle.backend.graphs.items():
        def call(*args, fn=graph.fn, name=name):
            t0 = time.perf_counter()
            out = fn(*args)
            times[name].append(time.perf_counter() - t0)
            return out
        graph.fn = call


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundles", nargs=2, type=Path, metavar="BUNDLE")
    ap.add_argument("--prompts", default="heldout", help="heldout (the training script's held-out prompts) or a file")
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-chat", action="store_true", help="encode prompts as raw text, not in the chat template")
    ap.add_argument("--save-result", type=Path)
    args = ap.parse_args(argv)

    import torch
    from eagle3_runtime.bundle import Bundle, BundleError
    from eagle3_runtime.engine import Engine

    torch.set_num_threads(args.threads)
    names = ["A", "B"]
    times = {n: defaultdict(list) for n in names}
    engines = {}
    for n, d in zip(names, args.bundles):
        try:
            bundle = Bundle(d)
        except BundleError as e:
            ap.error(str(e))
        timed_graphs(bundle, times[n])
        engines[n] = Engine(bundle, speculation="always")
    prompts, chat = encode_prompts(args.bundles[0], prompt_texts(args.prompts, args.num_prompts), not args.no_chat)
    for spec in (True, False):  # first calls of every graph, kept out of the figures
        for e in engines.values():
            e.generate(prompts[0], min(4, args.max_tokens), speculative=spec)
    for t in times.values():
        t.clear()
    tokens, seconds = defaultdict(int), defaultdict(float)
    outputs: dict[tuple[str, bool], list[list[int]]] = defaultdict(list)
    for r in range(args.repeats):
        for ids in prompts:
            for spec in (True, False):
                for n in (names if r % 2 == 0 else names[::-1]):
                    g = engines[n].generate(ids, args.max_tokens, speculative=spec)
                    tokens[n, spec] += len(g.token_ids) - 1
                    seconds[n, spec] += g.seconds - (g.ttft or 0.0)
                    if r == 0:
                        outputs[n, spec].append(g.token_ids)
    rate = {f"{n} {'speculative' if s else 'plain'}": round(tokens[n, s] / seconds[n, s], 2)
            for n in names for s in (True, False)}
    graphs = {g: {n: round(1e3 * statistics.median(times[n][g]), 3) if times[n][g] else None for n in names} |
              {"calls": [len(times[n][g]) for n in names]}
              for g in sorted(set(times["A"]) | set(times["B"])) if times["A"][g] or times["B"][g]}
    res = {"benchmark": "engine_ab", "bundles": [str(b) for b in args.bundles], "machine": machine(args.threads),
           "prompts": len(prompts), "prompt_set": args.prompts, "chat": chat, "max_tokens": args.max_tokens,
           "repeats": args.repeats, "decode_tok_s": rate,
           "b_over_a": {m: round(rate[f"B {m}"] / rate[f"A {m}"], 3) for m in ("speculative", "plain")},
           "same_tokens": all(outputs["A", s] == outputs["B", s] for s in (True, False)), "graphs_ms": graphs}
    print(f"decode tok/s, {len(prompts)} prompts x {args.max_tokens} x {args.repeats}, {args.threads} thread(s) on "
          f"{res['machine']['cpu']}, A / B interleaved in one process")
    for m in ("speculative", "plain"):
        print(f"  {m:>12}: A {rate[f'A {m}']:.1f}  B {rate[f'B {m}']:.1f}  (B/A {res['b_over_a'][m]:.3f})")
    print(f"  same tokens: {res['same_tokens']}\n  median ms per call in the loop (A / B):")
    for g, v in graphs.items():
        print(f"    {g:<40} " + " / ".join("-" if v[n] is None else f"{v[n]:.2f}" for n in names) + f"  calls {v['calls']}")
    line = json.dumps(res)
    if args.save_result:
        args.save_result.parent.mkdir(parents=True, exist_ok=True)
        args.save_result.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
