"""python -m benchmarks <subcommand>: every measurement the project makes, one subcommand each.

  demo          a bundle's decode speed, speculative and plain, next to transformers eager (`make demo`)
  shapes        speculation shapes side by side on a recipe pair (+ transformers, cold start, compile-then-load)
  engine        two bundles decoding in one process, interleaved
  prefill       time to first token: the engine's prefill plan against padding
  graph         each graph's latency, bundles side by side; --profile RECIPE: kernel by kernel
  gemm          the GEMM formats the aoti backend chooses among, per token row count
  gemm-blocking the blocked format's micro-kernel variants
  serve         a load client for eagle3-serve (vllm bench serve style)
  vs-vllm       eagle3-serve against vLLM-CPU's EAGLE3, and served against in-process
  seeded-repro  seeded sampled requests alone and two at a time: same tokens?
  build         build time and decode speed of the aoti backend on a tiny pair
  shard         the streaming sharder against load-everything-then-slice
  results       docs/results.md, docs/speed.png and the README's speed table from benchmarks/results/*.json

Threads default to $EAGLE3_NUM_THREADS, else the cores this process may use. Results: --save-result PATH and / or
--record NAME (benchmarks/results/NAME.<host-kind>.json, the one current result of NAME on this kind of host).
"""
from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import typer

from . import host as hosts
from . import results
from .prompts import HELP as PROMPTS_HELP

REPO = Path(__file__).resolve().parents[1]
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="The benchmark harness: every measurement side by side in one run, JSON with the host named.")


def _threads():
    return typer.Option(None, "--threads", min=1, help="torch CPU threads (default: $EAGLE3_NUM_THREADS, else the "
                                                      "cores this process may use)")


def _save():
    return typer.Option(None, "--save-result", help="write the JSON result here")


def _record():
    return typer.Option(None, "--record", metavar="NAME",
                        help="write the JSON result to benchmarks/results/NAME.<host-kind>.json")


def _start(threads: int | None) -> dict:
    """Pages and threads set as eagle3-serve sets them, the host described (before anything is measured). (With
    4 KB pages the bundle loaded first into a process also ran slower than the one loaded after it: the engine
    A/B's bias, benchmarks/results/smollm2-engine-ab-same-bundle-{4k-pages,thp}.intel-xeon-avx512.json.)"""
    from eagle3_runtime.launch import use_huge_pages

    use_huge_pages()
    return hosts.describe(hosts.threads(threads))


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _ints(option: str, text: str) -> list[int]:
    if not all(x.isdigit() and int(x) > 0 for x in _csv(text)) or not _csv(text):
        raise typer.BadParameter(f"{text!r}: give positive whole numbers, comma-separated (e.g. 1,4,8)",
                                 param_hint=option)
    return [int(x) for x in _csv(text)]


# ------------------------------------------------------------------------------------------ in-process decode

@app.command()
def demo(bundle: Path = typer.Argument(..., help="bundle directory"),
         threads: Optional[int] = _threads(),
         prompts: str = typer.Option("heldout", help=PROMPTS_HELP),
         num_prompts: int = typer.Option(3, min=1),
         max_tokens: int = typer.Option(128, min=1),
         repeats: int = typer.Option(1, min=1),
         speculation: str = typer.Option("auto", help="the speculative runs' --speculation (auto: as eagle3-run)"),
         target: Optional[Path] = typer.Option(None, help="transformers checkpoint (default: the bundle's target)"),
         save_result: Optional[Path] = _save(), record: Optional[str] = _record()):
    """A bundle's decode tok/s speculative and plain, and transformers eager float32 on its target.

    One run; a bundle with batch buckets beyond 1 also decodes its prompts together (as many as its largest)."""
    from .decode import demo as run

    host = _start(threads)
    res = run(bundle, host, prompts, num_prompts, max_tokens, repeats, speculation, target)
    results.save(results.finish(res, host), save_result, record)


