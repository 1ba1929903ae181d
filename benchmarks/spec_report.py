"""Speculative-decoding benchmark report for one recipe pair (the demo pair by default): speculation
SHAPES (chains and token trees) side by side in one run, JSON + a PNG.

    python benchmarks/spec_report.py [RECIPE] [--pair NAME] [--shapes chain:3,tree:4x4x16] [--backend aoti|export]
        [--num-prompts 8] [--max-tokens 128] [--threads 2] [--min-buckets] [--out artifacts/spec-report]
        --save-result artifacts/spec-report/report.json --plot artifacts/spec-report/report.png

    # shapes: chain:K | tree:DxKxN (D draft steps = num_speculative_tokens, topk K, N = num_draft_tokens: the
    # nodes verified per pass, the root included) | static:JSON-or-FILE (TensorRT-LLM eagle_choices)
    python benchmarks/spec_report.py --shapes 'chain:3,tree:3x2x6,tree:4x4x16,static:[[0],[1],[0,0],[0,0,0]]'
    python benchmarks/spec_report.py --k 1,2,3,4          # the old K sweep: chain shapes
    # the demo pair on 2 threads, prefill bucket 128 only (the chat prompts fit it: fewer graphs to compile)
    python benchmarks/spec_report.py --threads 2 --prefill-buckets 128 --phases decode,transformers,cold \
        --shapes chain:3,tree:3x2x6,tree:4x4x16,tree:5x4x24 --save-result R.json --plot R.png
    # the expensive part (a full compile with an empty cache) once, keeping that cache warm ...
    python benchmarks/spec_report.py --phases compile --compile-cache artifacts/spec-report/aoti-cache \
        --save-result artifacts/spec-report/compile-then-load.json
    # ... then everything else from it (--min-buckets: decode bundles hold only the graphs they run)
    python benchmarks/spec_report.py --cache-dir artifacts/spec-report/aoti-cache --min-buckets \
        --compile-result artifacts/spec-report/compile-then-load.json --save-result R.json --plot R.png
    # re-render a saved report (table + PNG), optionally with notes (a per-K report of the old K sweep too)
    python benchmarks/spec_report.py --from-result R.json --note "..." --save-result R.json --plot R.png

What it measures (every contender greedy, --threads CPU threads (default 1), the same chat-templated prompts, the same
max_tokens; see "Method" below for the details):

  1. Build: one bundle per shape (the pair with `speculation` replaced by that shape in every batch bucket,
     num_speculative_tokens = its depth) through the compile cache ($EAGLE3_BUILD_CACHE or --cache-dir):
     graphs are shared across shapes where their shapes agree (target_prefill and target_decode always;
     draft_prefill per topk; target_verify per node count; draft_step / draft_catchup per tree), and a
     second run of this script compiles nothing. Bundle directories are named by the shape: chain-k3,
     tree-4x4x16, static-<hash of the choices> (-min: --min-buckets).
  2. Decode, per shape bundle, through the runtime (`Engine(Bundle(dir)).generate`): speculative vs plain
     decoding of the same bundle (interleaved per prompt). Reports decode tok/s = sum(n - 1) /
     sum(e2e - TTFT), TPOT (median over prompts of (e2e - TTFT) / (n - 1)), TTFT, end-to-end tok/s,
     the acceptance block (mean acceptance length = tokens per verify pass, acceptance rate per DEPTH,
     drafted nodes per round), nodes verified per pass, and from the engine's graph profile the verify
     graph's mean ms, the draft graphs' ms per round (draft_step x (depth - 1) + draft_catchup) and a plain
     decode pass's ms. Also checks that speculative and plain output agree token for token. The best
     shape is the one with the highest speculative decode tok/s.
  3. transformers eager: `AutoModelForCausalLM.from_pretrained(target).generate(do_sample=False)` on
     the same prompt ids, in the bundle's dtype and (by default) float32, the faster of the two on
     these CPUs; TTFT from a streamer's clock.
  4. Cold start, fresh processes: `python -m eagle3_runtime.cli BUNDLE --prompt P --max-tokens 1`
     on the prebuilt full-bucket bundle of --cold-shape (default: the best shape; the recipe's own
     speculation when no decode ran) (median of --cold-runs) vs one process that compiles that bundle
     with an EMPTY compile cache (a new temporary $EAGLE3_BUILD_CACHE) and then loads it and produces
     the first token (what a serve-time compile such as vLLM-Neuron's warm-up costs).

Goals: speculation vs no speculation >= 1.6x at the best shape; runtime vs transformers eager
>= 3x; cold start vs compile-then-load >= 20x. Prints a table, writes JSON (--save-result) and a PNG
(--plot: decode tok/s, acceptance length, per-depth acceptance and verify / draft ms per shape, cold
start; needs matplotlib). Ratios also reported: the best shape vs chain K 3 (when in the set).

Method:
  * Prompts: --prompts heldout (default) takes the first N held-out prompts of the demo draft's training
    script (training/train_eagle3_draft.py, seed 0: never trained on); `builtin` the verify prompt set;
    or a prompt file (one per line / .json / .jsonl). Wrapped as one user message in the bundle's chat
    template (--no-chat: raw text), tokenized by the bundle's tokenizer.
  * Generation stops at EOS or max_tokens, so n can differ per prompt; rates are per token.
  * TTFT of the runtime is the prefill's first token (Generation.ttft); the draft's prefill runs after
    it and counts in the decode time. No detokenization in the timed loop (transformers has none either).
  * The decode runs are repeated --repeats times; per prompt the median e2e / TTFT is kept. Acceptance
    counts are from the first pass; the graph profile (ms) from every measured pass.
  * --min-buckets: the first shape's bundle keeps every prefill bucket (its tokenizer sizes the prompts),
    the others only the smallest prefill bucket that fits the prompts; all of them batch bucket 1.
  * Cold start process times include interpreter start and imports; the OS page cache is warm (the
    bundle was just built/read), which is how a restarted server on the same host sees it.
"""
from __future__ import annotations

