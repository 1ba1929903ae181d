#!/usr/bin/env python
"""Acceptance of a built demo bundle on the training script's held-out prompts, through the real runtime.

    python training/measure_acceptance.py artifacts/smollm2-135m-eagle3 [--prompts 16] [--max-tokens 128]

For each held-out prompt (chat template, greedy): the bundle's speculative output, its plain
(--no-spec) output and the transformers greedy response recorded by train_eagle3_draft.py (bf16,
batched). Prints the aggregated acceptance block (vLLM format) and one JSON object with the per-position
rates, the acceptance length, and losslessness: speculative == plain on every prompt (same runtime, so
they must agree token for token), and the first divergence from transformers where there is one.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "training"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--data", default=None, help="held-out split (default: the newest cached data set)")
    ap.add_argument("--no-plain", action="store_true", help="skip the --no-spec comparison")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    from eagle3_runtime.engine import Engine, SpecStats
    from eagle3_runtime.tp import open_bundle
    from train_eagle3_draft import DATA_ROOT, load_split

    data = Path(args.data) if args.data else max(DATA_ROOT.glob("*/eval.safetensors"), key=lambda p: p.stat().st_mtime)
    held = load_split(data)
    bundle, _ = open_bundle(args.bundle)
    tok, template = bundle.text  # (the chat template renders in its own worker processes)
    engine = Engine(bundle, tokenizer=tok)
    total = SpecStats(engine.K)
    rows, t_spec, t_plain, n_spec = [], 0.0, 0.0, 0
    for prompt, seq in list(zip(held["prompts"], held["seqs"]))[:args.prompts]:
        ids = tok.encode(template.render([{"role": "user", "content": prompt}]), add_special_tokens=False)
        ref = seq["tokens"][seq["P"]:].tolist()
        assert ids == seq["tokens"][:seq["P"]].tolist(), "runtime and training tokenize the chat prompt differently"
        g = engine.generate(ids, args.max_tokens)
        t_spec += g.seconds
        n_spec += len(g.token_ids)
        s = g.stats
        total.add(s)
        row = {"prompt": prompt, "tokens": len(g.token_ids), "acceptance_length": round(s.mean_acceptance_length, 3)}
        if not args.no_plain:
            p = engine.generate(ids, args.max_tokens, speculative=False)
            t_plain += p.seconds
            row["lossless_vs_plain"] = p.token_ids == g.token_ids
        n = min(len(ref), len(g.token_ids))
        diff = next((i for i in range(n) if ref[i] != g.token_ids[i]), None)
        row["first_divergence_from_transformers"] = diff
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(total.format())
    out = {"bundle": str(args.bundle), "prompts": len(rows), "max_tokens": args.max_tokens, "K": engine.K,
           **total.to_dict(), "spec_tokens_per_s": round(n_spec / t_spec, 1) if t_spec else None,
           "plain_tokens_per_s": round(n_spec / t_plain, 1) if t_plain else None,
           "lossless_vs_plain": all(r.get("lossless_vs_plain", True) for r in rows),
           "identical_to_transformers": sum(r["first_divergence_from_transformers"] is None for r in rows),
           "measured_at": time.strftime("%Y-%m-%d %H:%M")}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