@app.command()
def engine(bundles: List[Path] = typer.Argument(..., help="BUNDLE_A BUNDLE_B"),
           threads: Optional[int] = _threads(),
           prompts: str = typer.Option("heldout", help=PROMPTS_HELP),
           num_prompts: int = typer.Option(3, min=1),
           max_tokens: int = typer.Option(128, min=1),
           repeats: int = typer.Option(2, min=1),
           chat: bool = typer.Option(True, "--chat/--no-chat", help="prompts in the chat template, or raw text"),
           save_result: Optional[Path] = _save(), record: Optional[str] = _record()):
    """Two bundles in one process, the same prompts speculative and plain, A and B alternating per generation.

    Decode tok/s, B over A, each graph's median ms per call in the loop, and whether both gave the same tokens."""
    from eagle3_runtime.bundle import BundleError

    from .decode import engine_ab

    if len(bundles) != 2:
        raise typer.BadParameter("give two bundles", param_hint="BUNDLES")
    host = _start(threads)
    try:
        res = engine_ab(bundles, host, prompts, num_prompts, max_tokens, repeats, chat)
    except BundleError as e:
        raise typer.BadParameter(str(e), param_hint="BUNDLES") from None
    results.emit(results.finish(res, host), save_result, record)


@app.command()
def prefill(bundle: Path = typer.Argument(...),
            threads: Optional[int] = _threads(),
            prompts: str = typer.Option("mtbench", help=PROMPTS_HELP),
            num_prompts: int = typer.Option(40, min=1),
            repeats: int = typer.Option(2, min=1),
            chat: bool = typer.Option(True, "--chat/--no-chat"),
            save_result: Optional[Path] = _save(), record: Optional[str] = _record()):
    """Time to first token with the engine's prefill plan against padding each prompt to a bucket, in turn."""
    from .decode import prefill_plan

    host = _start(threads)
    results.emit(results.finish(prefill_plan(bundle, host, prompts, num_prompts, repeats, chat), host),
                 save_result, record)