import argparse
import hashlib
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
DEFAULT_SHAPES = "chain:3,tree:4x4x16"
GOALS = {"spec_vs_plain": 1.6, "runtime_vs_transformers": 3.0, "cold_start_vs_compile": 20.0}
CHILD_TAG = "SPEC_REPORT_CHILD "


def log(msg: str) -> None:
    print(f"[spec-report {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------- shapes

def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets (a static tree's JSON holds commas)."""
    items, depth, cur = [], 0, []
    for ch in text:
        depth += (ch in "[{") - (ch in "]}")
        if ch == "," and depth == 0:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    items.append("".join(cur))
    return [x.strip() for x in items if x.strip()]


def parse_shape(item: str):
    """chain:K (or a bare K) | tree:DxKxN | static:JSON-or-FILE -> SpecShape. Raises ValueError."""
    from eagle3_runtime.manifest import SpecShape, chain, dynamic_tree, static_tree

    kind, _, arg = item.partition(":")
    if not arg and kind.strip().isdigit():
        kind, arg = "chain", kind
    kind, arg = kind.strip().lower(), arg.strip()
    try:
        if kind == "chain":
            shape = chain(int(arg))
        elif kind == "tree":
            dims = [int(x) for x in arg.lower().split("x")]
            if len(dims) != 3:
                raise ValueError(f"a tree is DxKxN (three numbers), got {arg!r}")
            shape = dynamic_tree(*dims)
        elif kind == "static":
            data = json.loads(arg if arg.startswith("[") else Path(arg).read_text())
            choices = data.get("choices") if isinstance(data, dict) else data
            shape = SpecShape.model_validate(static_tree(choices).model_dump())  # static_tree does not validate
        else:
            raise ValueError("the kind must be chain, tree or static")
    except (ValueError, TypeError, OSError, AttributeError) as e:  # pydantic's ValidationError is a ValueError
        msg = "; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors()) if hasattr(e, "errors") else e
        raise ValueError(f"{item!r}: {msg} (forms: chain:K, tree:DxKxN = depth x topk x num_draft_tokens, "
                         f"static:JSON-LIST-OF-PATHS or static:FILE)") from None
    if not shape.speculates:
        raise ValueError(f"{item!r}: depth 0 is no speculation (plain decoding is measured for every shape anyway)")
    return shape


def parse_shapes(text: str) -> list:
    shapes = []
    for item in _split_top(text):
        s = parse_shape(item)
        if s in shapes:
            log(f"shape {item!r} repeats {shape_name(s)}: measured once")
        else:
            shapes.append(s)
    if not shapes:
        raise ValueError("no shapes given")
    return shapes


def shape_name(shape) -> str:
    """The shape's bundle directory / JSON name: chain-k3, tree-4x4x16, static-<hash>."""
    if shape.kind == "chain":
        return f"chain-k{shape.depth}"
    if shape.kind == "static":
        return "static-" + hashlib.sha256(json.dumps(shape.choices).encode()).hexdigest()[:8]
    return f"tree-{shape.depth}x{shape.topk}x{shape.num_nodes}"


def shape_arg(shape) -> str:
    """The --shapes item that gives `shape` back (for the cold compile-then-load child)."""
    if shape.kind == "chain":
        return f"chain:{shape.depth}"
    if shape.kind == "static":
        return "static:" + json.dumps(shape.choices, separators=(",", ":"))
    return f"tree:{shape.depth}x{shape.topk}x{shape.num_nodes}"


def shape_record(shape) -> dict:
    return {**shape.model_dump(), "kind": shape.kind, "describe": shape.describe(), "arg": shape_arg(shape)}


# ----------------------------------------------------------------------------------------- recipe / build

def load_pair(recipe: Path, name: str | None, shape, backend: str, buckets: dict | None = None):
    """The recipe's pair with the backend, optionally the buckets, and the speculation (a SpecShape in every
    batch bucket; None: the recipe's own) overridden."""
    from eagle3_build.recipe import Buckets, Speculation, load_recipe, select_pair

    pairs = select_pair(load_recipe(recipe), name)
    if len(pairs) != 1:
        sys.exit(f"{recipe}: {len(pairs)} pairs; choose one with --pair NAME")
    update: dict = {"backend": backend}
    if buckets is not None:
        update["buckets"] = Buckets(**buckets)
    pair = pairs[0].model_copy(update=update)
    if shape is not None:
        spec = Speculation(num_speculative_tokens=shape.depth, shapes={b: shape for b in pair.buckets.batch})
        pair = pair.model_copy(update={"speculation": spec})
    return pair


def bundle_buckets(pair, prefill: str | None) -> dict:
    """The buckets of this run's full bundles: the pair's, with --prefill-buckets replacing its prefill buckets."""
    return {"prefill": sorted({int(x) for x in prefill.split(",") if x.strip()}) if prefill else list(pair.buckets.prefill),
            "batch": list(pair.buckets.batch)}


def build_pair(pair, out: Path, cache_dir: Path | None, jobs: int | None) -> dict:
    """Build one bundle (through the compile cache); returns wall time and compiled/cached counts."""
    from eagle3_build.build import build_bundle
    from eagle3_build.compile.cache import CompileCache

    def report(ev: dict) -> None:
        if ev.get("event") == "graph" and ev.get("status") in ("compiled", "failed", "retrying"):
            log(f"  {out.name} {ev['graph']}: {ev['status']}" + (f" ({ev['seconds']:.0f}s)" if "seconds" in ev else ""))

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
    with template:
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


def measure_runtime(bundle_dir: Path, prompts: list[list[int]], max_tokens: int, repeats: int,
                    speculation: str = "always") -> dict:
    """Speculative and plain decoding of the same bundle, interleaved per prompt; `speculation` as
    eagle3-run's --speculation (auto: the warm-up times the graphs, the engine chooses among the menu)."""
    from eagle3_runtime.bundle import Bundle
    from eagle3_runtime.engine import Engine, SpecStats

    t0 = time.perf_counter()
    bundle = Bundle(bundle_dir)
    if speculation == "auto":
        bundle.warm_up()
    engine = Engine(bundle, speculation=speculation)
    load_s = time.perf_counter() - t0
    chosen = engine.speculation_report()
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
    graphs = engine.metrics.graph_profile(since=warm)
    b = engine.batch_buckets[0]  # one sequence at a time: the smallest batch bucket
    shape = engine.menus[b].get(engine.choosers[b].current, engine.shapes[b]) if b in engine.choosers else \
        engine.shapes[b]
    acceptance = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in stats.to_dict().items()} | {
        "per_position_acceptance_rate": [round(x, 4) for x in stats.per_position],  # per depth
        "drafted_nodes_per_round": round(stats.num_draft_tokens / stats.num_drafts, 3) if stats.num_drafts else None}
    return {"K": engine.K, "shape": shape_record(shape), "nodes_per_verify": shape.num_nodes,
            "speculation": speculation, "chosen_at_start": chosen, "chosen_at_end": engine.speculation_report(),
            "load_s": round(load_s, 2), "spec": spec_s, "plain": plain_s,
            "speedup_decode": round(spec_s["decode_tok_s"] / plain_s["decode_tok_s"], 3),
            "speedup_e2e": round(spec_s["e2e_tok_s"] / plain_s["e2e_tok_s"], 3),
            "acceptance": acceptance, "round_ms": round_profile(graphs),
            "spec_equals_plain": f"{same}/{len(prompts)}", "graphs": graphs, "_tokens": tokens[False]}


def round_profile(graphs: dict[str, dict]) -> dict:
    """Per speculative round, from a graph profile ({"role/bucket": calls, total_s}): the verify graph's
    mean ms, the draft graphs' ms per round (draft_step x (depth - 1) + draft_catchup), and a plain decode
    pass's mean ms (the cost one verify pass replaces)."""
    def role(name: str) -> tuple[int, float]:
        gs = [g for key, g in graphs.items() if key.split("/")[0].split(":")[0] == name]  # (role:tag: a menu shape's)
        return sum(g["calls"] for g in gs), sum(g["total_s"] for g in gs)

    (nv, tv), (ns, ts), (nc, tc), (nd, td) = (role(r) for r in ("target_verify", "draft_step", "draft_catchup",
                                                                 "target_decode"))
    ms = lambda t, n: round(1000 * t / n, 3) if n else None  # noqa: E731
    return {"rounds": nv, "verify_ms": ms(tv, nv), "draft_ms_per_round": ms(ts + tc, nv),
            "draft_step_ms": ms(ts, ns), "draft_steps_per_round": round(ns / nv, 3) if nv else None,
            "draft_catchup_ms": ms(tc, nc), "round_ms": ms(tv + ts + tc, nv), "plain_decode_ms": ms(td, nd)}


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


def cold_compile(recipe: Path, pair: str | None, shape, backend: str, prompt: str, chat: bool, jobs: int | None,
                 work: Path, runs: int, threads: int, keep_cache: Path | None = None, prefill: str | None = None) -> dict:
    """Fresh process: build the bundle of `shape` (None: the recipe's speculation) with an empty compile
    cache, then load it and produce one token.
    keep_cache: use this (new or empty) directory as the empty cache and keep it afterwards (one run)."""
    if keep_cache is not None:
        if keep_cache.exists() and any(keep_cache.iterdir()):
            sys.exit(f"--compile-cache {keep_cache}: not empty; the compile-then-load run needs an empty cache")
        runs = 1
    arg = "recipe" if shape is None else shape_arg(shape)
    results = []
    for i in range(runs):
        tmp = Path(tempfile.mkdtemp(prefix="cold-compile-", dir=work))
        try:
            cache = keep_cache or tmp / "cache"
            env = dict(os.environ, EAGLE3_BUILD_CACHE=str(cache))
            cmd = [sys.executable, str(Path(__file__).resolve()), str(recipe), "--cold-shape", arg, "--backend", backend,
                   "--cold-child", str(tmp / "bundle"), "--cold-prompt", prompt, "--threads", str(threads)] \
                + (["--pair", pair] if pair else []) + ([] if chat else ["--no-chat"]) \
                + (["--jobs", str(jobs)] if jobs else []) + (["--prefill-buckets", prefill] if prefill else [])
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
    return {"shape": "recipe" if shape is None else shape_name(shape), "runs": results,
            "median_s": round(statistics.median(r["wall_s"] for r in results), 2),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "command": f"EAGLE3_BUILD_CACHE=<new empty dir> python benchmarks/spec_report.py {recipe} --cold-shape "
                       f"'{arg}' --backend {backend}" + (f" --prefill-buckets {prefill}" if prefill else "")
                       + " --cold-child OUT (build_bundle, then eagle3_runtime.cli OUT "
                       "--max-tokens 1" + (" --chat" if chat else "") + ")"}


def cold_child(args) -> int:
    """--cold-child OUT: build (compile cache from the environment), then run the runtime CLI in-process."""
    t0 = time.perf_counter()
    shape = None if args.cold_shape in ("recipe", "best") else parse_shape(args.cold_shape)
    p = load_pair(args.recipe, args.pair, None, args.backend)
    p = load_pair(args.recipe, args.pair, shape, args.backend, bundle_buckets(p, args.prefill_buckets))
    b = build_pair(p, Path(args.cold_child), None, args.jobs)
    t1 = time.perf_counter()
    from eagle3_runtime.cli import main as run_main

    cmd = _run_cli_cmd(Path(args.cold_child), args.cold_prompt, not args.no_chat, args.threads)[2:]
    rc = run_main(cmd)
    t2 = time.perf_counter()
    print(CHILD_TAG + json.dumps({"build_s": round(t1 - t0, 2), "load_first_token_s": round(t2 - t1, 3),
                                  "compiled": b["compiled"], "cached": b["cached"], "rc": rc}), flush=True)
    return rc


# --------------------------------------------------------------------------------------------------- output

def shape_summary(decode: list[dict]) -> dict:
    """The best shape (highest speculative decode tok/s) and its ratios to no speculation and chain K 3."""
    best = max(decode, key=lambda e: e["spec"]["decode_tok_s"])
    out = {"best_shape": best["name"], "best_shape_describe": best["shape"]["describe"],
           "spec_vs_plain": best["speedup_decode"], "spec_decode_tok_s": best["spec"]["decode_tok_s"],
           "plain_decode_tok_s": best["plain"]["decode_tok_s"],
           "best_acceptance_length": best["acceptance"]["mean_acceptance_length"]}
    c3 = next((e for e in decode if e["name"] == "chain-k3"), None)
    if c3 is not None:
        out["chain_k3_decode_tok_s"] = c3["spec"]["decode_tok_s"]
        out["best_vs_chain_k3"] = round(best["spec"]["decode_tok_s"] / c3["spec"]["decode_tok_s"], 3)
    return out


def best_entry(res: dict) -> dict:
    return next(e for e in res["decode"] if e["name"] == res["summary"]["best_shape"])


def upgrade_result(res: dict) -> dict:
    """A report of the former K sweep (decode: {"K": entry}) in this version's layout (decode: [entry])."""
    d = res.get("decode")
    if not isinstance(d, dict):
        return res
    from eagle3_runtime.manifest import chain

    log("--from-result: a per-K report of the former K sweep; rendered as chain shapes")
    entries = []
    for k, v in d.items():
        shape = chain(int(k))
        entries.append({"name": shape_name(shape), "shape": shape_record(shape), "nodes_per_verify": shape.num_nodes,
                        "round_ms": round_profile(v.get("graphs", {})), **v})
    res["decode"] = entries
    res["shapes"] = [e["name"] for e in entries]
    s = res.setdefault("summary", {})
    s.pop("best_k", None)
    s.update(shape_summary(entries))
    for c in (res.get("cold_start", {}), res.get("cold_start", {}).get("compile_then_load", {})):
        if "k" in c:
            c.setdefault("shape", f"chain-k{c['k']}")
    return res


def machine(threads: int) -> dict:
    import torch

    from eagle3_runtime.packing import cpu_description

    return {"cpu": cpu_description(), "cpus": os.cpu_count(), "threads": threads, "torch": torch.__version__, "python": platform.python_version(),
            "loadavg_start": [round(x, 2) for x in os.getloadavg()]}


def _threads(res: dict) -> str:
    n = res["machine"].get("threads", 1)
    return f"{n} CPU thread{'s' if n > 1 else ''}"


def _n(x: float | None) -> str:
    """A rate or ratio with enough digits to be read whatever its size."""
    if x is None:
        return "-"
    return f"{x:.3f}" if abs(x) < 1 else f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}"


