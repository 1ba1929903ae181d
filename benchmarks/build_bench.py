"""Build-time and decode-speed benchmark for the aoti backend, measured side by side in one run.

    python benchmarks/build_bench.py [--out artifacts/build-bench] [--save-result build_bench.json]

On one tiny pair (make-tiny-pair, K 3, one prefill bucket, batch 1: 6 graphs):
  1. cold build, --jobs 1 (empty compile cache A)
  2. cold build, --jobs 2 (empty compile cache B)
  3. warm rebuild (cache B again): graphs compiled (goal 0) and wall time (goal <= 10 s)
  4. decode tokens/s on the same prompts, greedy, 1 CPU thread each: aoti bundle vs export bundle
     (both through the runtime Engine, speculative and plain) vs transformers eager `generate()`, float32.
     Measured by spec_report.py's measure_runtime / measure_transformers (decode tok/s = tokens after the
     first / time after the first; per prompt the median of --repeats passes).
Goals: jobs 2 >= 1.6x faster than jobs 1 on 2 cores; aoti decode >= 3x transformers eager.
Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("artifacts/build-bench"))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--save-result", type=Path, default=None)
    ap.add_argument("--phases", default="build,decode", help="comma list: build, decode")
    args = ap.parse_args()
    phases = set(args.phases.split(","))

    import torch

    torch.set_num_threads(1)
    from eagle3_build.testing.tiny import make_tiny_pair

    root = args.out
    shutil.rmtree(root, ignore_errors=True)
    recipe = make_tiny_pair(root / "pair", num_speculative_tokens=3)  # (one prefill bucket: 6 graphs)

    res: dict = {"machine": {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()[0]}, "graphs": 6}
    if "build" in phases:
        res["cold_jobs1"] = compile_bundle(recipe, root / "aoti-j1", root / "cache-a", "aoti", 1)
    res["cold_jobs2"] = compile_bundle(recipe, root / "aoti-j2", root / "cache-b", "aoti", 2)
    if "build" in phases:
        res["warm_rebuild"] = compile_bundle(recipe, root / "aoti-warm", root / "cache-b", "aoti", 2)
        res["jobs2_speedup"] = round(res["cold_jobs1"]["wall_s"] / res["cold_jobs2"]["wall_s"], 2)
    res["export_build"] = compile_bundle(recipe, root / "export", root / "cache-b", "export", 1)
    if "decode" not in phases:
        _print_builds(res)
        _save(res, args.save_result)
        return

    import random

    from spec_report import measure_runtime, measure_transformers
    from tokenizers import Tokenizer

    from eagle3_runtime.reader import read_manifest

    tok = Tokenizer.from_file(str(root / "aoti-j2" / "tokenizer" / "tokenizer.json"))
    rng = random.Random(0)
    words = ["the", "a", "fox", "dog", "runs", "over", "under", "quick", "lazy", "brown", "river", "city", "night",
             "day", "light"]
    prompts = [tok.encode(" ".join(rng.choice(words) for _ in range(12))).ids for _ in range(args.num_prompts)]

    aoti = measure_runtime(root / "aoti-j2", prompts, args.max_tokens, args.repeats)
    export = measure_runtime(root / "export", prompts, args.max_tokens, args.repeats)
    eos = list(read_manifest(root / "aoti-j2").eos_token_ids)
    hf_res, _ = measure_transformers(recipe.parent / "target", "float32", prompts, args.max_tokens, eos, args.repeats)
    for m in (aoti, export):
        del m["_tokens"]
    res["decode"] = {"aoti": aoti, "export": export, "transformers_eager": hf_res}
    rate = {"aoti_spec": aoti["spec"]["decode_tok_s"], "aoti_plain": aoti["plain"]["decode_tok_s"],
            "export_spec": export["spec"]["decode_tok_s"], "export_plain": export["plain"]["decode_tok_s"],
            "transformers_eager": hf_res["decode_tok_s"]}
    hf = rate["transformers_eager"]
    res["ratios"] = {"aoti_spec_vs_transformers": round(rate["aoti_spec"] / hf, 2),
                     "aoti_plain_vs_transformers": round(rate["aoti_plain"] / hf, 2),
                     "aoti_spec_vs_export_spec": round(rate["aoti_spec"] / rate["export_spec"], 2)}
    if "jobs2_speedup" in res:
        res["ratios"]["jobs2_vs_jobs1_build"] = res["jobs2_speedup"]
    _print_builds(res)
    print(f"\n{'decode (greedy, 1 thread)':<28}{'tok/s':>10}{'accept len':>12}")
    for k, v in rate.items():
        m = res["decode"].get(k.split("_")[0], {})
        acc = m.get("acceptance", {}).get("mean_acceptance_length") if k.endswith("_spec") else None
        print(f"{k:<28}{v:>10.1f}{acc if acc is not None else '':>12}")
    for k, v in res["ratios"].items():
        print(f"{k}: {v:.2f}x")
    _save(res, args.save_result)


def _print_builds(res: dict) -> None:
    print(f"{'build':<28}{'wall s':>10}{'compiled':>10}{'cached':>8}")
    for k in ("cold_jobs1", "cold_jobs2", "warm_rebuild", "export_build"):
        if k in res:
            b = res[k]
            print(f"{k:<28}{b['wall_s']:>10.1f}{b['compiled']:>10}{b['cached']:>8}")
    if "jobs2_speedup" in res:
        print(f"jobs 2 vs jobs 1: {res['jobs2_speedup']:.2f}x (goal >= 1.6x); warm rebuild "
              f"{res['warm_rebuild']['wall_s']:.1f}s with {res['warm_rebuild']['compiled']} compiled (goal 0, <= 10 s)")


def _save(res: dict, path: Path | None) -> None:
    text = json.dumps(res, indent=2)
    if path:
        path.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