@app.command()
def shapes(recipe: Path = typer.Argument(REPO / "recipes" / "smollm2-135m-eagle3.yaml", help="recipe YAML"),
           pair: Optional[str] = typer.Option(None, help="pair name (recipes with several pairs)"),
           shapes: Optional[str] = typer.Option(None, help="comma-separated shapes, one bundle each (default "
                                                "chain:3,tree:4x4x16): chain:K, tree:DxKxN, static:JSON or static:FILE"),
           k: Optional[str] = typer.Option(None, "--k", help="chain shapes: --k 1,2,3 = --shapes chain:1,chain:2,chain:3"),
           backend: str = typer.Option("aoti", help="aoti | export"),
           out: Path = typer.Option(REPO / "artifacts" / "spec-report", help="bundles and scratch"),
           cache_dir: Optional[Path] = typer.Option(None, help="compile cache (default $EAGLE3_BUILD_CACHE)"),
           jobs: Optional[int] = typer.Option(None, min=1, help="parallel compile jobs (default: the builder's)"),
           phases: str = typer.Option("decode,transformers,cold,compile", help="decode (runtime speculative vs "
                                      "plain per shape), transformers, cold (prebuilt bundle -> first token), compile "
                                      "(compile-then-load)"),
           min_buckets: bool = typer.Option(False, help="decode bundles hold only the graphs the decode runs (batch 1;"
                                            " the first shape's every prefill bucket, the others' one that fits)"),
           prefill_buckets: Optional[str] = typer.Option(None, help="prefill buckets replacing the recipe's in every "
                                                         "bundle built here (e.g. 128)"),
           prompts: str = typer.Option("heldout", help=PROMPTS_HELP),
           num_prompts: int = typer.Option(8, min=1),
           max_tokens: int = typer.Option(128, min=1),
           repeats: int = typer.Option(1, min=1, help="timed passes over the prompts (median per prompt)"),
           threads: Optional[int] = _threads(),
           chat: bool = typer.Option(True, "--chat/--no-chat"),
           hf_dtypes: str = typer.Option("auto", help="transformers eager dtypes; auto = the bundle's and float32"),
           cold_shape: str = typer.Option("best", help="shape of the cold-start / compile-then-load bundle: best "
                                          "(the fastest decoded), recipe, or a --shapes item"),
           cold_k: Optional[int] = typer.Option(None, min=1, help="--cold-shape chain:K"),
           cold_runs: int = typer.Option(3, min=1, help="fresh-process runs on the prebuilt bundle (median)"),
           compile_runs: int = typer.Option(1, min=1, help="compile-then-load runs (a full compile each)"),
           compile_cache: Optional[Path] = typer.Option(None, help="the compile-then-load run's empty cache, kept "
                                                        "(pass it as --cache-dir later)"),
           compile_result: Optional[Path] = typer.Option(None, help="reuse an earlier report's compile-then-load "
                                                         "measurement instead of compiling again"),
           note: Optional[List[str]] = typer.Option(None, help="a note recorded in the JSON and under the plot"),
           from_result: Optional[Path] = typer.Option(None, help="measure nothing: re-render a saved report"),
           plot: Optional[Path] = typer.Option(None, help="write the PNG figure here (needs matplotlib)"),
           save_result: Optional[Path] = _save(), record: Optional[str] = _record()):
    """Speculation shapes side by side on a recipe pair, with transformers eager and cold start.

    One bundle per shape decoded speculative and plain through the runtime, transformers eager on the same
    prompts, cold start against compile-then-load. Goals: speculation >= 1.6x none, runtime >= 3x transformers
    eager, cold start >= 20x faster than compile-then-load."""
    from . import shapes as sh
    from .prompts import texts
    from .report import plot as draw
    from .report import render_table

    if from_result is not None:
        res = sh.upgrade_result(json.loads(from_result.read_text()))
        res["notes"] = res.get("notes", []) + list(note or [])
    else:
        phase_set = set(_csv(phases))
        if phase_set - set(sh.PHASES):
            raise typer.BadParameter(f"unknown {sorted(phase_set - set(sh.PHASES))}", param_hint="--phases")
        if k is not None and shapes is not None:
            raise typer.BadParameter("--k is a shorthand for chain --shapes: give one of them", param_hint="--k")
        try:
            shape_list = sh.parse_shapes(shapes if shapes is not None else ",".join(f"chain:{x}" for x in _csv(k))
                                         if k is not None else sh.DEFAULT_SHAPES)
            cold = f"chain:{cold_k}" if cold_k is not None else cold_shape
            fixed_cold = None if cold in ("best", "recipe") else sh.parse_shape(cold)
            if prefill_buckets:
                _ints("--prefill-buckets", prefill_buckets)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
        host = _start(threads)
        a = argparse.Namespace(recipe=recipe, pair=pair, backend=backend, out=out, cache_dir=cache_dir, jobs=jobs,
                               phases=phase_set, min_buckets=min_buckets, prefill_buckets=prefill_buckets,
                               prompts=prompts, max_tokens=max_tokens, repeats=repeats, threads=host["threads"],
                               chat=chat, hf_dtypes=hf_dtypes, cold_shape=cold, cold_runs=cold_runs,
                               compile_runs=compile_runs, compile_cache=compile_cache, compile_result=compile_result,
                               note=list(note or []))
        t0 = time.perf_counter()
        res = sh.run(a, shape_list, fixed_cold, texts(prompts, num_prompts))
        res["wall_s"] = round(time.perf_counter() - t0, 1)
        res = results.finish(res, host)
    results.save(res, save_result, record, indent=2)
    print(render_table(res))
    if plot and res.get("decode"):
        plot.parent.mkdir(parents=True, exist_ok=True)
        draw(res, plot)
        print(f"wrote {plot}", file=sys.stderr)


