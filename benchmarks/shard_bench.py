"""Streaming sharder vs a naive load-everything-then-slice baseline, measured side by side.

Writes a synthetic Llama-shaped checkpoint (>= 1 GiB, fp32, two safetensors shards + index), then
shards it at TP 4 both ways, each in a fresh subprocess, and reports peak RSS and throughput.

    python benchmarks/shard_bench.py [--gib 1.5] [--tp 4] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

H, I, V = 2048, 5632, 32000


def layer_tensors(i: int) -> dict[str, list[int]]:
    p = f"layers.{i}."
    return {p + "self_attn.q_proj.weight": [H, H], p + "self_attn.k_proj.weight": [H // 4, H],
            p + "self_attn.v_proj.weight": [H // 4, H], p + "self_attn.o_proj.weight": [H, H],
            p + "mlp.gate_proj.weight": [I, H], p + "mlp.up_proj.weight": [I, H], p + "mlp.down_proj.weight": [H, I],
            p + "input_layernorm.weight": [H], p + "post_attention_layernorm.weight": [H]}


def make_checkpoint(d: Path, gib: float) -> int:
    per_layer = sum(torch.Size(s).numel() for s in layer_tensors(0).values()) * 4
    n_layers = max(1, round((gib * 2**30 - 2 * V * H * 4) / per_layer))
    shapes = {"embed_tokens.weight": [V, H], "norm.weight": [H], "lm_head.weight": [V, H]}
    for i in range(n_layers):
        shapes |= layer_tensors(i)
    names = sorted(shapes)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map, total = {}, 0
    g = torch.Generator().manual_seed(0)
    for k, part in enumerate(halves):
        fname = f"model-{k + 1:05d}-of-00002.safetensors"
        tensors = {n: torch.randn(shapes[n], generator=g) for n in part}
        total += sum(t.numel() * 4 for t in tensors.values())
        save_file(tensors, d / fname)
        del tensors
        weight_map |= {n: fname for n in part}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (d / "meta.json").write_text(json.dumps({"layers": n_layers, "shapes": shapes}))
    return total


def layout(tp: int):
    from eagle3_build.models.layout import Layout

    return Layout(tp=tp, hidden=H, padded_hidden=H, num_heads=16, num_kv_heads=4, head_dim=H // 16,
                  intermediate=I, vocab=V)


def rank_shapes(shapes: dict, L) -> dict:
    from eagle3_build.sharding import tensor_plan

    return {n: (list(tensor_plan("target", n).apply(torch.empty(s, device="meta"), 0, L).shape), torch.float32)
            for n, s in shapes.items()}


def run_streaming(src: Path, out: Path, tp: int) -> None:
    from eagle3_build.checkpoints.sources import safetensors_source
    from eagle3_build.sharding import write_rank_files

    shapes = json.loads((src / "meta.json").read_text())["shapes"]
    L = layout(tp)
    write_rank_files("target", safetensors_source(src), sorted(shapes), rank_shapes(shapes, L), L, out)


def run_naive(src: Path, out: Path, tp: int) -> None:
    """What a simple converter does: load the whole checkpoint, slice, save each rank."""
    from eagle3_build.sharding import tensor_plan

    L = layout(tp)
    full = {}
    for f in sorted(src.glob("*.safetensors")):
        full |= load_file(f)
    out.mkdir(parents=True, exist_ok=True)
    for r in range(tp):
        save_file({n: tensor_plan("target", n).apply(t, r, L).contiguous() for n, t in full.items()},
                  out / f"rank{r}.safetensors")


def child(mode: str, src: str, out: str, tp: int) -> None:
    import eagle3_build.checkpoints.load  # noqa: F401  (imports are not part of the measurement)
    import eagle3_build.sharding  # noqa: F401

    base = peak_rss()
    t0 = time.perf_counter()
    (run_streaming if mode == "streaming" else run_naive)(Path(src), Path(out), tp)
    dt = time.perf_counter() - t0
    print(json.dumps({"seconds": dt, "peak_rss_bytes": peak_rss(), "rss_after_imports_bytes": base}))


def peak_rss() -> int:
    """VmHWM: this process's own high-water mark (ru_maxrss survives exec and would include the
    parent's peak from before the fork)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.5)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        mode, src, out, tp = a.child
        return child(mode, src, out, int(tp))
    work = Path(tempfile.mkdtemp(prefix="shard-bench-"))
    try:
        src = work / "ckpt"
        src.mkdir()
        total = make_checkpoint(src, a.gib)
        largest = V * H * 4
        results = {"checkpoint_bytes": total, "largest_tensor_bytes": largest, "tp": a.tp}
        for mode in ("streaming", "naive"):
            r = subprocess.run([sys.executable, __file__, "--child", mode, str(src), str(work / mode), str(a.tp)],
                               capture_output=True, text=True, check=True)
            m = json.loads(r.stdout.strip().splitlines()[-1])
            m["throughput_gb_s"] = total / m["seconds"] / 1e9
            results[mode] = m
            shutil.rmtree(work / mode)
        s, n = results["streaming"], results["naive"]
        results["peak_rss_ratio_naive_over_streaming"] = n["peak_rss_bytes"] / s["peak_rss_bytes"]
        results["speed_ratio_streaming_over_naive"] = n["seconds"] / s["seconds"]
        print(f"checkpoint {total / 2**30:.2f} GiB (largest tensor {largest / 2**20:.0f} MiB), TP {a.tp}")
        for mode in ("streaming", "naive"):
            m = results[mode]
            print(f"  {mode:9s}  peak RSS {m['peak_rss_bytes'] / 2**30:6.2f} GiB   {m['seconds']:6.1f} s   "
                  f"{m['throughput_gb_s']:.2f} GB/s")
        print(f"  naive/streaming peak RSS: {results['peak_rss_ratio_naive_over_streaming']:.1f}x, "
              f"streaming speed vs naive: {results['speed_ratio_streaming_over_naive']:.2f}x")
        print(json.dumps(results))
        if a.json:
            a.json.write_text(json.dumps(results, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