def _goal(value: float, key: str) -> str:
    g = GOALS[key]
    return f"goal >= {g}x: {'met' if value >= g else 'NOT met'}"


def render_table(res: dict) -> str:
    lines = []
    s = res["summary"]
    b, pr = res["bundle"], res["prompts"]
    decode = res.get("decode") or []
    if decode:
        w = max(5, *(len(e["name"]) for e in decode))
        lines.append(f"decode, greedy, {_threads(res)}, {pr['count']} prompts, max_tokens {pr['max_tokens']} "
                     f"({b['backend']}, {b['dtype']}); tok/s = decode tokens/s, TPOT median over prompts; ms per "
                     "verify pass / draft graphs per round / plain decode pass")
        lines.append(f"{'shape':<{w}} {'spec tok/s':>10} {'plain tok/s':>11} {'speedup':>7} {'TPOT ms':>8} "
                     f"{'TTFT ms':>8} {'accept len':>10} {'nodes':>5} {'verify ms':>9} {'draft ms':>8} "
                     f"{'plain ms':>8} {'spec==plain':>11}  per-depth acceptance")
        for e in decode:
            a, r = e["acceptance"], e.get("round_ms", {})
            ms = lambda x: f"{x:.1f}" if x is not None else "-"  # noqa: E731
            lines.append(f"{e['name']:<{w}} {_n(e['spec']['decode_tok_s']):>10} {_n(e['plain']['decode_tok_s']):>11} "
                         f"{e['speedup_decode']:>6.2f}x {e['spec']['tpot_ms_median']:>8.2f} "
                         f"{e['spec']['ttft_ms_median']:>8.1f} {a['mean_acceptance_length']:>10.2f} "
                         f"{e['nodes_per_verify']:>5} {ms(r.get('verify_ms')):>9} {ms(r.get('draft_ms_per_round')):>8} "
                         f"{ms(r.get('plain_decode_ms')):>8} {e['spec_equals_plain']:>11}  "
                         + ", ".join(f"{x:.3f}" for x in a["per_position_acceptance_rate"]))
        for e in decode:
            lines.append(f"  {e['name']}: {e['shape']['describe']}" + "".join(
                f"; {name} {g['mean_ms']:.1f} ms x {g['calls']}" for name, g in e.get("graphs", {}).items()
                if "prefill" not in name))
    for t in res.get("transformers", {}).values():
        lines.append(f"transformers eager {t['dtype']:<9}: {_n(t['decode_tok_s'])} tok/s decode, TPOT "
                     f"{t['tpot_ms_median']:.2f} ms, TTFT {t['ttft_ms_median']:.1f} ms"
                     + (f", same tokens as the runtime: {t['same_as_runtime']}" if "same_as_runtime" in t else ""))
    lines.append("")
    if "spec_vs_plain" in s:
        lines.append(f"best shape {s['best_shape']} ({s['best_shape_describe']}): speculation vs none "
                     f"{s['spec_vs_plain']:.2f}x ({_n(s['spec_decode_tok_s'])} vs {_n(s['plain_decode_tok_s'])} tok/s, "
                     f"acceptance length {s['best_acceptance_length']:.2f}; {_goal(s['spec_vs_plain'], 'spec_vs_plain')})")
    if "best_vs_chain_k3" in s:
        lines.append(f"best shape vs chain K 3: {s['best_vs_chain_k3']:.3f}x ({_n(s['spec_decode_tok_s'])} vs "
                     f"{_n(s['chain_k3_decode_tok_s'])} tok/s)")
    fastest = s.get("transformers_fastest_dtype")
    for key, label in (("runtime_vs_transformers", f"runtime (best shape) vs transformers eager {fastest} (the faster)"),
                       ("runtime_vs_transformers_same_dtype", f"runtime (best shape) vs transformers eager {b['dtype']}")):
        if s.get(key) is not None and not (key.endswith("same_dtype") and fastest == b["dtype"]):
            lines.append(f"{label}: {_n(s[key])}x ({_goal(s[key], 'runtime_vs_transformers')})")
    c = res.get("cold_start", {})
    if "prebuilt" in c:
        lines.append(f"cold start, {c.get('shape')} bundle (fresh process, prebuilt bundle -> first token): median "
                     f"{c['prebuilt']['median_s']:.2f}s of {c['prebuilt']['runs_s']}")
    if "compile_then_load" in c:
        ctl = c["compile_then_load"]
        lines.append(f"compile (empty cache) -> load -> first token, fresh process, {ctl.get('shape')} bundle: "
                     f"{ctl['median_s']:.1f}s" + (f" (reused from {ctl['reused_from']})" if "reused_from" in ctl else ""))
    if "cold_start_vs_compile" in s:
        lines.append(f"cold start vs compile-then-load: {s['cold_start_vs_compile']:.1f}x "
                     f"({_goal(s['cold_start_vs_compile'], 'cold_start_vs_compile')})")
    for note in res.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)