@app.command("shapes-cold-child", hidden=True)
def shapes_cold_child(out: Path, recipe: Path, pair: Optional[str] = typer.Option(None),
                      cold_shape: str = typer.Option(...), backend: str = typer.Option(...),
                      prompt: str = typer.Option(...), chat: bool = typer.Option(True, "--chat/--no-chat"),
                      threads: int = typer.Option(1), jobs: Optional[int] = typer.Option(None),
                      prefill_buckets: Optional[str] = typer.Option(None)):
    """(shapes' compile-then-load process: build with the cache of the environment, then the first token)"""
    from .shapes import cold_child

    hosts.threads(threads)
    raise typer.Exit(cold_child(out, recipe, pair, cold_shape, backend, prompt, chat, threads, jobs, prefill_buckets))


# ------------------------------------------------------------------------------------------------ graphs, GEMMs

@app.command()
def graph(bundles: List[Path] = typer.Argument(..., help="one or more bundle directories"),
          graphs: Optional[str] = typer.Option(None, help="comma-separated graph names (default: the batch-bucket "
                                               "graphs every bundle has)"),
          position: int = typer.Option(256, min=0, help="the positions the graphs are called at"),
          repeats: int = typer.Option(30, min=1, help="timed calls per graph and bundle (after one warm-up call)"),
          profile: Optional[Path] = typer.Option(None, metavar="RECIPE", help="profile kernel by kernel (aoti): each "
                                                 "--graphs graph of the one bundle compiled again from RECIPE, the "
                                                 "recipe it was built from, with Inductor's kernel profiling"),
          top: int = typer.Option(12, min=1, help="--profile: kernels listed per graph"),
          threads: Optional[int] = _threads(),
          save_result: Optional[Path] = _save(), record: Optional[str] = _record()):
    """Median ms per call of each graph on a bundle's weights and KV cache, bundles side by side (calls interleaved graph by graph and bundle by bundle) and each bundle's ratio to the first.

    Or, with --profile, where one aoti graph's time goes kernel by kernel."""
    from . import graphs as g

    if profile is not None and (len(bundles) != 1 or not graphs):
        raise typer.BadParameter("--profile takes one bundle and --graphs", param_hint="--profile")
    host = _start(threads)
    try:
        res = g.profile(bundles[0], profile, host, graphs, position, repeats, top) if profile else \
            g.latency(bundles, host, graphs, position, repeats)
    except Exception as e:
        from eagle3_runtime.bundle import BundleError

        if isinstance(e, BundleError):
            raise typer.BadParameter(str(e), param_hint="BUNDLES") from None
        raise
    results.emit(results.finish(res, host), save_result, record)


@app.command()
def gemm(config: Optional[Path] = typer.Option(None, help="HF config.json (default: SmolLM2-135M's shapes)"),
         rows: str = typer.Option("1,2,3,4,6,8,12,16", help="token row counts"),
         repeats: int = typer.Option(9, min=1),
         lm_head: bool = typer.Option(True, "--lm-head/--no-lm-head", help="the lm_head too, or only the layers"),
         threads: Optional[int] = _threads(),
         save_result: Optional[Path] = _save(), record: Optional[str] = _record()):
    """F.linear against the GEMM formats the aoti backend chooses among (plain weight-stationary, MKL packed, oneDNN prepacked, blocked), over one forward pass's projections per row count.

    The fastest and the builder's choice."""
    from eagle3_build.errors import CheckpointError

    from . import gemm as gm

    row_counts = _ints("--rows", rows)
    cfg = json.loads(config.read_text()) if config else gm.SMOLLM2
    host = _start(threads)
    try:
        res = gm.formats(cfg, host, row_counts, repeats, lm_head)
    except CheckpointError as e:
        raise typer.BadParameter(str(e), param_hint="--config") from None
    res["config"] = str(config or "SmolLM2-135M (built in)")
    results.emit(results.finish(res, host), save_result, record)


