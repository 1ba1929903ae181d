"""`build`: the aoti backend's build time and decode speed on a tiny pair; `shard`: the streaming sharder against
a load-everything-then-slice baseline, on a synthetic Llama-shaped checkpoint (>= 1 GiB float32, two safetensors
shards + index), each way in a fresh process (peak RSS and throughput)."""
from __future__ import annotations

import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .decode import measure_runtime, measure_transformers
from .prompts import random_words


def compile_bundle(recipe: Path, out: Path, cache: Path, backend: str, jobs: int) -> dict:
    env = dict(os.environ, EAGLE3_BUILD_CACHE=str(cache))
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "eagle3_build.cli", "compile", str(recipe), "--out", str(out),
                        "--backend", backend, "--jobs", str(jobs), "--json", "--no-verify"],
                       capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"compile failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    built = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")][-1]
    return {"wall_s": round(wall, 2), "compiled": built["compiled"], "cached": built["cached"]}


def build_and_decode(out: Path, phases: set[str], num_prompts: int, max_tokens: int, repeats: int) -> dict:
    """On a tiny pair (K 3, one prefill bucket, batch 1: 6 graphs): cold builds at --jobs 1 and 2 (empty caches),
    a warm rebuild (goal: nothing compiled, <= 10 s), then decode tok/s of the aoti and export bundles (speculative
    and plain) and transformers eager on the same prompts. Goals: jobs 2 >= 1.6x jobs 1 on 2 cores, aoti >= 3x eager."""
    from eagle3_build.testing.tiny import make_tiny_pair
    from eagle3_runtime.reader import read_manifest

    shutil.rmtree(out, ignore_errors=True)
    recipe = make_tiny_pair(out / "pair", num_speculative_tokens=3)
    res: dict = {"benchmark": "build", "graphs": 6}
    if "build" in phases:
        res["cold_jobs1"] = compile_bundle(recipe, out / "aoti-j1", out / "cache-a", "aoti", 1)
    res["cold_jobs2"] = compile_bundle(recipe, out / "aoti-j2", out / "cache-b", "aoti", 2)
    if "build" in phases:
        res["warm_rebuild"] = compile_bundle(recipe, out / "aoti-warm", out / "cache-b", "aoti", 2)
        res["jobs2_speedup"] = round(res["cold_jobs1"]["wall_s"] / res["cold_jobs2"]["wall_s"], 2)
    res["export_build"] = compile_bundle(recipe, out / "export", out / "cache-b", "export", 1)
    _print_builds(res)
    if "decode" not in phases:
        return res
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "aoti-j2" / "tokenizer" / "tokenizer.json"))
    rng = random.Random(0)
    prompts = [tok.encode(random_words(rng, 12)).ids for _ in range(num_prompts)]
    aoti = measure_runtime(out / "aoti-j2", prompts, max_tokens, repeats)
    export = measure_runtime(out / "export", prompts, max_tokens, repeats)
    eos = list(read_manifest(out / "aoti-j2").eos_token_ids)
    hf, _ = measure_transformers(recipe.parent / "target", "float32", prompts, max_tokens, eos, repeats)
    for m in (aoti, export):
        del m["_tokens"]
    res["decode"] = {"aoti": aoti, "export": export, "transformers_eager": hf}
    rate = {"aoti_spec": aoti["spec"]["decode_tok_s"], "aoti_plain": aoti["plain"]["decode_tok_s"],
            "export_spec": export["spec"]["decode_tok_s"], "export_plain": export["plain"]["decode_tok_s"],
            "transformers_eager": hf["decode_tok_s"]}
    res["ratios"] = {"aoti_spec_vs_transformers": round(rate["aoti_spec"] / rate["transformers_eager"], 2),
                     "aoti_plain_vs_transformers": round(rate["aoti_plain"] / rate["transformers_eager"], 2),
                     "aoti_spec_vs_export_spec": round(rate["aoti_spec"] / rate["export_spec"], 2)}
    if "jobs2_speedup" in res:
        res["ratios"]["jobs2_vs_jobs1_build"] = res["jobs2_speedup"]
    print(f"\n{'decode (greedy)':<28}{'tok/s':>10}{'accept len':>12}")
    for k, v in rate.items():
        m = res["decode"].get(k.split("_")[0], {})
        acc = m.get("acceptance", {}).get("mean_acceptance_length") if k.endswith("_spec") else None
        print(f"{k:<28}{v:>10.1f}{acc if acc is not None else '':>12}")
    for k, v in res["ratios"].items():
        print(f"{k}: {v:.2f}x")
    return res


