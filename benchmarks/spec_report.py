"""Speculative-decoding benchmark report for one recipe pair (the demo pair by default): JSON + a PNG.

    python benchmarks/spec_report.py [RECIPE] [--pair NAME] [--k 1,2,3,4] [--backend aoti|export]
        [--num-prompts 8] [--max-tokens 128] [--out artifacts/spec-report]
        --save-result artifacts/spec-report/report.json --plot artifacts/spec-report/report.png

    # the expensive part (a full compile with an empty cache) once, keeping that cache warm ...
    python benchmarks/spec_report.py --phases compile --compile-cache artifacts/spec-report/aoti-cache \
        --save-result artifacts/spec-report/compile-then-load.json
    # ... then everything else from it (--min-buckets: K != the recipe's K builds only the graphs it runs)
    python benchmarks/spec_report.py --cache-dir artifacts/spec-report/aoti-cache --min-buckets \
        --compile-result artifacts/spec-report/compile-then-load.json --save-result R.json --plot R.png
    # re-render a saved report (table + PNG), optionally with notes
    python benchmarks/spec_report.py --from-result R.json --note "..." --save-result R.json --plot R.png

What it measures (every contender greedy, --threads CPU threads (default 1), the same chat-templated prompts, the same
max_tokens; see "Method" below for the details):

  1. Build: one bundle per K (num_speculative_tokens overridden; K sets the verify/catch-up graph
     shapes) through the compile cache ($EAGLE3_BUILD_CACHE or --cache-dir): graphs are shared across
     K (only target_verify and draft_catchup change), and a second run of this script compiles nothing.
  2. Decode, per K bundle, through the runtime (`Engine(Bundle(dir)).generate`): speculative vs plain
     decoding of the same bundle (interleaved per prompt). Reports decode tok/s = sum(n - 1) /
     sum(e2e - TTFT), TPOT (median over prompts of (e2e - TTFT) / (n - 1)), TTFT, end-to-end tok/s,
     and the acceptance block (per-position rate, acceptance length). Also checks that speculative
     and plain output agree token for token.
  3. transformers eager: `AutoModelForCausalLM.from_pretrained(target).generate(do_sample=False)` on
     the same prompt ids, in the bundle's dtype and (by default) float32, the faster of the two on
     these CPUs; TTFT from a streamer's clock.
  4. Cold start, fresh processes: `python -m eagle3_runtime.cli BUNDLE --prompt P --max-tokens 1`
     on the prebuilt bundle of the best K (median of --cold-runs) vs one process that compiles that
     bundle with an EMPTY compile cache (a new temporary $EAGLE3_BUILD_CACHE) and then loads it and
     produces the first token (what a serve-time compile such as vLLM-Neuron's warm-up costs).

Goals (issue 8): speculation vs no speculation >= 1.6x at the best K; runtime vs transformers eager
>= 3x; cold start vs compile-then-load >= 20x. Prints a table, writes JSON (--save-result) and a PNG
(--plot: decode tok/s per K, per-position acceptance per K, cold start; needs matplotlib).

Method:
  * Prompts: --prompts heldout (default) takes the first N held-out prompts of the demo draft's training
    script (training/train_eagle3_draft.py, seed 0: never trained on); `builtin` the verify prompt set;
    or a prompt file (one per line / .json / .jsonl). Wrapped as one user message in the bundle's chat
    template (--no-chat: raw text), tokenized by the bundle's tokenizer.
  * Generation stops at EOS or max_tokens, so n can differ per prompt; rates are per token.
  * TTFT of the runtime is the prefill's first token (Generation.ttft); the draft's prefill runs after
    it and counts in the decode time. No detokenization in the timed loop (transformers has none either).
  * The decode runs are repeated --repeats times; per prompt the median e2e / TTFT is kept.
  * Cold start process times include interpreter start and imports; the OS page cache is warm (the
    bundle was just built/read), which is how a restarted server on the same host sees it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RECIPE = REPO / "recipes" / "smollm2-135m-eagle3.yaml"
GOALS = {"spec_vs_plain": 1.6, "runtime_vs_transformers": 3.0, "cold_start_vs_compile": 20.0}
CHILD_TAG = "SPEC_REPORT_CHILD "


def log(msg: str) -> None:
    print(f"[spec-report {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------- recipe / build

def load_pair(recipe: Path, name: str | None, k: int | None, backend: str, buckets: dict | None = None):
    """The recipe's pair with K (None: the recipe's), the backend and optionally the buckets overridden."""
    from eagle3_build.recipe import Buckets, Speculation, load_recipe, select_pair

    pairs = select_pair(load_recipe(recipe), name)
    if len(pairs) != 1:
        sys.exit(f"{recipe}: {len(pairs)} pairs; choose one with --pair NAME")
    update: dict = {"backend": backend}
    if k is not None:
        update["speculation"] = Speculation(num_speculative_tokens=k)
    if buckets is not None:
        update["buckets"] = Buckets(**buckets)
    return pairs[0].model_copy(update=update)


def build_k(pair, out: Path, cache_dir: Path | None, jobs: int | None) -> dict:
    """Build one bundle (through the compile cache); returns wall time and compiled/cached counts."""
    from eagle3_build.build import build_bundle
    from eagle3_build.compile.cache import CompileCache

    K = pair.speculation.num_speculative_tokens

    def report(ev: dict) -> None:
        if ev.get("event") == "graph" and ev.get("status") in ("compiled", "failed", "retrying"):
            log(f"  K={K} {ev['graph']}: {ev['status']}" + (f" ({ev['seconds']:.0f}s)" if "seconds" in ev else ""))

    t0 = time.perf_counter()
    m = build_bundle(pair, out, report, cache=CompileCache(cache_dir), jobs=jobs)
    wall = time.perf_counter() - t0
    return {"bundle": str(out), "wall_s": round(wall, 2), "graphs": len(m.graphs), "compiled": m.build["compiled"],
            "cached": m.build["cached"], "digest": m.digest}


# ------------------------------------------------------------------------------------------------ prompts

def prompt_texts(spec: str, n: int) -> list[str]:
    if spec == "heldout":
        sys.path.insert(0, str(REPO / "training"))
        from train_eagle3_draft import make_prompts

        if n > 48:
            log(f"--num-prompts {n}: the training script holds out 48 prompts; the rest overlap training data")
        return make_prompts(0, n, 0)[1]  # held-out = the first n_eval unique prompts of seed 0
    from eagle3_build.verify import BUILTIN_PROMPTS, load_prompts

    texts = list(BUILTIN_PROMPTS) if spec == "builtin" else load_prompts(spec)
    return texts[:n]


def encode_prompts(bundle_dir: Path, texts: list[str], chat: bool) -> tuple[list[list[int]], bool]:
    from eagle3_runtime.chat import ChatTemplate
    from eagle3_runtime.tokenizer import BundleTokenizer

    tok = BundleTokenizer(bundle_dir)
    template = ChatTemplate.from_bundle(bundle_dir) if chat else None
    if chat and template is None:
        log("the bundle's tokenizer has no chat template: prompts are encoded as raw text")
    if template is None:
        return [tok.encode(t) for t in texts], False
    return [tok.encode(template.render([{"role": "user", "content": t}]), add_special_tokens=False)
            for t in texts], True


# ------------------------------------------------------------------------------------------------ metrics

def summarize(runs: list[dict]) -> dict:
    """runs: one dict per prompt with n, e2e and ttft (s; medians over repeats)."""
    dec_tokens = sum(r["n"] - 1 for r in runs)
    dec_time = sum(r["e2e"] - r["ttft"] for r in runs)
    tpots = [(r["e2e"] - r["ttft"]) / (r["n"] - 1) for r in runs if r["n"] > 1]
    return {
        "prompts": len(runs),
        "generated_tokens": sum(r["n"] for r in runs),
        "decode_tok_s": round(dec_tokens / dec_time, 3) if dec_time > 0 else None,
        "tpot_ms_median": round(1000 * statistics.median(tpots), 3) if tpots else None,
        "tpot_ms_mean": round(1000 * dec_time / dec_tokens, 3) if dec_tokens else None,
        "ttft_ms_median": round(1000 * statistics.median(r["ttft"] for r in runs), 2),
        "e2e_tok_s": round(sum(r["n"] for r in runs) / sum(r["e2e"] for r in runs), 3),
    }


def _median_runs(per_prompt: list[list[dict]]) -> list[dict]:
    return [{"n": rs[0]["n"], "e2e": statistics.median(r["e2e"] for r in rs),
             "ttft": statistics.median(r["ttft"] for r in rs)} for rs in per_prompt]


def measure_runtime(bundle_dir: Path, prompts: list[list[int]], max_tokens: int, repeats: int) -> dict:
    """Speculative and plain decoding of the same bundle, interleaved per prompt."""
    from eagle3_runtime.bundle import Bundle
    from eagle3_runtime.engine import Engine, SpecStats

    t0 = time.perf_counter()
    engine = Engine(Bundle(bundle_dir))
    load_s = time.perf_counter() - t0
    for spec in (True, False):  # warm-up: a first call of every graph used (prefill, draft, verify, catch-up)
        engine.generate(prompts[0], min(4, max_tokens), speculative=spec)
    warm = engine.metrics.graph_profile()  # profile the measured runs only
    runs = {True: [[] for _ in prompts], False: [[] for _ in prompts]}
    tokens: dict[bool, list[list[int]]] = {True: [], False: []}
    stats = SpecStats(engine.K)
    passes = 0
    for r in range(repeats):
        for i, ids in enumerate(prompts):
            for spec in ((True, False) if (r + i) % 2 == 0 else (False, True)):
                g = engine.generate(ids, max_tokens, speculative=spec)
                runs[spec][i].append({"n": len(g.token_ids), "e2e": g.seconds, "ttft": g.ttft})
                if r == 0:
                    tokens[spec].append(g.token_ids)
                    if spec:
                        passes += g.target_passes
                        stats.add(g.stats)
    spec_s, plain_s = summarize(_median_runs(runs[True])), summarize(_median_runs(runs[False]))
    spec_s["target_passes_per_token"] = round(passes / spec_s["generated_tokens"], 3)
    same = sum(a == b for a, b in zip(tokens[True], tokens[False]))
    return {"K": engine.K, "load_s": round(load_s, 2), "spec": spec_s, "plain": plain_s,
            "speedup_decode": round(spec_s["decode_tok_s"] / plain_s["decode_tok_s"], 3),
            "speedup_e2e": round(spec_s["e2e_tok_s"] / plain_s["e2e_tok_s"], 3),
            "acceptance": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in stats.to_dict().items()}
            | {"per_position_acceptance_rate": [round(x, 4) for x in stats.per_position]},
            "spec_equals_plain": f"{same}/{len(prompts)}", "graphs": engine.metrics.graph_profile(since=warm),
            "_tokens": tokens[False]}


class _Clock:
    """A transformers streamer that only records when each put() happens (first put: the prompt)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def measure_transformers(target: Path, dtype: str, prompts: list[list[int]], max_tokens: int, eos: list[int],
                         repeats: int) -> tuple[dict, list[list[int]]]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, dtype)).eval()
    load_s = time.perf_counter() - t0

    def gen(ids: list[int], n: int) -> tuple[list[int], float, float]:
        x = torch.tensor([ids])
        clock = _Clock()
        t = time.perf_counter()
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos[0], streamer=clock, temperature=None,
                             top_p=None, top_k=None)
        e2e = time.perf_counter() - t
        return out[0, len(ids):].tolist(), e2e, clock.times[1] - t

    gen(prompts[0], min(4, max_tokens))  # warm-up
    per_prompt: list[list[dict]] = [[] for _ in prompts]
    tokens = []
    for r in range(repeats):
        for i, ids in enumerate(prompts):
            toks, e2e, ttft = gen(ids, max_tokens)
            per_prompt[i].append({"n": len(toks), "e2e": e2e, "ttft": ttft})
            if r == 0:
                tokens.append(toks)
    s = summarize(_median_runs(per_prompt))
    s["load_s"] = round(load_s, 2)
    s["dtype"] = dtype
    return s, tokens