@app.command("gemm-blocking")
def gemm_blocking(rows: str = typer.Option("1,4,5,8", help="token row counts"),
                  variants: str = typer.Option("inductor,8x8", help="inductor (as the build compiles it), BMxBN "
                                               "(another of Inductor's register blockings), next-tile (prefetching "
                                               "the next weight tile into L2)"),
                  repeats: int = typer.Option(20, min=1),
                  threads: Optional[int] = _threads(),
                  save_result: Optional[Path] = _save(), record: Optional[str] = _record()):
    """The blocked GEMM format's micro-kernel variants over SmolLM2-135M's projections, each (rows, variant) one AOTInductor package, all called interleaved.

    Median ms per pass, each against the first."""
    from . import gemm as gm

    names = _csv(variants)
    for n in names:
        parts = n.split("x")
        if n not in gm.NAMED_VARIANTS and not (len(parts) == 2 and all(p.isdigit() and int(p) > 0 for p in parts)):
            raise typer.BadParameter(f"{n!r} is not a variant: inductor, next-tile or BMxBN (e.g. 8x8)",
                                     param_hint="--variants")
    row_counts = _ints("--rows", rows)
    host = _start(threads)
    results.emit(results.finish(gm.blocking(host, row_counts, names, repeats), host), save_result, record)


# ---------------------------------------------------------------------------------------------------- serving

def _sigterm(signum, frame):  # the finally blocks (server shutdown) run on SIGTERM as on Ctrl-C
    raise KeyboardInterrupt


@app.command()
def serve(bundle: Optional[str] = typer.Option(None, help="start eagle3-serve on this bundle twice (spec, then "
                                               "--no-spec) and compare"),
          base_url: Optional[str] = typer.Option(None, help="benchmark a running server (one pass)"),
          model: Optional[str] = typer.Option(None, help="'model' field (default: the first of GET /v1/models)"),
          num_prompts: int = typer.Option(32, min=1),
          input_len: int = typer.Option(128, min=1, help="approximate prompt length in tokens"),
          output_len: int = typer.Option(64, min=1, help="max_tokens of every request"),
          concurrency: str = typer.Option("1", help="max in-flight requests per level, e.g. 1,2,4 (inf: no limit)"),
          request_rate: float = typer.Option(float("inf"), help="requests/s, Poisson arrivals (inf: all at once)"),
          seed: int = typer.Option(0),
          temperature: float = typer.Option(0.0),
          top_p: Optional[float] = typer.Option(None),
          top_k: Optional[int] = typer.Option(None),
          metric_percentiles: str = typer.Option("99", help="percentiles reported besides the median"),
          request_timeout: float = typer.Option(3600.0, help="seconds per request"),
          no_calibrate: bool = typer.Option(False, help="--input-len words per prompt, not fitted to the tokenizer"),
          keep_text: bool = typer.Option(False, help="keep generated text in the JSON"),
          server_arg: Optional[List[str]] = typer.Option(None, help="an eagle3-serve argument, shell-split, "
                                                         "repeatable: --server-arg='--threads 1'"),
          server_cmd: Optional[str] = typer.Option(None, help="server launcher (default: python -m eagle3_runtime.server)"),
          server_timeout: float = typer.Option(600.0, help="seconds to wait for GET /health"),
          log_dir: Optional[Path] = typer.Option(None, help="server logs (default: a temporary directory)"),
          threads: Optional[int] = typer.Option(None, min=1, help="the server's threads, as recorded in the result "
                                                "(pass them with --server-arg)"),
          save_result: Optional[Path] = _save(), record: Optional[str] = _record()):
    """A load client in the style of `vllm bench serve`.

    Streamed completions at each concurrency level, TTFT / TPOT / ITL / e2e percentiles and the server's spec-
    decode counters. Exit 1: a request failed; 2: a server did not start or answer."""
    from . import serve as sv

    if (bundle is None) == (base_url is None):
        raise typer.BadParameter("give one of --bundle and --base-url")
    if request_rate <= 0:
        raise typer.BadParameter("> 0 (inf for no pacing)", param_hint="--request-rate")
    try:
        levels = sv.parse_concurrency(concurrency)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--concurrency") from None
    args = argparse.Namespace(bundle=bundle, base_url=base_url.rstrip("/").removesuffix("/v1") if base_url else None,
                              model=model, num_prompts=num_prompts, input_len=input_len, output_len=output_len,
                              concurrency=levels, request_rate=request_rate, seed=seed, temperature=temperature,
                              top_p=top_p, top_k=top_k, request_timeout=request_timeout, no_calibrate=no_calibrate,
                              metric_percentiles=[float(p) for p in _csv(metric_percentiles)], keep_text=keep_text,
                              server_arg=list(server_arg or []), server_cmd=server_cmd, server_timeout=server_timeout)
    signal.signal(signal.SIGTERM, _sigterm)
    from eagle3_runtime.tp import num_threads

    host = hosts.describe(num_threads(threads))
    result: dict = {"benchmark": "serve", "config": {k: (v if not (isinstance(v, float) and math.isinf(v)) else "inf")
                                                     for k, v in vars(args).items()}, "runs": []}
    state: dict = {}
    status = 0
    logs = log_dir or Path(tempfile.mkdtemp(prefix="bench_serve_"))
    logs.mkdir(parents=True, exist_ok=True)
    try:
        status = sv.run(args, result, state, logs)
    except sv.ServerError as e:
        print(f"error: {e}", file=sys.stderr)
        status = 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        status = 130
    finally:
        result["calibration"] = state.get("calibration")
        result["words_per_prompt"] = state.get("n_words")
        if result["runs"]:
            results.save(results.finish(result, host), save_result, record, indent=2)
    raise typer.Exit(status)


