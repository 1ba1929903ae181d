"""Projection layout benchmark: F.linear (x @ W.T) vs weight-stationary ((W @ x.T).T, the form
eagle3_build/models/linear.py traces into decode-sized graphs) vs oneDNN with the weight prepacked for the
row count (`mkldnn._reorder_linear_weight` + `mkldnn._linear_pointwise`, what Inductor's CPU weight
prepacking emits; where this torch has oneDNN), measured side by side in one run on this host's CPU.

    python benchmarks/linear_layout.py [--config artifacts/smollm2-135m-instruct/config.json]
        [--rows 1,2,3,4,6,8,12,16] [--threads 1] [--repeats 9] [--save-result linear_layout.json]

Every projection of one forward pass of a Llama-family model (per layer q, k, v, o, gate, up, down; then
the lm_head) with random float32 weights of the config's shapes, for x of `rows` token rows: the
work of a decode (1 row) or verify (b * (K + 1) rows) step without attention. The forms run
interleaved, --repeats times each; medians in ms, the ratio F.linear / weight-stationary (> 1: the
weight-stationary form is faster) and the fastest form per row count. Without --config: SmolLM2-135M's
shapes.
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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eagle3_build.errors import CheckpointError
from eagle3_build.models.linear import SMALL_ROWS, weight_stationary
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


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_form(weights, rows: int):
    """x @ W.T through oneDNN, each weight reordered once for `rows` rows (outside the timing)."""
    packed = {id(w): torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights}
    return lambda x, w: torch.ops.mkldnn._linear_pointwise(x, packed[id(w)], None, "none", [None], "")


def measure(weights, rows: int, repeats: int) -> dict:
    xs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
    forms = {"linear": lambda x, w: F.linear(x, w), "weight_stationary": weight_stationary}
    if onednn_available():
        forms["onednn_packed"] = onednn_form(weights, rows)
    ms = {name: [] for name in forms}
    for rep in range(repeats + 1):  # the first pass warms up and is not kept
        for name, fn in forms.items():
            t0 = time.perf_counter()
            for w in weights:
                fn(xs[w.shape[1]], w)
            if rep:
                ms[name].append((time.perf_counter() - t0) * 1e3)
    med = {name: statistics.median(v) for name, v in ms.items()}
    return {"rows": rows, **{f"{name}_ms": round(v, 2) for name, v in med.items()},
            "ratio": round(med["linear"] / med["weight_stationary"], 3), "fastest": min(med, key=med.get)}


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
    mb = sum(w.numel() for w in weights) * 4 / 2**20
    host = machine(args.threads)
    print(f"{len(weights)} projections, {mb:.0f} MiB float32, {host['cpu']}, {args.threads} thread(s); "
          f"models/linear.py uses the weight-stationary form up to {SMALL_ROWS} rows")
    print(f"{'rows':>4} {'F.linear ms':>12} {'weight-stat. ms':>16} {'oneDNN packed ms':>17} {'ratio':>6}  fastest")
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        r = measure(weights, rows, args.repeats)
        results.append(r)
        onednn = f"{r['onednn_packed_ms']:>17.1f}" if "onednn_packed_ms" in r else f"{'n/a':>17}"
        print(f"{rows:>4} {r['linear_ms']:>12.1f} {r['weight_stationary_ms']:>16.1f} {onednn} {r['ratio']:>6.2f}  "
              f"{r['fastest']}", flush=True)
    out = {"benchmark": "linear_layout", "config": str(args.config or "SmolLM2-135M (built in)"),
           "projections": len(weights), "weights_mib": round(mb, 1), "threads": args.threads,
           "repeats": args.repeats, "small_rows": SMALL_ROWS, "torch": torch.__version__, "machine_info": host,
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "machine": platform.machine(),
           "results": results}
    print(json.dumps(out))
    if args.save_result:
        args.save_result.parent.mkdir(parents=True, exist_ok=True)
        args.save_result.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
