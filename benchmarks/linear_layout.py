"""Projection layout benchmark: F.linear (x @ W.T) vs the forms the aoti backend chooses among per row
count (eagle3_build/backends/gemm.py, the same timing code): "plain" weight-stationary ((W @ x.T).T, what
eagle3_build/models/linear.py traces without packing), MKL's packed sgemm and oneDNN with the weight
prepacked for the row count (eagle3_runtime/packing.py; each where this torch has it), measured side by
side in one run on this host's CPU.

    python benchmarks/linear_layout.py [--config artifacts/smollm2-135m-instruct/config.json]
        [--rows 1,2,3,4,6,8,12,16] [--threads 1] [--repeats 9] [--save-result linear_layout.json]

Every projection of one forward pass of a Llama-family model (per layer q, k, v, o, gate, up, down; then
the lm_head) with random float32 weights of the config's shapes, for x of `rows` token rows: the
work of a decode (1 row) or verify (b * (K + 1) rows) step without attention. The forms run
interleaved, --repeats times each; medians in ms, the fastest form and what the builder would choose
(gemm.pick) per row count. Without --config: SmolLM2-135M's shapes.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eagle3_build.errors import CheckpointError
from eagle3_build.backends.gemm import F_LINEAR, PLAIN, ROUNDS, pick, time_forms
from eagle3_build.models.linear import SMALL_ROWS
from eagle3_runtime.packing import PACK_FORMATS, pack_available
from eagle3_build.models.llama import llama_args
from spec_report import machine  # noqa: E402

SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "vocab_size": 49152}


def projection_shapes(cfg: dict) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """(out, in) of every layer projection, then the lm_head's, read the way the builder reads a target."""
    a = llama_args(cfg, "target")
    H, q, kv = a.hidden_size, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    layer = [(q, H), (kv, H), (kv, H), (H, q), (a.intermediate_size, H), (a.intermediate_size, H),
             (H, a.intermediate_size)]
    return layer * a.num_layers, (a.vocab_size, H)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, help="HF config.json (default: SmolLM2-135M's shapes)")
    ap.add_argument("--rows", default="1,2,3,4,6,8,12,16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--no-lm-head", action="store_true", help="only the layer projections")
    ap.add_argument("--save-result", type=Path)
    args = ap.parse_args()
    cfg = json.loads(args.config.read_text()) if args.config else SMOLLM2
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    try:
        layer_shapes, head = projection_shapes(cfg)
    except CheckpointError as e:
        sys.exit(f"--config {args.config}: {e}")
    shapes = layer_shapes + ([] if args.no_lm_head else [head])
    weights = [torch.randn(n, k) for n, k in shapes]
    forms = [F_LINEAR, PLAIN] + [f for f in PACK_FORMATS if pack_available(f)]  # (the target's: exact float32)
    mb = sum(w.numel() for w in weights) * 4 / 2**20
    host = machine(args.threads)
    print(f"{len(weights)} projections, {mb:.0f} MiB float32, {host['cpu']}, {args.threads} thread(s); "
          f"the aoti backend chooses per row count up to {SMALL_ROWS} rows among {', '.join(forms[1:])}")
    print(f"{'rows':>4} " + " ".join(f"{f + ' ms':>13}" for f in forms) + "  fastest / chosen")
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        rounds = time_forms(shapes, rows, forms, args.repeats, weights=weights, rounds=ROUNDS)
        chosen = pick({f: v for f, v in rounds.items() if f != F_LINEAR})
        ms = {f: round(statistics.median(v), 3) for f, v in rounds.items()}
        r = {"rows": rows, "ms": ms, "fastest": min(ms, key=ms.get), "chosen": chosen}
        results.append(r)
        print(f"{rows:>4} " + " ".join(f"{ms[f]:>13.1f}" for f in forms) + f"  {r['fastest']} / {chosen}", flush=True)
    out = {"benchmark": "linear_layout", "config": str(args.config or "SmolLM2-135M (built in)"),
           "projections": len(weights), "weights_mib": round(mb, 1), "threads": args.threads,
           "repeats": args.repeats, "small_rows": SMALL_ROWS, "forms": forms, "torch": torch.__version__, "machine_info": host,
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "machine": platform.machine(),
           "results": results}
    print(json.dumps(out))
    if args.save_result:
        args.save_result.parent.mkdir(parents=True, exist_ok=True)
        args.save_result.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