@app.command("vs-vllm")
def vs_vllm(bundle: Path = typer.Option(..., help="the eagle3 bundle"),
            target: Path = typer.Option(REPO / "artifacts" / "smollm2-135m-instruct", help="vLLM's target"),
            draft: Path = typer.Option(REPO / "demo" / "smollm2-135m-eagle3", help="vLLM's EAGLE3 draft"),
            vllm_venv: Path = typer.Option(REPO / "artifacts" / "venv-vllm"),
            install: bool = typer.Option(False, help="create / update the vLLM venv first"),
            no_vllm: bool = typer.Option(False, help="eagle3-serve only"),
            prompts: str = typer.Option("mtbench", help=PROMPTS_HELP),
            num_prompts: int = typer.Option(80, min=1),
            max_tokens: int = typer.Option(128, min=1),
            threads: Optional[int] = _threads(),
            ks: str = typer.Option("1,2,3,4", help="vLLM num_speculative_tokens to try"),
            eagle3: str = typer.Option("auto,none", help="eagle3-serve --speculation values (auto, none, always, or a "
                                       "menu tag such as chain3); with @4k (none@4k): that server on 4 KB pages"),
            repeats: int = typer.Option(1, min=1),
            interleave: bool = typer.Option(False, help="every server up at once, each prompt through every "
                                            "contender in turn"),
            gap: Optional[float] = typer.Option(None, min=0, help="--interleave: seconds of quiet before each "
                                                "request (default: the longest any server stays busy after a "
                                                "request, measured at start, + 0.5 s)"),
            neighbour: Optional[str] = typer.Option(None, metavar="BUSY/PERIOD", help="--interleave: each server's "
                                                    "turn twice, alone and beside a process busy BUSY s of every "
                                                    "PERIOD s (0.05/0.1: half of one core); its pass '<name> "
                                                    "+neighbour'"),
            concurrency: str = typer.Option("1", help="--interleave: after the one-at-a-time passes, the first "
                                            "--concurrent-prompts prompts through each server as a closed loop of "
                                            "N clients, for each N > 1 here (e.g. 1,4,8); vLLM then runs its default "
                                            "scheduler"),
            concurrent_prompts: int = typer.Option(16, min=1, help="prompts per closed loop (--concurrency)"),
            concurrent_repeats: int = typer.Option(1, min=1, help="closed loops per server and level (--concurrency), "
                                                   "the servers' order rotated each time; their totals merged"),
            no_in_process: bool = typer.Option(False, help="no in-process pass"),
            server_timeout: float = typer.Option(900.0),
            plot: Optional[Path] = typer.Option(None, help="a bar chart here"),
            save_result: Optional[Path] = _save(), record: Optional[str] = _record()):
    """eagle3-serve against vLLM-CPU's EAGLE3 on this host, the same target, draft and prompts over HTTP, one request at a time.

    And each eagle3 mode served against in-process. tok/s, TPOT, TTFT, acceptance length, and how many outputs
    equal plain greedy decoding."""
    from . import vs_vllm as vv
    from .prompts import texts as prompt_texts

    levels = sorted(set(_ints("--concurrency", concurrency)))
    if max(levels) > 1 and not interleave:
        raise typer.BadParameter("needs --interleave (every server up at once)", param_hint="--concurrency")
    texts = prompt_texts(prompts, num_prompts)
    try:
        neighbour_duty = hosts.parse_neighbour(neighbour) if neighbour else None
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--neighbour") from None
    if neighbour_duty and not interleave:
        raise typer.BadParameter("needs --interleave (alone and neighboured turns side by side)",
                                 param_hint="--neighbour")
    if install and not no_vllm:
        vv.install_vllm(vllm_venv)
    if not no_vllm and not vv.vllm_python(vllm_venv).exists():
        raise typer.BadParameter(f"no vLLM venv at {vllm_venv}: pass --install (or --no-vllm)", param_hint="--vllm-venv")
    host = _start(threads)
    args = argparse.Namespace(bundle=bundle, target=target, draft=draft, vllm_venv=vllm_venv, prompts=prompts,
                              max_tokens=max_tokens, threads=host["threads"], repeats=repeats, interleave=interleave,
                              gap=gap, no_in_process=no_in_process, server_timeout=server_timeout,
                              neighbour=neighbour_duty, concurrency=levels,
                              concurrent_prompts=min(concurrent_prompts, len(texts)),
                              concurrent_repeats=concurrent_repeats)
    served = _csv(eagle3)
    odd = [m for m in served if "@" in m and not m.endswith(vv.FOUR_K)]
    if odd:
        raise typer.BadParameter(f"{odd[0]!r}: the only suffix is {vv.FOUR_K} (that server on 4 KB pages)",
                                 param_hint="--eagle3")
    modes = [m for m in served if not m.endswith(vv.FOUR_K)]  # (in process: this process's pages, 2 MB)
    makers = {f"eagle3 {m}": (lambda d, m=m: vv.eagle3_server(args, m, d)) for m in served}
    if not no_vllm:
        makers["vllm none"] = lambda d: vv.vllm_server(args, None, d)
        for kk in _ints("--ks", ks):
            makers[f"vllm K {kk}"] = lambda d, kk=kk: vv.vllm_server(args, kk, d)
    log_dir = Path(tempfile.mkdtemp(prefix="vs_vllm_"))
    passes, ip_passes, at_once = (vv.run_interleaved if interleave else vv.run_sequential)(args, makers, texts, modes,
                                                                                          log_dir)
    res = results.finish(vv.compare(args, texts, modes, passes, ip_passes, log_dir, at_once), host)
    results.emit(res, save_result, record)
    if plot:
        vv.plot(res, plot)