def _print_builds(res: dict) -> None:
    print(f"{'build':<28}{'wall s':>10}{'compiled':>10}{'cached':>8}")
    for k in ("cold_jobs1", "cold_jobs2", "warm_rebuild", "export_build"):
        if k in res:
            b = res[k]
            print(f"{k:<28}{b['wall_s']:>10.1f}{b['compiled']:>10}{b['cached']:>8}")
    if "jobs2_speedup" in res:
        print(f"jobs 2 vs jobs 1: {res['jobs2_speedup']:.2f}x (goal >= 1.6x); warm rebuild "
              f"{res['warm_rebuild']['wall_s']:.1f}s with {res['warm_rebuild']['compiled']} compiled (goal 0, <= 10 s)")


# ------------------------------------------------------------------------------------------------------ shard

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


def child(mode: str, src: Path, out: Path, tp: int) -> None:
    """One way of sharding, in a fresh process: its seconds and peak RSS as a JSON line."""
    import eagle3_build.checkpoints.load  # noqa: F401  (imports are not part of the measurement)
    import eagle3_build.sharding  # noqa: F401

    base = peak_rss()
    t0 = time.perf_counter()
    (run_streaming if mode == "streaming" else run_naive)(src, out, tp)
    dt = time.perf_counter() - t0
    print(json.dumps({"seconds": dt, "peak_rss_bytes": peak_rss(), "rss_after_imports_bytes": base}))


def peak_rss() -> int:
    """VmHWM: this process's own high-water mark (ru_maxrss survives exec and would include the
    parent's peak from before the fork)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def shard(gib: float, tp: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="shard-bench-"))
    try:
        src = work / "ckpt"
        src.mkdir()
        total = make_checkpoint(src, gib)
        largest = V * H * 4
        res = {"benchmark": "shard", "checkpoint_bytes": total, "largest_tensor_bytes": largest, "tp": tp}
        for mode in ("streaming", "naive"):
            r = subprocess.run([sys.executable, "-m", "benchmarks", "shard-child", mode, str(src), str(work / mode),
                                str(tp)], capture_output=True, text=True, check=True)
            m = json.loads(r.stdout.strip().splitlines()[-1])
            m["throughput_gb_s"] = total / m["seconds"] / 1e9
            res[mode] = m
            shutil.rmtree(work / mode)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    s, n = res["streaming"], res["naive"]
    res["peak_rss_ratio_naive_over_streaming"] = n["peak_rss_bytes"] / s["peak_rss_bytes"]
    res["speed_ratio_streaming_over_naive"] = n["seconds"] / s["seconds"]
    print(f"checkpoint {total / 2**30:.2f} GiB (largest tensor {largest / 2**20:.0f} MiB), TP {tp}")
    for mode in ("streaming", "naive"):
        m = res[mode]
        print(f"  {mode:9s}  peak RSS {m['peak_rss_bytes'] / 2**30:6.2f} GiB   {m['seconds']:6.1f} s   "
              f"{m['throughput_gb_s']:.2f} GB/s")
    print(f"  naive/streaming peak RSS: {res['peak_rss_ratio_naive_over_streaming']:.1f}x, "
          f"streaming speed vs naive: {res['speed_ratio_streaming_over_naive']:.2f}x")
    return res
