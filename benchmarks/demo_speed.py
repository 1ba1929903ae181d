"""Decode speed of a bundle next to transformers eager on its own target, measured in one run.

    python benchmarks/demo_speed.py artifacts/smollm2-135m-eagle3 [--threads N] [--num-prompts 3]
        [--max-tokens 128] [--save-result out.json]

The same chat-templated held-out prompts (training/train_eagle3_draft.py, never trained on), greedy, the
same thread count for both: the runtime (Engine(Bundle(dir))) with speculation and without, then
transformers `generate` on the target the bundle was built from. Decode tok/s = sum(n - 1) /
sum(e2e - TTFT) (benchmarks/spec_report.py's method, whose functions this reuses). `make demo` runs it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from spec_report import encode_prompts, measure_runtime, measure_transformers, prompt_texts  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for both (default: the runtime's, the cores this process may use)")
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--speculation", default="auto", help="the speculative runs' --speculation (default auto, as "
                                                          "eagle3-run: the shape chosen on this host)")
    ap.add_argument("--target", type=Path, default=None, help="transformers checkpoint (default: the bundle's target)")
    ap.add_argument("--save-result", type=Path, default=None)
    args = ap.parse_args(argv)

    from eagle3_build.verify.reference import target_location
    from eagle3_runtime.reader import read_manifest
    from eagle3_runtime.packing import cpu_description
    from eagle3_runtime.tp import set_threads

    load_at_start = round(os.getloadavg()[0], 2)  # other work on the host skews both figures
    threads = set_threads(args.threads)
    manifest = read_manifest(args.bundle)
    target = args.target or target_location(manifest).directory
    texts = prompt_texts("heldout", args.num_prompts)
    prompts, chat = encode_prompts(args.bundle, texts, chat=True)

    rt = measure_runtime(args.bundle, prompts, args.max_tokens, args.repeats, args.speculation)
    hf, hf_tokens = measure_transformers(target, "float32", prompts, args.max_tokens, list(manifest.eos_token_ids),
                                         args.repeats)
    same = sum(a == b for a, b in zip(rt.pop("_tokens"), hf_tokens))
    res = {"bundle": str(args.bundle), "backend": manifest.backend, "threads": threads, "chat": chat,
           "prompts": len(prompts), "max_tokens": args.max_tokens, "load_avg_1m_at_start": load_at_start,
           "cpu": cpu_description(), "runtime": rt, "transformers_eager": hf,
           "runtime_vs_eager": round(rt["spec"]["decode_tok_s"] / hf["decode_tok_s"], 3),
           "plain_equals_eager": f"{same}/{len(prompts)}"}
    acc = rt["acceptance"]
    print(f"\n== decode speed, {len(prompts)} held-out chat prompts x {args.max_tokens} tokens, {threads} threads "
          f"on {res['cpu']}, "
          f"{manifest.backend} backend (1-min load average at start {load_at_start})")
    print(f"  {'eagle3 runtime, speculative:':32}{rt['spec']['decode_tok_s']:7.1f} tok/s   "
          f"({rt['shape']['describe']}, "
          f"acceptance length {acc['mean_acceptance_length']:.2f})")
    for line in rt["chosen_at_start"]:
        print(f"  --speculation {args.speculation}: {line}")
    print(f"  eagle3 runtime, no speculation: {rt['plain']['decode_tok_s']:7.1f} tok/s   "
          f"(speculation {rt['speedup_decode']:.2f}x)")
    print(f"  transformers eager (float32):   {hf['decode_tok_s']:7.1f} tok/s")
    print(f"  runtime vs transformers eager:  {res['runtime_vs_eager']:.2f}x   "
          f"(same tokens as eager: {res['plain_equals_eager']}, speculative == plain: {rt['spec_equals_plain']})")
    if args.save_result:
        args.save_result.parent.mkdir(parents=True, exist_ok=True)
        args.save_result.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