@app.command("seeded-repro")
def seeded_repro(bundle: Path = typer.Argument(...),
                 num_prompts: int = typer.Option(100, min=1),
                 prompts: str = typer.Option("mtbench", help=PROMPTS_HELP),
                 chat: bool = typer.Option(False, "--chat", help="send the prompts as chat messages"),
                 max_tokens: int = typer.Option(64, min=1),
                 temperature: float = typer.Option(0.8),
                 top_p: float = typer.Option(0.95),
                 server_arg: Optional[List[str]] = typer.Option(None, help="an eagle3-serve argument (repeatable; "
                                                                "default --speculation auto)"),
                 server_cmd: Optional[str] = typer.Option(None, help="server launcher (default: python -m "
                                                          "eagle3_runtime.server)"),
                 threads: Optional[int] = typer.Option(None, min=1, help="the server's threads, as recorded"),
                 save_result: Optional[Path] = _save(), record: Optional[str] = _record()):
    """Seeded sampled requests (seeds 1..N) each sent alone, then all again two at a time on one eagle3-serve.

    Every answer's token ids compared with the same request's alone. Exit 0: all reproduced, 1: some differ, 2:
    the server did not start."""
    from eagle3_runtime.tp import num_threads

    from .prompts import texts
    from .serving import seeded_repro as run

    host = hosts.describe(num_threads(threads))
    server_args = [x for a in (server_arg or ["--speculation auto"]) for x in a.split()]
    res = run(bundle, texts(prompts), num_prompts, chat, {"max_tokens": max_tokens, "temperature": temperature,
                                                          "top_p": top_p}, server_args, server_cmd)
    res["prompt_set"] = prompts
    results.emit(results.finish(res, host), save_result, record)
    raise typer.Exit(0 if not res["differ"] else 1)