# -------------------------------------------------------------------------------------------- cold start

def _run_cli_cmd(bundle: Path, prompt: str, chat: bool, threads: int) -> list[str]:
    return ["-m", "eagle3_runtime.cli", str(bundle), "--prompt", prompt, "--max-tokens", "1", "--threads", str(threads),
            "--json"] + (["--chat"] if chat else [])


def cold_prebuilt(bundle: Path, prompt: str, chat: bool, runs: int, threads: int) -> dict:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, *_run_cli_cmd(bundle, prompt, chat, threads)], capture_output=True, text=True,
                           cwd=REPO, check=False)
        times.append(time.perf_counter() - t0)
        if r.returncode != 0:
            sys.exit(f"eagle3-run failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return {"command": f"python {' '.join(_run_cli_cmd(bundle, prompt, chat, threads))}", "runs_s": [round(t, 3) for t in times],
            "median_s": round(statistics.median(times), 3)}


def cold_compile(recipe: Path, pair: str | None, k: int, backend: str, prompt: str, chat: bool, jobs: int | None,
                 work: Path, runs: int, threads: int, keep_cache: Path | None = None) -> dict:
    """Fresh process: build the bundle with an empty compile cache, then load it and produce one token.
    keep_cache: use this (new or empty) directory as the empty cache and keep it afterwards (one run)."""
    if keep_cache is not None:
        if keep_cache.exists() and any(keep_cache.iterdir()):
            sys.exit(f"--compile-cache {keep_cache}: not empty; the compile-then-load run needs an empty cache")
        runs = 1
    results = []
    for i in range(runs):
        tmp = Path(tempfile.mkdtemp(prefix="cold-compile-", dir=work))
        try:
            cache = keep_cache or tmp / "cache"
            env = dict(os.environ, EAGLE3_BUILD_CACHE=str(cache))
            cmd = [sys.executable, str(Path(__file__).resolve()), str(recipe), "--k", str(k), "--backend", backend,
                   "--cold-child", str(tmp / "bundle"), "--cold-prompt", prompt, "--threads", str(threads)] + (["--pair", pair] if pair else []) \
                + ([] if chat else ["--no-chat"]) + (["--jobs", str(jobs)] if jobs else [])
            t0 = time.perf_counter()
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, check=False)
            wall = time.perf_counter() - t0
            if r.returncode != 0:
                sys.exit(f"cold compile-then-load run failed ({r.returncode}):\n{r.stderr[-3000:]}")
            child = next(json.loads(line[len(CHILD_TAG):]) for line in reversed(r.stdout.splitlines())
                         if line.startswith(CHILD_TAG))
            results.append({"wall_s": round(wall, 2), **child})
            log(f"  compile-then-load run {i + 1}: {wall:.1f}s ({child['compiled']} graphs compiled)")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return {"k": k, "runs": results, "median_s": round(statistics.median(r["wall_s"] for r in results), 2),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "command": f"EAGLE3_BUILD_CACHE=<new empty dir> python benchmarks/spec_report.py {recipe} --k {k} "
                       f"--backend {backend} --cold-child OUT (build_bundle, then eagle3_runtime.cli OUT --max-tokens 1"
                       + (" --chat" if chat else "") + ")"}