def _mark(value: float, key: str) -> str:
    return f"(goal ≥{GOALS[key]:g}x {'✓' if value >= GOALS[key] else '✗'})"


def plot(res: dict, path: Path) -> None:
    """Decode tok/s, acceptance length, per-depth acceptance and the cost of a round per shape (+ cold start)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    d = res["decode"]
    names = [e["name"] for e in d]
    x = list(range(len(d)))
    colors = [plt.get_cmap("tab10")(i % 10) for i in x]
    ticks = [f"{e['name']}\n{e['nodes_per_verify']} nodes/verify" for e in d]
    s = res["summary"]
    has_cold = "prebuilt" in res.get("cold_start", {})
    fig = plt.figure(figsize=(18, 11.5))
    grid = fig.add_gridspec(2, 3, width_ratios=[1.2, 1, 0.9])
    plain_c, hf_c = "#b0b0b0", "#d9822b"

    # 1. decode tok/s per shape
    ax = fig.add_subplot(grid[0, :2])
    w = 0.38
    spec = [e["spec"]["decode_tok_s"] for e in d]
    plain = [e["plain"]["decode_tok_s"] for e in d]
    ax.bar([i - w / 2 for i in x], spec, w, color=colors, label="eagle3 runtime, speculative (bar colour: shape)")
    ax.bar([i + w / 2 for i in x], plain, w, color=plain_c, label="same bundle, no speculation")
    top = max(spec + plain + [t["decode_tok_s"] for t in res.get("transformers", {}).values()])
    for i, e in enumerate(d):
        ax.text(i - w / 2, spec[i], _n(spec[i]), ha="center", va="bottom", fontsize=8.5)
        ax.text(i + w / 2, plain[i], _n(plain[i]), ha="center", va="bottom", fontsize=8, color="#555")
        ax.text(i, max(spec[i], plain[i]) + 0.06 * top, f"{_n(e['speedup_decode'])}x", ha="center",
                va="bottom", fontsize=10, fontweight="bold" if e["name"] == s["best_shape"] else "normal")
    for j, t in enumerate(res.get("transformers", {}).values()):
        ax.axhline(t["decode_tok_s"], color=hf_c, ls=["--", ":"][j % 2], lw=1.6,
                   label=f"transformers eager generate(), {t['dtype']}: {_n(t['decode_tok_s'])} tok/s")
    ax.set_xticks(x, ticks, fontsize=9)
    ax.set_ylabel(f"decode tokens/s ({_threads(res)}, greedy)")
    ttl = (f"Decode speed — best {s['best_shape']} ({s['best_shape_describe']}): {s['spec_vs_plain']:.2f}x over no "
           f"speculation {_mark(s['spec_vs_plain'], 'spec_vs_plain')}")
    extra = []
    if "best_vs_chain_k3" in s:
        extra.append(f"{s['best_vs_chain_k3']:.2f}x chain K 3")
    if s.get("runtime_vs_transformers"):
        extra.append(f"{_n(s['runtime_vs_transformers'])}x the faster transformers eager "
                     f"{_mark(s['runtime_vs_transformers'], 'runtime_vs_transformers')}")
    ax.set_title(ttl + ("\n" + ", ".join(extra) if extra else ""), fontsize=10.5)
    ax.set_ylim(0, top * 1.18)
    ax.legend(loc="upper right", fontsize=8.5, framealpha=0.9)
    ax.grid(axis="y", alpha=0.3)

    # 2. acceptance length per shape
    ax = fig.add_subplot(grid[0, 2])
    lens = [e["acceptance"]["mean_acceptance_length"] for e in d]
    ax.bar(x, lens, color=colors, width=0.6)
    for i, v in enumerate(lens):
        ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=9)
    ax.axhline(1, color="#555", lw=0.8)
    ax.set_xticks(x, names, fontsize=8.5, rotation=20)
    ax.set_ylim(0, max(lens + [1]) * 1.15)
    ax.set_ylabel("tokens per verify pass")
    ax.set_title("Mean acceptance length\n(accepted drafts + the bonus token, per round)", fontsize=10.5)
    ax.grid(axis="y", alpha=0.3)

    # 3. per-depth acceptance
    ax = fig.add_subplot(grid[1, 0])
    for i, e in enumerate(d):
        rates = e["acceptance"]["per_position_acceptance_rate"]
        ax.plot(range(1, len(rates) + 1), rates, marker="o", color=colors[i],
                label=f"{e['name']}: {e['acceptance']['mean_acceptance_length']:.2f}")
    dmax = max(len(e["acceptance"]["per_position_acceptance_rate"]) for e in d)
    ax.set_xticks(range(1, dmax + 1))
    ax.set_xlim(0.7, dmax + 0.3)
    ax.set_ylim(0, 1)
    ax.set_xlabel("depth")
    ax.set_ylabel("fraction of rounds")
    ax.set_title("Acceptance per depth\n(fraction of rounds that accepted a path at least this deep)", fontsize=10.5)
    ax.legend(fontsize=8.5, title="shape: acceptance length", title_fontsize=8.5)
    ax.grid(alpha=0.3)

    # 4. the cost of one round per shape
    ax = fig.add_subplot(grid[1, 1] if has_cold else grid[1, 1:])
    verify = [e.get("round_ms", {}).get("verify_ms") or 0 for e in d]
    draft = [e.get("round_ms", {}).get("draft_ms_per_round") or 0 for e in d]
    ax.bar(x, verify, 0.6, color=colors, label="target_verify (one pass)")
    ax.bar(x, draft, 0.6, bottom=verify, color=colors, alpha=0.45, hatch="//", label="draft graphs per round")
    for i in x:
        ax.text(i, verify[i] + draft[i], f"{verify[i]:.1f} + {draft[i]:.1f}", ha="center", va="bottom", fontsize=8.5)
    plain_ms = [e["round_ms"]["plain_decode_ms"] for e in d if e.get("round_ms", {}).get("plain_decode_ms")]
    if plain_ms:
        ax.axhline(statistics.median(plain_ms), color="#555", ls="--", lw=1.2,
                   label=f"one plain decode pass: {statistics.median(plain_ms):.1f} ms")
    ax.set_xticks(x, names, fontsize=8.5, rotation=20)
    ax.set_ylim(0, max([a + b for a, b in zip(verify, draft)] + plain_ms + [1]) * 1.4)
    ax.set_ylabel("ms per speculative round (mean)")
    ax.set_title("Cost of a round: verify ms + draft ms", fontsize=10.5)
    ax.legend(fontsize=8.5, loc="upper left")
    ax.grid(axis="y", alpha=0.3)

    # 5. cold start
    if has_cold:
        ax = fig.add_subplot(grid[1, 2])
        c = res["cold_start"]
        labels, vals, cols = ["prebuilt bundle\n→ first token"], [c["prebuilt"]["median_s"]], ["#2a7ab0"]
        if "compile_then_load" in c:
            labels.append("compile (empty cache)\n→ load → first token")
            vals.append(c["compile_then_load"]["median_s"])
            cols.append(hf_c)
        ax.bar(labels, vals, color=cols, width=0.6)
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.1f}s" if v >= 10 else f"{v:.2f}s", ha="center", va="bottom", fontsize=10)
        ax.set_yscale("log")
        ax.set_ylim(min(vals) / 2, max(vals) * 3)
        ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}s"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_ylabel("seconds, fresh process (log scale)")
        ttl = f"Cold start, {c.get('shape')} bundle"
        if "compile_then_load" in c:
            ttl += (f":\nprebuilt {s['cold_start_vs_compile']:.0f}x faster "
                    f"{_mark(s['cold_start_vs_compile'], 'cold_start_vs_compile')}")
        ax.set_title(ttl, fontsize=10.5)
        ax.grid(axis="y", alpha=0.3, which="both")
        ax.tick_params(axis="x", labelsize=9)

    b = res["bundle"]
    fig.suptitle(f"EAGLE3 speculation shapes on {b['name']} — {b['backend']} backend, {b['dtype']}, "
                 f"{res['prompts']['count']} chat prompts × ≤{res['prompts']['max_tokens']} tokens, {_threads(res)} — "
                 f"{res['machine']['cpu']}", fontsize=11)
    notes = res.get("notes", [])
    if notes:
        fig.text(0.01, 0.005, "\n".join(f"Note: {n}" for n in notes), fontsize=8.5, va="bottom", ha="left",
                 wrap=True, color="#8a1c1c")
    fig.tight_layout(rect=(0, 0.025 * (1 + sum(len(n) // 200 for n in notes)) * bool(notes), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------------ main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", nargs="?", type=Path, default=DEFAULT_RECIPE)
    ap.add_argument("--pair", default=None, help="pair name (recipes with several pairs)")
    ap.add_argument("--shapes", default=None,
                    help=f"comma-separated speculation shapes, one bundle each (default {DEFAULT_SHAPES}): chain:K, "
                         "tree:DxKxN (depth x topk x num_draft_tokens, the root included), static:JSON (a list of "
                         "choice paths, e.g. 'static:[[0],[1],[0,0]]') or static:FILE (that JSON in a file)")
    ap.add_argument("--k", default=None, help="shorthand for chain shapes: --k 1,2,3 = --shapes chain:1,chain:2,chain:3")
    ap.add_argument("--backend", default="aoti", choices=["aoti", "export"])
    ap.add_argument("--out", type=Path, default=REPO / "artifacts" / "spec-report", help="bundles and scratch")
    ap.add_argument("--cache-dir", type=Path, default=None, help="compile cache (default $EAGLE3_BUILD_CACHE)")
    ap.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: the builder's)")
    ap.add_argument("--phases", default="decode,transformers,cold,compile",
                    help="what to measure (comma-separated): decode (runtime spec vs plain per shape), transformers, "
                         "cold (prebuilt bundle -> first token), compile (compile-then-load)")
    ap.add_argument("--min-buckets", action="store_true",
                    help="decode bundles hold only the graphs the benchmark runs (batch 1; the first shape's every "
                         "prefill bucket, the others' the smallest one that fits the prompts): the same graphs (same "
                         "cache keys) as full bundles', fewer to compile. The cold-start bundle keeps every bucket")
    ap.add_argument("--prefill-buckets", default=None,
                    help="comma-separated prefill buckets replacing the recipe's in every bundle built here, the "
                         "cold-start and compile-then-load ones included (e.g. 128: chat prompts fit it; fewer "
                         "graphs to compile)")
    ap.add_argument("--prompts", default="heldout", help="heldout | builtin | a prompt file")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="timed passes over the prompts (median per prompt)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads for every contender")
    ap.add_argument("--no-chat", action="store_true", help="raw prompts instead of the chat template")
    ap.add_argument("--hf-dtypes", default="auto",
                    help="transformers eager dtypes, comma-separated; auto = the bundle's and float32")
    ap.add_argument("--cold-shape", default="best",
                    help="shape of the cold-start / compile-then-load bundle: best (default: the fastest decoded "
                         "shape; the recipe's speculation when no decode runs), recipe, or a --shapes item")
    ap.add_argument("--cold-k", type=int, default=None, help="shorthand for --cold-shape chain:K")
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
    phases = {x.strip() for x in args.phases.split(",") if x.strip()}
    unknown = phases - {"decode", "transformers", "cold", "compile"}
    if unknown:
        ap.error(f"--phases: unknown {sorted(unknown)}")

    if args.from_result is not None:
        res = upgrade_result(json.loads(args.from_result.read_text()))
        res["notes"] = res.get("notes", []) + args.note
        return _write(res, args)

    if args.k is not None and args.shapes is not None:
        ap.error("--k is a shorthand for chain --shapes: give one of them")
    if args.cold_k is not None:
        args.cold_shape = f"chain:{args.cold_k}"
    try:
        shapes = parse_shapes(args.shapes if args.shapes is not None else
                              ",".join(f"chain:{k.strip()}" for k in args.k.split(",") if k.strip())
                              if args.k is not None else DEFAULT_SHAPES)
        fixed_cold = None if args.cold_shape in ("best", "recipe") else parse_shape(args.cold_shape)
        if args.prefill_buckets and not all(x.strip().isdigit() and int(x) > 0 for x in args.prefill_buckets.split(",")):
            raise ValueError(f"--prefill-buckets {args.prefill_buckets!r}: give positive integers, e.g. 128 or 128,512")
    except ValueError as e:
        ap.error(str(e))

    import torch

    torch.set_num_threads(args.threads)
    if args.cold_child:
        return cold_child(args)

    t_start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    res: dict = {"machine": machine(args.threads), "recipe": str(args.recipe), "shapes": [shape_name(s) for s in shapes],
                 "phases": sorted(phases),
                 "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else None,
                 "notes": list(args.note)}
    p = load_pair(args.recipe, args.pair, None, args.backend)
    full_buckets = bundle_buckets(p, args.prefill_buckets)
    res["bundle"] = {"name": p.name, "backend": args.backend, "dtype": p.dtype, "target": p.target.uri,
                     "draft": p.draft.uri, "recipe_k": p.speculation.num_speculative_tokens,
                     "recipe_shapes": {str(b): s.describe() for b, s in p.speculation.shapes.items()},
                     "prefill_buckets": full_buckets["prefill"], "recipe_prefill_buckets": p.buckets.prefill,
                     "batch_buckets": p.buckets.batch,
                     "max_model_len": p.serving.max_model_len, "max_num_seqs": p.serving.max_num_seqs}
    texts = prompt_texts(args.prompts, args.num_prompts)
    chat = not args.no_chat
    res["prompts"] = {"source": args.prompts, "count": len(texts), "max_tokens": args.max_tokens,
                      "repeats": args.repeats, "texts": texts}
    summary: dict = {}
    builds: dict[str, dict] = {}
    res["builds"] = builds

    def build(shape, buckets: dict | None = None) -> Path:
        """The bundle of `shape` (None: the recipe's speculation), full buckets unless `buckets` (cached per run)."""
        buckets = buckets or full_buckets
        tag = ("recipe" if shape is None else shape_name(shape)) + ("-min" if buckets != full_buckets else "")
        if tag not in builds:
            log(f"building {tag} ({args.backend}) -> {args.out / tag}")
            b = builds[tag] = build_pair(load_pair(args.recipe, args.pair, shape, args.backend, buckets),
                                         args.out / tag, args.cache_dir, args.jobs)
            log(f"  {tag}: {b['compiled']} compiled, {b['cached']} cached, {b['wall_s']:.1f}s")
        return args.out / tag

    def decode_buckets(i: int, shape) -> dict | None:
        if not args.min_buckets or shape == fixed_cold:
            return None
        return {"prefill": full_buckets["prefill"] if i == 0 else [fit], "batch": [1]}

    # a bundle whose tokenizer encodes the prompts (and whose manifest names the EOS tokens)
    ref, prompts, fit = None, [], None
    if phases & {"decode", "transformers", "cold"}:
        ref = build(shapes[0], decode_buckets(0, shapes[0])) if "decode" in phases else build(fixed_cold)
        prompts, chat = encode_prompts(ref, texts, chat)
        res["prompts"].update({"chat_template": chat, "prompt_tokens": [len(x) for x in prompts]})
        longest = max(len(x) for x in prompts)
        fit = next((b for b in full_buckets["prefill"] if b >= longest), None)
        if fit is None:
            sys.exit(f"the longest prompt has {longest} tokens, the largest prefill bucket is "
                     f"{full_buckets['prefill'][-1]}: give --prefill-buckets that fit it (or fewer --num-prompts)")

    # decode through the runtime, per shape
    runtime_tokens = None
    if "decode" in phases:
        decode = res["decode"] = []
        for i, shape in enumerate(shapes):
            bdir = build(shape, decode_buckets(i, shape))
            log(f"decoding {shape_name(shape)} ({shape.describe()}): {len(prompts)} prompts x {args.max_tokens} "
                "tokens, speculative and plain")
            m = measure_runtime(bdir, prompts, args.max_tokens, args.repeats)
            tokens = m.pop("_tokens")
            runtime_tokens = runtime_tokens or tokens
            entry = {"name": shape_name(shape), "bundle": str(bdir), **m}
            decode.append(entry)
            log(f"  {entry['name']}: spec {m['spec']['decode_tok_s']:.1f} tok/s, plain {m['plain']['decode_tok_s']:.1f}"
                f" tok/s, {m['speedup_decode']:.2f}x, acceptance length {m['acceptance']['mean_acceptance_length']:.2f},"
                f" verify {m['round_ms']['verify_ms']} ms + draft {m['round_ms']['draft_ms_per_round']} ms per round")
        summary.update(shape_summary(decode))

    # transformers eager
    if "transformers" in phases:
        from eagle3_runtime.reader import read_manifest

        dtypes = ([p.dtype] + (["float32"] if p.dtype != "float32" else [])) if args.hf_dtypes == "auto" \
            else [x.strip() for x in args.hf_dtypes.split(",") if x.strip()]
        if p.target.kind != "local" or not p.target.path:
            log(f"transformers baseline skipped: target {p.target.uri} is not a local HF directory")
        else:
            hf = res["transformers"] = {}
            eos = list(read_manifest(ref).eos_token_ids)
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
                best = best_entry({"decode": res["decode"], "summary": summary})
                summary["runtime_vs_transformers"] = round(best["spec"]["decode_tok_s"] / fastest["decode_tok_s"], 3)
                summary["runtime_vs_transformers_e2e"] = round(best["spec"]["e2e_tok_s"] / fastest["e2e_tok_s"], 3)
                if p.dtype in hf:
                    summary["runtime_vs_transformers_same_dtype"] = round(
                        best["spec"]["decode_tok_s"] / hf[p.dtype]["decode_tok_s"], 3)

    # cold start, on the full-bucket bundle of the cold shape (None: the recipe's speculation)
    cold_shape = fixed_cold
    if args.cold_shape == "best" and "decode" in phases:
        cold_shape = shapes[[shape_name(s) for s in shapes].index(summary["best_shape"])]
    cold_name = "recipe" if cold_shape is None else shape_name(cold_shape)
    cold: dict = {"shape": cold_name, "describe": ("the recipe's speculation" if cold_shape is None
                                                   else cold_shape.describe()), "prompt": texts[0]}
    if "cold" in phases:
        bundle = build(cold_shape)
        log(f"cold start, {cold_name}: {args.cold_runs} fresh eagle3-run processes on the prebuilt bundle")
        cold["prebuilt"] = cold_prebuilt(bundle, texts[0], chat, args.cold_runs, args.threads)
        log(f"  prebuilt: median {cold['prebuilt']['median_s']:.2f}s")
    if args.compile_result is not None:
        prev = json.loads(args.compile_result.read_text())
        ctl = prev.get("cold_start", {}).get("compile_then_load") or prev.get("compile_then_load")
        if not ctl:
            sys.exit(f"--compile-result {args.compile_result}: no compile_then_load measurement in it")
        measured = ctl.get("shape") or (f"chain-k{ctl['k']}" if "k" in ctl else None)
        if measured not in (None, cold_name):
            log(f"note: the reused compile-then-load measurement was taken on the {measured} bundle, cold start "
                f"on {cold_name}")
        cold["compile_then_load"] = {**ctl, "shape": measured, "reused_from": str(args.compile_result)}
    elif "compile" in phases:
        log(f"cold start, {cold_name}: compile with an empty cache, then load -> first token "
            f"({args.compile_runs} run(s), each a full compile of every graph)")
        cold["compile_then_load"] = cold_compile(args.recipe, args.pair, cold_shape, args.backend, texts[0], chat,
                                                 args.jobs, args.out, args.compile_runs, args.threads, args.compile_cache,
                                                 args.prefill_buckets)
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
    if args.plot and res.get("decode"):
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(res, args.plot)
        log(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
