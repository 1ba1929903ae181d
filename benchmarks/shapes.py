"""Speculation shapes side by side on one recipe pair (the demo pair by default): a bundle per shape through
the compile cache, decoded speculative and plain through the runtime, transformers eager on the same prompts,
and cold start (a prebuilt bundle to its first token, fresh processes) against compile-then-load.

Shapes: chain:K | tree:DxKxN (D draft steps, topk K, N nodes verified per pass with the root) | static:JSON-or-FILE
(TensorRT-LLM eagle_choices). Bundle directories are named by the shape: chain-k3, tree-4x4x16, static-<hash>
(-min: --min-buckets, only the graphs the decode runs). Goals: speculation vs none >= 1.6x at the best shape,
runtime vs transformers eager >= 3x, cold start vs compile-then-load >= 20x."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .decode import measure_runtime, measure_transformers, round_profile, shape_record

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RECIPE = REPO / "recipes" / "smollm2-135m-eagle3.yaml"
DEFAULT_SHAPES = "chain:3,tree:4x4x16"
PHASES = ("decode", "transformers", "cold", "compile")
GOALS = {"spec_vs_plain": 1.6, "runtime_vs_transformers": 3.0, "cold_start_vs_compile": 20.0}
CHILD_TAG = "SHAPES_COLD_CHILD "


def log(msg: str) -> None:
    print(f"[shapes {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -------------------------------------------------------------------------------------------------- shapes

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
    from eagle3_runtime.speculation import SpecShape, chain, dynamic_tree, static_tree

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


# ---------------------------------------------------------------------------------------------- recipe / build

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
    return {"bundle": str(out), "wall_s": round(time.perf_counter() - t0, 2), "graphs": len(m.graphs),
            "compiled": m.build["compiled"], "cached": m.build["cached"], "digest": m.digest}


# ---------------------------------------------------------------------------------------------- cold start

def _run_cli_cmd(bundle: Path, prompt: str, chat: bool, threads: int) -> list[str]:
    return ["-m", "eagle3_runtime.cli", str(bundle), "--prompt", prompt, "--max-tokens", "1", "--threads", str(threads),
            "--json"] + (["--chat"] if chat else [])


def cold_prebuilt(bundle: Path, prompt: str, chat: bool, runs: int, threads: int) -> dict:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, *_run_cli_cmd(bundle, prompt, chat, threads)], capture_output=True,
                           text=True, cwd=REPO, check=False)
        times.append(time.perf_counter() - t0)
        if r.returncode != 0:
            sys.exit(f"eagle3-run failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return {"command": f"python {' '.join(_run_cli_cmd(bundle, prompt, chat, threads))}",
            "runs_s": [round(t, 3) for t in times], "median_s": round(statistics.median(times), 3)}


def cold_compile(a, shape, prompt: str, chat: bool) -> dict:
    """Fresh processes: build the bundle of `shape` (None: the recipe's speculation) with an empty compile cache,
    then load it and produce one token. a.compile_cache: that (new or empty) directory as the cache, kept."""
    keep, runs = a.compile_cache, a.compile_runs
    if keep is not None:
        if keep.exists() and any(keep.iterdir()):
            sys.exit(f"--compile-cache {keep}: not empty; the compile-then-load run needs an empty cache")
        runs = 1
    arg = "recipe" if shape is None else shape_arg(shape)
    child_args = [str(a.recipe), "--cold-shape", arg, "--backend", a.backend, "--prompt", prompt,
                  "--threads", str(a.threads)] + (["--pair", a.pair] if a.pair else []) \
        + ([] if chat else ["--no-chat"]) + (["--jobs", str(a.jobs)] if a.jobs else []) \
        + (["--prefill-buckets", a.prefill_buckets] if a.prefill_buckets else [])
    results = []
    for i in range(runs):
        tmp = Path(tempfile.mkdtemp(prefix="cold-compile-", dir=a.out))
        try:
            env = dict(os.environ, EAGLE3_BUILD_CACHE=str(keep or tmp / "cache"))
            cmd = [sys.executable, "-m", "benchmarks", "shapes-cold-child", str(tmp / "bundle"), *child_args]
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
            "command": "EAGLE3_BUILD_CACHE=<new empty dir> python -m benchmarks shapes-cold-child OUT "
                       + " ".join(child_args) + " (build_bundle, then eagle3_runtime.cli OUT --max-tokens 1)"}


def cold_child(out: Path, recipe: Path, pair: str | None, cold_shape: str, backend: str, prompt: str, chat: bool,
               threads: int, jobs: int | None, prefill_buckets: str | None) -> int:
    """Build (compile cache from the environment), then run the runtime CLI in this process."""
    t0 = time.perf_counter()
    shape = None if cold_shape in ("recipe", "best") else parse_shape(cold_shape)
    p = load_pair(recipe, pair, None, backend)
    p = load_pair(recipe, pair, shape, backend, bundle_buckets(p, prefill_buckets))
    b = build_pair(p, out, None, jobs)
    t1 = time.perf_counter()
    from eagle3_runtime.cli import main as run_main

    rc = run_main(_run_cli_cmd(out, prompt, chat, threads)[2:])
    print(CHILD_TAG + json.dumps({"build_s": round(t1 - t0, 2), "load_first_token_s": round(time.perf_counter() - t1, 3),
                                  "compiled": b["compiled"], "cached": b["cached"], "rc": rc}), flush=True)
    return rc


# ----------------------------------------------------------------------------------------------------- run

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


def upgrade_result(res: dict) -> dict:
    """A report of the former K sweep (decode: {"K": entry}) in this layout (decode: [entry])."""
    d = res.get("decode")
    if not isinstance(d, dict):
        return res
    from eagle3_runtime.speculation import chain

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


def run(a, shapes: list, fixed_cold, texts: list[str]) -> dict:
    """Every phase of a.phases; `a` holds the subcommand's options."""
    phases = a.phases
    a.out.mkdir(parents=True, exist_ok=True)
    res: dict = {"benchmark": "shapes", "recipe": str(a.recipe), "shapes": [shape_name(s) for s in shapes],
                 "phases": sorted(phases), "notes": list(a.note)}
    p = load_pair(a.recipe, a.pair, None, a.backend)
    full_buckets = bundle_buckets(p, a.prefill_buckets)
    res["bundle"] = {"name": p.name, "backend": a.backend, "dtype": p.dtype, "target": p.target.uri,
                     "draft": p.draft.uri, "recipe_k": p.speculation.num_speculative_tokens,
                     "recipe_shapes": {str(b): s.describe() for b, s in p.speculation.shapes.items()},
                     "prefill_buckets": full_buckets["prefill"], "recipe_prefill_buckets": p.buckets.prefill,
                     "batch_buckets": p.buckets.batch,
                     "max_model_len": p.serving.max_model_len, "max_num_seqs": p.serving.max_num_seqs}
    chat = a.chat
    res["prompts"] = {"source": a.prompts, "count": len(texts), "max_tokens": a.max_tokens, "repeats": a.repeats,
                      "texts": texts}
    summary: dict = {}
    builds: dict[str, dict] = {}
    res["builds"] = builds

    def build(shape, buckets: dict | None = None) -> Path:
        """The bundle of `shape` (None: the recipe's speculation), full buckets unless `buckets` (once per run)."""
        buckets = buckets or full_buckets
        tag = ("recipe" if shape is None else shape_name(shape)) + ("-min" if buckets != full_buckets else "")
        if tag not in builds:
            log(f"building {tag} ({a.backend}) -> {a.out / tag}")
            b = builds[tag] = build_pair(load_pair(a.recipe, a.pair, shape, a.backend, buckets), a.out / tag,
                                         a.cache_dir, a.jobs)
            log(f"  {tag}: {b['compiled']} compiled, {b['cached']} cached, {b['wall_s']:.1f}s")
        return a.out / tag

    def decode_buckets(i: int, shape) -> dict | None:
        if not a.min_buckets or shape == fixed_cold:
            return None
        return {"prefill": full_buckets["prefill"] if i == 0 else [fit], "batch": [1]}

    from .prompts import encode

    ref, prompts, fit = None, [], None  # a bundle whose tokenizer encodes the prompts, whose manifest names EOS
    if phases & {"decode", "transformers", "cold"}:
        ref = build(shapes[0], decode_buckets(0, shapes[0])) if "decode" in phases else build(fixed_cold)
        prompts, chat = encode(ref, texts, chat)
        res["prompts"].update({"chat_template": chat, "prompt_tokens": [len(x) for x in prompts]})
        longest = max(len(x) for x in prompts)
        fit = next((b for b in full_buckets["prefill"] if b >= longest), None)
        if fit is None:
            sys.exit(f"the longest prompt has {longest} tokens, the largest prefill bucket is "
                     f"{full_buckets['prefill'][-1]}: give --prefill-buckets that fit it (or fewer --num-prompts)")

    runtime_tokens = None
    if "decode" in phases:
        decode = res["decode"] = []
        for i, shape in enumerate(shapes):
            bdir = build(shape, decode_buckets(i, shape))
            log(f"decoding {shape_name(shape)} ({shape.describe()}): {len(prompts)} prompts x {a.max_tokens} "
                "tokens, speculative and plain")
            m = measure_runtime(bdir, prompts, a.max_tokens, a.repeats)
            tokens = m.pop("_tokens")
            runtime_tokens = runtime_tokens or tokens
            entry = {"name": shape_name(shape), "bundle": str(bdir), **m}
            decode.append(entry)
            log(f"  {entry['name']}: spec {m['spec']['decode_tok_s']:.1f} tok/s, plain {m['plain']['decode_tok_s']:.1f}"
                f" tok/s, {m['speedup_decode']:.2f}x, acceptance length {m['acceptance']['mean_acceptance_length']:.2f},"
                f" verify {m['round_ms']['verify_ms']} ms + draft {m['round_ms']['draft_ms_per_round']} ms per round")
        summary.update(shape_summary(decode))

    if "transformers" in phases:
        from eagle3_runtime.reader import read_manifest

        dtypes = ([p.dtype] + (["float32"] if p.dtype != "float32" else [])) if a.hf_dtypes == "auto" \
            else [x.strip() for x in a.hf_dtypes.split(",") if x.strip()]
        if p.target.kind != "local" or not p.target.path:
            log(f"transformers baseline skipped: target {p.target.uri} is not a local HF directory")
        else:
            hf = res["transformers"] = {}
            eos = list(read_manifest(ref).eos_token_ids)
            for dt in dtypes:
                log(f"transformers eager generate(), {dt}")
                t, toks = measure_transformers(Path(p.target.path), dt, prompts, a.max_tokens, eos, a.repeats)
                if runtime_tokens is not None:
                    t["same_as_runtime"] = f"{sum(x == y for x, y in zip(toks, runtime_tokens))}/{len(prompts)}"
                hf[dt] = t
                log(f"  {dt}: {t['decode_tok_s']:.1f} tok/s")
            fastest = max(hf.values(), key=lambda t: t["decode_tok_s"])
            summary.update({"transformers_fastest_dtype": fastest["dtype"],
                            "transformers_decode_tok_s": fastest["decode_tok_s"]})
            if "decode" in phases:
                best = next(e for e in res["decode"] if e["name"] == summary["best_shape"])
                summary["runtime_vs_transformers"] = round(best["spec"]["decode_tok_s"] / fastest["decode_tok_s"], 3)
                summary["runtime_vs_transformers_e2e"] = round(best["spec"]["e2e_tok_s"] / fastest["e2e_tok_s"], 3)
                if p.dtype in hf:
                    summary["runtime_vs_transformers_same_dtype"] = round(
                        best["spec"]["decode_tok_s"] / hf[p.dtype]["decode_tok_s"], 3)

    cold_shape = fixed_cold  # cold start on the full-bucket bundle of the cold shape (None: the recipe's)
    if a.cold_shape == "best" and "decode" in phases:
        cold_shape = shapes[[shape_name(s) for s in shapes].index(summary["best_shape"])]
    cold_name = "recipe" if cold_shape is None else shape_name(cold_shape)
    cold: dict = {"shape": cold_name, "describe": ("the recipe's speculation" if cold_shape is None
                                                   else cold_shape.describe()), "prompt": texts[0]}
    if "cold" in phases:
        bundle = build(cold_shape)
        log(f"cold start, {cold_name}: {a.cold_runs} fresh eagle3-run processes on the prebuilt bundle")
        cold["prebuilt"] = cold_prebuilt(bundle, texts[0], chat, a.cold_runs, a.threads)
        log(f"  prebuilt: median {cold['prebuilt']['median_s']:.2f}s")
    if a.compile_result is not None:
        prev = json.loads(a.compile_result.read_text())
        ctl = prev.get("cold_start", {}).get("compile_then_load") or prev.get("compile_then_load")
        if not ctl:
            sys.exit(f"--compile-result {a.compile_result}: no compile_then_load measurement in it")
        measured = ctl.get("shape") or (f"chain-k{ctl['k']}" if "k" in ctl else None)
        if measured not in (None, cold_name):
            log(f"note: the reused compile-then-load measurement was taken on the {measured} bundle, cold start "
                f"on {cold_name}")
        cold["compile_then_load"] = {**ctl, "shape": measured, "reused_from": str(a.compile_result)}
    elif "compile" in phases:
        log(f"cold start, {cold_name}: compile with an empty cache, then load -> first token "
            f"({a.compile_runs} run(s), each a full compile of every graph)")
        cold["compile_then_load"] = cold_compile(a, cold_shape, texts[0], chat)
    if "prebuilt" in cold or "compile_then_load" in cold:
        res["cold_start"] = cold
    if "prebuilt" in cold and "compile_then_load" in cold:
        summary["cold_start_vs_compile"] = round(cold["compile_then_load"]["median_s"] / cold["prebuilt"]["median_s"], 2)

    summary["goals"] = {k: {"goal": g, "value": summary.get(k), "met": summary.get(k) is not None and summary[k] >= g}
                        for k, g in GOALS.items()}
    res["summary"] = summary
    return res