def cold_child(args) -> int:
    """--cold-child OUT: build (compile cache from the environment), then run the runtime CLI in-process."""
    t0 = time.perf_counter()
    p = load_pair(args.recipe, args.pair, args.k[0], args.backend)
    b = build_k(p, Path(args.cold_child), None, args.jobs)
    t1 = time.perf_counter()
    from eagle3_runtime.cli import main as run_main

    cmd = _run_cli_cmd(Path(args.cold_child), args.cold_prompt, not args.no_chat, args.threads)[2:]
    rc = run_main(cmd)
    t2 = time.perf_counter()
    print(CHILD_TAG + json.dumps({"build_s": round(t1 - t0, 2), "load_first_token_s": round(t2 - t1, 3),
                                  "compiled": b["compiled"], "cached": b["cached"], "rc": rc}), flush=True)
    return rc


# --------------------------------------------------------------------------------------------------- output

def machine(threads: int) -> dict:
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch

    return {"cpu": cpu, "cpus": os.cpu_count(), "threads": threads, "torch": torch.__version__, "python": platform.python_version(),
            "loadavg_start": [round(x, 2) for x in os.getloadavg()]}


def _threads(res: dict) -> str:
    n = res["machine"].get("threads", 1)
    return f"{n} CPU thread{'s' if n > 1 else ''}"


