"""Time to first token with the engine's prefill plan against padding every prompt to a bucket, side by side.

    python benchmarks/prefill_plan.py BUNDLE [--prompts mtbench|heldout|builtin|FILE] [--num-prompts 40]
        [--repeats 2] [--threads 2] [--no-chat] [--save-result benchmarks/results/prefill-plan.json]

Loads the bundle through the runtime (warm-up included: the plan weighs the graph times it measures) and runs
every prompt for one token, in-process, twice in turn: with the plan (a prompt just past a bucket may run that
bucket plus verify calls: eagle3_runtime/engine.py `_prefill_plan`) and padded (the warm-up's times hidden from
the engine, so each prompt pads to the smallest bucket holding it). Prints, per arm, the median and mean time to
first token over all prompts and over the prompts the plan continues, with their ratio; JSON (CPU model named)
on stdout's last line and with --save-result. Prompts past the largest bucket run the plan in both arms.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_report import encode_prompts, machine  # noqa: E402
from vs_vllm import load_texts  # noqa: E402

from eagle3_runtime.bundle import Bundle  # noqa: E402
from eagle3_runtime.engine import Engine  # noqa: E402


def summary(ms: list[float]) -> dict:
    return {"median_ms": round(statistics.median(ms), 1), "mean_ms": round(statistics.mean(ms), 1)} if ms else {}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--prompts", default="mtbench")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-chat", action="store_true", help="encode the prompts as raw text (default: chat template)")
    ap.add_argument("--save-result", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    res = {"benchmark": "prefill_plan", "machine": machine(args.threads), "bundle": str(args.bundle),
           "prompt_set": args.prompts, "repeats": args.repeats}
    bundle = Bundle(args.bundle)
    bundle.warm_up()
    prompts, chat = encode_prompts(args.bundle, load_texts(args.prompts, args.num_prompts), not args.no_chat)
    engine = Engine(bundle, speculation="auto")
    longest = bundle.manifest.longest_prompt()
    prompts = [p for p in prompts if len(p) <= longest]
    timed = (bundle.backend.timings, bundle.backend.costs)
    plans = [engine._prefill_plan(len(p), 1, True) for p in prompts]
    continued = [i for i, (_, shape) in enumerate(plans) if shape is not None]
    ms: dict[str, list[list[float]]] = {"plan": [[] for _ in prompts], "padded": [[] for _ in prompts]}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for i, ids in enumerate(prompts):
                for arm, (timings, costs) in (("plan", timed), ("padded", ({}, {}))):
                    bundle.backend.timings, bundle.backend.costs = timings, costs
                    t0 = time.perf_counter()
                    engine.generate(ids, 1)
                    ms[arm][i].append((time.perf_counter() - t0) * 1e3)
    bundle.backend.timings, bundle.backend.costs = timed
    res.update({"chat_template": chat, "prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts],
                "continued": [len(prompts[i]) for i in continued],
                "plans": [{"bucket": s, "continued_by": shape.describe() if shape else None} for s, shape in plans]})
    for arm, per in ms.items():
        res[arm] = {"all": summary([x for xs in per for x in xs]),
                    "continued": summary([x for i in continued for x in per[i]])}
    sub = res["padded"]["continued"], res["plan"]["continued"]
    res["continued_padded_over_plan"] = round(sub[0]["mean_ms"] / sub[1]["mean_ms"], 3) if continued else None
    m = res["machine"]
    print(f"time to first token, {len(prompts)} {args.prompts} prompts x {args.repeats}, one token each, in-process, "
          f"{m['threads']} threads on {m['cpu']} (1-min load average at start {m['loadavg_start'][0]})")
    print(f"  continued by the plan: {len(continued)} of {len(prompts)} (prompt tokens {res['continued']})")
    for arm in ("plan", "padded"):
        a, c = res[arm]["all"], res[arm]["continued"]
        print(f"  {arm:7s} all: median {a['median_ms']} ms, mean {a['mean_ms']} ms"
              + (f"; continued prompts: median {c['median_ms']} ms, mean {c['mean_ms']} ms" if c else ""))
    if continued:
        print(f"  continued prompts, padded / plan (mean): {res['continued_padded_over_plan']}x")
    print(json.dumps(res))
    if args.save_result:
        args.save_result.parent.mkdir(parents=True, exist_ok=True)
        args.save_result.write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