# ------------------------------------------------------------------------------------------------- build, shard

@app.command()
def build(out: Path = typer.Option(Path("artifacts/build-bench"), help="pair, bundles and caches (replaced)"),
          phases: str = typer.Option("build,decode", help="build (cold --jobs 1, warm rebuild), decode"),
          num_prompts: int = typer.Option(5, min=1),
          max_tokens: int = typer.Option(64, min=1),
          repeats: int = typer.Option(3, min=1),
          threads: Optional[int] = _threads(),
          save_result: Optional[Path] = _save(), record: Optional[str] = _record()):
    """Build time and decode speed of the aoti backend on a tiny pair.

    On a tiny pair: cold builds at --jobs 1 and 2, a warm rebuild, and decode tok/s of the aoti and export bundles against
    transformers eager."""
    from .build import build_and_decode

    host = _start(threads)
    res = build_and_decode(out, set(_csv(phases)), num_prompts, max_tokens, repeats)
    results.emit(results.finish(res, host), save_result, record)


@app.command()
def shard(gib: float = typer.Option(1.5, min=0.01, help="checkpoint size"),
          tp: int = typer.Option(4, min=1, help="tensor-parallel ranks"),
          save_result: Optional[Path] = _save(), record: Optional[str] = _record()):
    """The streaming sharder against load-everything-then-slice on a synthetic checkpoint.

    Peak RSS, throughput."""
    from .build import shard as run

    host = hosts.describe(None)
    results.emit(results.finish(run(gib, tp), host), save_result, record)


@app.command("shard-child", hidden=True)
def shard_child(mode: str, src: Path, out: Path, tp: int):
    """(shard's fresh process: one way of sharding)"""
    from .build import child

    child(mode, src, out, tp)


@app.command("results")
def results_page(check: bool = typer.Option(False, "--check", help="only say whether the generated files match the "
                                            "JSON (exit 1 where they do not)")):
    """Regenerate docs/results.md, docs/speed.png and the README's speed table from benchmarks/results/*.json."""
    from . import results_page as rp

    if check:
        bad = rp.stale()
        for p in bad:
            print(f"{p.relative_to(REPO)} differs from what benchmarks/results gives: run python -m benchmarks results")
        raise typer.Exit(1 if bad else 0)
    for path, text in rp.generate().items():
        path.write_text(text)
        print(f"wrote {path.relative_to(REPO)}")
    print(f"wrote {rp.CHART.relative_to(REPO)}")