def _n(x: float) -> str:
    """A rate or ratio with enough digits to be read whatever its size."""
    return f"{x:.3f}" if abs(x) < 1 else f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}"


def _goal(value: float, key: str) -> str:
    g = GOALS[key]
    return f"goal >= {g}x: {'met' if value >= g else 'NOT met'}"


def render_table(res: dict) -> str:
    lines = []
    s = res["summary"]
    b, pr = res["bundle"], res["prompts"]
    if "decode" in res:
        lines.append(f"decode, greedy, {_threads(res)}, {pr['count']} prompts, max_tokens {pr['max_tokens']} "
                     f"({b['backend']}, {b['dtype']}); tok/s = decode tokens/s, TPOT median over prompts")
        lines.append(f"{'K':>3} {'spec tok/s':>11} {'plain tok/s':>12} {'speedup':>8} {'spec TPOT ms':>13} "
                     f"{'plain TPOT ms':>14} {'TTFT ms':>8} {'accept len':>11} {'spec==plain':>12}  "
                     "per-position acceptance")
        for k, v in res["decode"].items():
            a = v["acceptance"]
            lines.append(f"{k:>3} {_n(v['spec']['decode_tok_s']):>11} {_n(v['plain']['decode_tok_s']):>12} "
                         f"{v['speedup_decode']:>7.2f}x {v['spec']['tpot_ms_median']:>13.2f} "
                         f"{v['plain']['tpot_ms_median']:>14.2f} {v['spec']['ttft_ms_median']:>8.1f} "
                         f"{a['mean_acceptance_length']:>11.2f} {v['spec_equals_plain']:>12}  "
                         + ", ".join(f"{x:.3f}" for x in a["per_position_acceptance_rate"]))
        for k, v in res["decode"].items():
            if v.get("graphs"):
                lines.append(f"  K={k} mean ms per call: " + ", ".join(
                    f"{name} {g['mean_ms']:.1f}" for name, g in v["graphs"].items() if "prefill" not in name))
    for t in res.get("transformers", {}).values():
        lines.append(f"transformers eager {t['dtype']:<9}: {_n(t['decode_tok_s'])} tok/s decode, TPOT "
                     f"{t['tpot_ms_median']:.2f} ms, TTFT {t['ttft_ms_median']:.1f} ms"
                     + (f", same tokens as the runtime: {t['same_as_runtime']}" if "same_as_runtime" in t else ""))
    lines.append("")
    if "spec_vs_plain" in s:
        lines.append(f"speculation vs none at best K={s['best_k']}: {s['spec_vs_plain']:.2f}x "
                     f"({_n(s['spec_decode_tok_s'])} vs {_n(s['plain_decode_tok_s'])} tok/s; "
                     f"{_goal(s['spec_vs_plain'], 'spec_vs_plain')})")
    fastest = s.get("transformers_fastest_dtype")
    for key, label in (("runtime_vs_transformers", f"runtime (best K) vs transformers eager {fastest} (the faster)"),
                       ("runtime_vs_transformers_same_dtype", f"runtime (best K) vs transformers eager {b['dtype']}")):
        if s.get(key) is not None:
            lines.append(f"{label}: {_n(s[key])}x ({_goal(s[key], 'runtime_vs_transformers')})")
    c = res.get("cold_start", {})
    if "prebuilt" in c:
        lines.append(f"cold start, K={c['k']} (fresh process, prebuilt bundle -> first token): median "
                     f"{c['prebuilt']['median_s']:.2f}s of {c['prebuilt']['runs_s']}")
    if "compile_then_load" in c:
        ctl = c["compile_then_load"]
        lines.append(f"compile (empty cache) -> load -> first token, fresh process: {ctl['median_s']:.1f}s"
                     + (f" (reused from {ctl['reused_from']})" if "reused_from" in ctl else ""))
    if "cold_start_vs_compile" in s:
        lines.append(f"cold start vs compile-then-load: {s['cold_start_vs_compile']:.1f}x "
                     f"({_goal(s['cold_start_vs_compile'], 'cold_start_vs_compile')})")
    for note in res.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)


def _mark(value: float, key: str) -> str:
    return f"(goal ≥{GOALS[key]:g}x {'✓' if value >= GOALS[key] else '✗'})"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    d = res["decode"]
    ks = list(d)
    has_cold = "prebuilt" in res.get("cold_start", {})
    fig, axes = plt.subplots(1, 3 if has_cold else 2, figsize=(17 if has_cold else 12, 6.0),
                             gridspec_kw={"width_ratios": [1.4, 1, 0.8] if has_cold else [1.4, 1]})
    spec_c, plain_c, hf_c = "#2a7ab0", "#b0b0b0", "#d9822b"

    ax = axes[0]
    x = range(len(ks))
    w = 0.38
    spec = [d[k]["spec"]["decode_tok_s"] for k in ks]
    plain = [d[k]["plain"]["decode_tok_s"] for k in ks]
    ax.bar([i - w / 2 for i in x], spec, w, color=spec_c, label="eagle3 runtime, speculative")
    ax.bar([i + w / 2 for i in x], plain, w, color=plain_c, label="same bundle, no speculation")
    top = max(spec + plain + [t["decode_tok_s"] for t in res.get("transformers", {}).values()])
    for i, k in enumerate(ks):
        ax.text(i - w / 2, spec[i], _n(spec[i]), ha="center", va="bottom", fontsize=8, color="#1d4f73")
        ax.text(i + w / 2, plain[i], _n(plain[i]), ha="center", va="bottom", fontsize=8, color="#555")
        ax.text(i, max(spec[i], plain[i]) + 0.06 * top, f"{_n(d[k]['speedup_decode'])}x", ha="center",
                va="bottom", fontsize=10, fontweight="bold")
    styles = ["--", ":"]
    for j, (name, t) in enumerate(res.get("transformers", {}).items()):
        ax.axhline(t["decode_tok_s"], color=hf_c, ls=styles[j % 2], lw=1.6,
                   label=f"transformers eager generate(), {t['dtype']}: {_n(t['decode_tok_s'])} tok/s")
    ax.set_xticks(list(x), [f"K={k}" for k in ks])
    ax.set_ylabel(f"decode tokens/s ({_threads(res)}, greedy)")
    s = res["summary"]
    ax.set_title(f"Decode speed — best K={s['best_k']}: {s['spec_vs_plain']:.2f}x over no speculation "
                 f"{_mark(s['spec_vs_plain'], 'spec_vs_plain')}"
                 + (f",\n{_n(s['runtime_vs_transformers'])}x the faster transformers eager "
                    f"{_mark(s['runtime_vs_transformers'], 'runtime_vs_transformers')}"
                    if s.get("runtime_vs_transformers") else ""), fontsize=10.5)
    ax.set_ylim(0, top * 1.15)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2, fontsize=8.5, frameon=False)
    ax.grid(axis="y", alpha=0.3)

    ax = axes[1]
    cmap = plt.get_cmap("viridis")
    for i, k in enumerate(ks):
        a = d[k]["acceptance"]
        rates = a["per_position_acceptance_rate"]
        ax.plot(range(1, len(rates) + 1), rates, marker="o", color=cmap(i / max(1, len(ks) - 1) * 0.85),
                label=f"K={k}: acceptance length {a['mean_acceptance_length']:.2f}")
    kmax = max(int(k) for k in ks)
    ax.set_xticks(range(1, kmax + 1))
    ax.set_xlim(0.7, kmax + 0.3)
    ax.set_ylim(0, 1)
    ax.set_xlabel("draft position")
    ax.set_ylabel("fraction of drafts accepted at that position")
    ax.set_title("Acceptance per draft position\n(fraction of rounds whose first i drafts were all accepted)",
                 fontsize=10.5)
    ax.legend(fontsize=8.5)
    ax.grid(alpha=0.3)

    if has_cold:
        ax = axes[2]
        c = res["cold_start"]
        labels, vals, colors = ["prebuilt bundle\n→ first token"], [c["prebuilt"]["median_s"]], [spec_c]
        if "compile_then_load" in c:
            labels.append("compile (empty cache)\n→ load → first token")
            vals.append(c["compile_then_load"]["median_s"])
            colors.append(hf_c)
        ax.bar(labels, vals, color=colors, width=0.6)
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.1f}s" if v >= 10 else f"{v:.2f}s", ha="center", va="bottom", fontsize=10)
        ax.set_yscale("log")
        ax.set_ylim(min(vals) / 2, max(vals) * 3)
        ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}s"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_ylabel("seconds, fresh process (log scale)")
        ttl = f"Cold start, K={c['k']} bundle"
        if "compile_then_load" in c:
            ttl += (f":\nprebuilt {s['cold_start_vs_compile']:.0f}x faster "
                    f"{_mark(s['cold_start_vs_compile'], 'cold_start_vs_compile')}")
        ax.set_title(ttl, fontsize=10.5)
        ax.grid(axis="y", alpha=0.3, which="both")
        ax.tick_params(axis="x", labelsize=9)

    b = res["bundle"]
    fig.suptitle(f"EAGLE3 on {b['name']} — {b['backend']} backend, {b['dtype']}, {res['prompts']['count']} "
                 f"chat prompts × ≤{res['prompts']['max_tokens']} tokens, {_threads(res)} — {res['machine']['cpu']}",
                 fontsize=11)
    notes = res.get("notes", [])
    if notes:
        fig.text(0.01, 0.005, "\n".join(f"Note: {n}" for n in notes), fontsize=8.5, va="bottom", ha="left",
                 wrap=True, color="#8a1c1c")
    fig.tight_layout(rect=(0, 0.035 * (1 + sum(len(n) // 200 for n in notes)) * bool(notes), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------------ main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", nargs="?", type=Path, default=DEFAULT_RECIPE)
    ap.add_argument("--pair", default=None, help="pair name (recipes with several pairs)")
    ap.add_argument("--k", default="1,2,3,4", help="comma-separated K values, one bundle each")
    ap.add_argument("--backend", default="aoti", choices=["aoti", "export"])
    ap.add_argument("--out", type=Path, default=REPO / "artifacts" / "spec-report", help="bundles and scratch")
    ap.add_argument("--cache-dir", type=Path, default=None, help="compile cache (default $EAGLE3_BUILD_CACHE)")
    ap.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: the builder's)")
    ap.add_argument("--phases", default="decode,transformers,cold,compile",
                    help="what to measure (comma-separated): decode (runtime spec vs plain per K), transformers, "
                         "cold (prebuilt bundle -> first token), compile (compile-then-load)")
    ap.add_argument("--min-buckets", action="store_true",
                    help="decode bundles for K other than --cold-k hold only the graphs the benchmark runs (the "
                         "smallest prefill bucket that fits the prompts, batch 1): the same graphs (same cache "
                         "keys) as the full bundle's, fewer to compile")
    ap.add_argument("--prompts", default="heldout", help="heldout | builtin | a prompt file")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="timed passes over the prompts (median per prompt)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads for every contender")
    ap.add_argument("--no-chat", action="store_true", help="raw prompts instead of the chat template")
    ap.add_argument("--hf-dtypes", default="auto",
                    help="transformers eager dtypes, comma-separated; auto = the bundle's and float32")
    ap.add_argument("--cold-k", type=int, default=None, help="K of the cold-start bundle (default: the recipe's)")
    ap.add_argument("--cold-runs", type=int, default=3, help="fresh-process runs on the prebuilt bundle (median)")
    ap.add_argument("--compile-runs", type=int, default=1,
                    help="compile-then-load runs (each a full compile of every graph with an empty cache)")
    ap.add_argument("--compile-cache", type=Path, default=None,
                    help="use this new/empty directory as the compile-then-load run's empty cache and keep it "
                         "(pass it as --cache-dir later: the compile then also warmed the cache)")
    ap.add_argument("--compile-result", type=Path, default=None,
                    help="reuse the compile-then-load measurement of an earlier report JSON instead of compiling "
                         "again (graphs do not depend on weights: valid across draft retrains of the same shapes)")
    ap.add_argument("--note", action="append", default=[], help="a note recorded in the JSON and under the plot")
    ap.add_argument("--from-result", type=Path, default=None,
                    help="measure nothing: re-render the table/plot of a saved report (plus any --note)")
    ap.add_argument("--save-result", type=Path, default=None, help="write the JSON report here")
    ap.add_argument("--plot", type=Path, default=None, help="write the PNG figure here")
    ap.add_argument("--cold-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cold-prompt", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.k = [int(k) for k in str(args.k).split(",") if k.strip()]
    phases = {x.strip() for x in args.phases.split(",") if x.strip()}
    unknown = phases - {"decode", "transformers", "cold", "compile"}
    if unknown:
        ap.error(f"--phases: unknown {sorted(unknown)}")

    if args.from_result is not None:
        res = json.loads(args.from_result.read_text())
        res["notes"] = res.get("notes", []) + args.note
        return _write(res, args)

    import torch

    torch.set_num_threads(args.threads)
    if args.cold_child:
        return cold_child(args)

    t_start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    res: dict = {"machine": machine(args.threads), "recipe": str(args.recipe), "k": args.k, "phases": sorted(phases),
                 "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else None,
                 "notes": list(args.note)}
    recipe_pair = load_pair(args.recipe, args.pair, None, args.backend)
    cold_k = args.cold_k or recipe_pair.speculation.num_speculative_tokens
    p = recipe_pair
    res["bundle"] = {"name": p.name, "backend": args.backend, "dtype": p.dtype, "target": p.target.uri,
                     "draft": p.draft.uri, "recipe_k": p.speculation.num_speculative_tokens,
                     "prefill_buckets": p.buckets.prefill, "batch_buckets": p.buckets.batch,
                     "max_model_len": p.serving.max_model_len, "max_num_seqs": p.serving.max_num_seqs}
    texts = prompt_texts(args.prompts, args.num_prompts)
    chat = not args.no_chat
    res["prompts"] = {"source": args.prompts, "count": len(texts), "max_tokens": args.max_tokens,
                      "repeats": args.repeats, "texts": texts}
    summary: dict = {}
    builds: dict[str, dict] = {}
    res["builds"] = builds

    def build(k: int, buckets: dict | None = None) -> Path:
        tag = f"k{k}" + ("-min" if buckets else "")
        if tag not in builds:
            log(f"building {tag} ({args.backend}) -> {args.out / tag}")
            b = builds[tag] = build_k(load_pair(args.recipe, args.pair, k, args.backend, buckets), args.out / tag,
                                      args.cache_dir, args.jobs)
            log(f"  {tag}: {b['compiled']} compiled, {b['cached']} cached, {b['wall_s']:.1f}s")
        return args.out / tag

    full = None
    if phases & {"decode", "transformers", "cold"}:
        full = build(cold_k)  # the recipe's bundle (K = --cold-k): prompts are encoded with its tokenizer
        prompts, chat = encode_prompts(full, texts, chat)
        res["prompts"].update({"chat_template": chat, "prompt_tokens": [len(x) for x in prompts]})

    # decode through the runtime, per K
    runtime_tokens = None
    if "decode" in phases:
        decode = res["decode"] = {}
        fit = next((b for b in p.buckets.prefill if b >= max(len(x) for x in prompts)), p.buckets.prefill[-1])
        for k in args.k:
            small = args.min_buckets and k != cold_k
            bdir = build(k, {"prefill": [fit], "batch": [1]} if small else None)
            log(f"decoding K={k}: {len(prompts)} prompts x {args.max_tokens} tokens, speculative and plain")
            m = measure_runtime(bdir, prompts, args.max_tokens, args.repeats)
            runtime_tokens = runtime_tokens or m["_tokens"]
            del m["_tokens"]
            m["bundle"] = str(bdir)
            decode[str(k)] = m
            log(f"  K={k}: spec {m['spec']['decode_tok_s']:.1f} tok/s, plain {m['plain']['decode_tok_s']:.1f} tok/s,"
                f" {m['speedup_decode']:.2f}x, acceptance length {m['acceptance']['mean_acceptance_length']:.2f}")
        best_k = max(args.k, key=lambda k: decode[str(k)]["spec"]["decode_tok_s"])
        best = decode[str(best_k)]
        summary.update({"best_k": best_k, "spec_vs_plain": best["speedup_decode"],
                        "spec_decode_tok_s": best["spec"]["decode_tok_s"],
                        "plain_decode_tok_s": best["plain"]["decode_tok_s"]})

    # transformers eager
    if "transformers" in phases:
        from eagle3_runtime.reader import read_manifest

        dtypes = ([p.dtype] + (["float32"] if p.dtype != "float32" else [])) if args.hf_dtypes == "auto" \
            else [x.strip() for x in args.hf_dtypes.split(",") if x.strip()]
        if p.target.kind != "local" or not p.target.path:
            log(f"transformers baseline skipped: target {p.target.uri} is not a local HF directory")
        else:
            hf = res["transformers"] = {}
            eos = list(read_manifest(full).eos_token_ids)
            for dt in dtypes:
                log(f"transformers eager generate(), {dt}")
                t, toks = measure_transformers(Path(p.target.path), dt, prompts, args.max_tokens, eos, args.repeats)
                if runtime_tokens is not None:
                    t["same_as_runtime"] = f"{sum(a == b for a, b in zip(toks, runtime_tokens))}/{len(prompts)}"
                hf[dt] = t
                log(f"  {dt}: {t['decode_tok_s']:.1f} tok/s")
            fastest = max(hf.values(), key=lambda t: t["decode_tok_s"])
            summary.update({"transformers_fastest_dtype": fastest["dtype"],
                            "transformers_decode_tok_s": fastest["decode_tok_s"]})
            if "decode" in phases:
                best = res["decode"][str(summary["best_k"])]
                summary["runtime_vs_transformers"] = round(best["spec"]["decode_tok_s"] / fastest["decode_tok_s"], 3)
                summary["runtime_vs_transformers_e2e"] = round(best["spec"]["e2e_tok_s"] / fastest["e2e_tok_s"], 3)
                if p.dtype in hf:
                    summary["runtime_vs_transformers_same_dtype"] = round(
                        best["spec"]["decode_tok_s"] / hf[p.dtype]["decode_tok_s"], 3)

    # cold start
    cold: dict = {"k": cold_k, "prompt": texts[0]}
    if "cold" in phases:
        log(f"cold start, K={cold_k}: {args.cold_runs} fresh eagle3-run processes on the prebuilt bundle")
        cold["prebuilt"] = cold_prebuilt(full, texts[0], chat, args.cold_runs, args.threads)
        log(f"  prebuilt: median {cold['prebuilt']['median_s']:.2f}s")
    if args.compile_result is not None:
        prev = json.loads(args.compile_result.read_text())
        ctl = prev.get("cold_start", {}).get("compile_then_load") or prev.get("compile_then_load")
        if not ctl:
            sys.exit(f"--compile-result {args.compile_result}: no compile_then_load measurement in it")
        if ctl.get("k") not in (None, cold_k):
            log(f"note: the reused compile-then-load measurement was taken at K={ctl['k']}, cold start at K={cold_k}")
        cold["compile_then_load"] = {**ctl, "reused_from": str(args.compile_result)}
    elif "compile" in phases:
        log(f"cold start, K={cold_k}: compile with an empty cache, then load -> first token "
            f"({args.compile_runs} run(s), each a full compile of every graph)")
        cold["compile_then_load"] = cold_compile(args.recipe, args.pair, cold_k, args.backend, texts[0], chat,
                                                 args.jobs, args.out, args.compile_runs, args.threads, args.compile_cache)
    if "prebuilt" in cold or "compile_then_load" in cold:
        res["cold_start"] = cold
    if "prebuilt" in cold and "compile_then_load" in cold:
        summary["cold_start_vs_compile"] = round(cold["compile_then_load"]["median_s"] / cold["prebuilt"]["median_s"], 2)

    summary["goals"] = {k: {"goal": g, "value": summary.get(k), "met": summary.get(k) is not None and summary[k] >= g}
                        for k, g in GOALS.items()}
    res["summary"] = summary
    res["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    res["wall_s"] = round(time.perf_counter() - t_start, 1)
    return _write(res, args)


def _write(res: dict, args) -> int:
    if args.save_result:
        args.save_result.parent.mkdir(parents=True, exist_ok=True)
        args.save_result.write_text(json.dumps(res, indent=2) + "\n")
        log(f"wrote {args.save_result}")
    print(render_table(res))
    if args.plot and "decode" in res:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(res, args.plot)
        log(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
