"""Where an aoti graph's time goes, kernel by kernel, on a built bundle's weights.

    python benchmarks/graph_profile.py BUNDLE RECIPE --graphs target_decode_b1_c256,target_verify_b1_tree4x2x8_c256
        [--position 200] [--calls 20] [--threads 2] [--top 12] [--save-result profile.json]

RECIPE is the recipe the bundle was built from: each named graph is traced from it again and must get the key the
bundle's graph has (same recipe, code and GEMM choice), else this stops. The graph is then compiled once more as
the build compiled it plus Inductor's kernel profiling (`cpp.enable_kernel_profile`: a record per generated kernel;
ATen's extern calls such as SDPA are recorded by ATen), bound to the bundle's weights and KV cache through the
runtime, checked to give the bundle's graph's outputs, and run under torch.profiler with inputs as graph_latency
builds them. Per graph: the kernels by self time per call (generated GEMMs named by their m x n x k), their sum
against the call's time (the rest: the wrapper between kernels and profiling itself), and the bundle's graph's
time beside the profiled one's. JSON on stdout's last line and with --save-result.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # (as graph_latency)

import torch  # noqa: E402
from graph_latency import graph_inputs  # noqa: E402

from eagle3_build.backends.per_graph import trace_graphs  # noqa: E402
from eagle3_build.backends.registry import get_backend  # noqa: E402
from eagle3_build.compile.cache import CompileCache, default_cache_dir  # noqa: E402
from eagle3_build.pair import build_models, graph_plan, load_pair  # noqa: E402
from eagle3_build.recipe import RecipeError, load_recipe, select_pair  # noqa: E402
from eagle3_runtime.backends.base import Graph  # noqa: E402
from eagle3_runtime.bundle import Bundle, BundleError  # noqa: E402
from eagle3_runtime.packing import cpu_description  # noqa: E402
from eagle3_runtime.tp import set_threads  # noqa: E402

PROFILE = {"cpp.enable_kernel_profile": True}


def kernel_name(name: str) -> str | None:
    """A profiler event's kernel, named across graphs and layers (None: not one of the graph's kernels)."""
    if name.startswith("aoti_torch_cpu_"):  # ATen called from the graph
        return "aten " + name.removeprefix("aoti_torch_cpu_").strip("_")
    m = re.match(r"graph_\d+_(gemm_m\d+n\d+k\d+)_", name)
    if m:
        return m.group(1).replace("_", " ")
    m = re.match(r"graph_\d+_(cpp_fused_.*?)(_\d+)?$", name)
    return m.group(1)[:60] if m else None


def profiled_graphs(bundle: Bundle, recipe: Path, names: list[str], work: Path) -> dict[str, tuple[Graph, Graph]]:
    """{name: (the bundle's graph, the same graph compiled with kernel profiling)}."""
    try:
        pair = select_pair(load_recipe(recipe), bundle.manifest.name)[0]
    except RecipeError as e:
        sys.exit(str(e))
    if pair.backend != "aoti" or bundle.manifest.backend != "aoti":
        sys.exit(f"graph_profile reads Inductor's kernels: {bundle.root} and {recipe} must be aoti builds")
    backend = get_backend(pair.backend, pair.backend_options)
    options = dict(pair.backend_options or {})
    profiling = get_backend(pair.backend, {**options, "inductor_configs": {**options.get("inductor_configs", {}),
                                                                          **PROFILE}})
    profiling.prepare(default_cache_dir())  # (Inductor's ISA probe, memoised by the builds on this host)
    bm = build_models(load_pair(pair))
    specs = [s for s in graph_plan(pair) if s.name in names]
    if {s.name for s in specs} != set(names):
        sys.exit(f"graphs {sorted(set(names) - {s.name for s in specs})} are not in {recipe}'s plan")
    out = {}
    for tg in trace_graphs(bm, backend, CompileCache(work / "cache").open(), bundle.manifest.build.get("gemm"), specs):
        own = bundle.backend.graphs[tg.spec.name]
        if tg.job.key != own.entry.key:
            sys.exit(f"{tg.spec.name}: {recipe} traces to another graph than {bundle.root}'s (key {tg.job.key[:12]} vs "
                     f"{own.entry.key[:12]}); pass the recipe the bundle was built from, with this code")
        package = work / f"{tg.spec.name}.pt2"
        profiling.compile_exported(tg.job.ep, package, tg.job.key, tg.spec.role)
        fn = bundle.backend.load_graph(package, own.entry, own.weights)
        out[tg.spec.name] = (own, Graph(own.entry, fn, own.weights, own.kv, own.rank))
    return out


def profile(own: Graph, prof: Graph, inputs: list[torch.Tensor], calls: int, top: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch.inference_mode():
        want, got = own(*inputs), prof(*inputs)
        if any(not torch.equal(a, b) for a, b in zip(want, got)):
            sys.exit(f"{own.entry.name}: the profiled compile's outputs differ from the bundle's graph")
        ms = {"bundle": [], "profiled": []}
        for rep in range(calls + 1):  # interleaved, the first call of each a warm-up
            for k, g in (("bundle", own), ("profiled", prof)):
                t0 = time.perf_counter()
                g(*inputs)
                if rep:
                    ms[k].append((time.perf_counter() - t0) * 1e3)
        with torch_profile(activities=[ProfilerActivity.CPU]) as p:
            t0 = time.perf_counter()
            for _ in range(calls):
                prof(*inputs)
            wall = (time.perf_counter() - t0) * 1e3 / calls
    kernels: dict[str, list[float]] = {}
    for e in p.key_averages():
        k = kernel_name(e.key)
        if k is not None:
            entry = kernels.setdefault(k, [0.0, 0])
            entry[0] += e.self_cpu_time_total / 1e3 / calls
            entry[1] += e.count // calls
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    busy = sum(v[0] for v in kernels.values())
    return {"bundle_ms": round(statistics.median(ms["bundle"]), 3), "profiled_ms": round(statistics.median(ms["profiled"]), 3),
            "profiled_wall_ms": round(wall, 3), "kernels_ms": round(busy, 3), "outside_kernels_ms": round(wall - busy, 3),
            "kernels": [{"kernel": k, "ms_per_call": round(t, 3), "calls_per_call": n} for k, (t, n) in ranked[:top]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("recipe", type=Path)
    ap.add_argument("--graphs", required=True, help="comma-separated graph names of the bundle")
    ap.add_argument("--position", type=int, default=200)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--top", type=int, default=12, help="kernels listed per graph")
    ap.add_argument("--save-result", type=Path)
    args = ap.parse_args(argv)
    threads = set_threads(args.threads)
    try:
        bundle = Bundle(args.bundle)
    except BundleError as e:
        ap.error(str(e))
    names = args.graphs.split(",")
    unknown = [n for n in names if n not in bundle.backend.graphs]
    if unknown:
        sys.exit(f"graphs {unknown} are not in {args.bundle}")
    gen = torch.Generator().manual_seed(0)
    result = {"benchmark": "graph_profile", "bundle": str(args.bundle), "cpu": cpu_description(), "threads": threads,
              "position": args.position, "calls": args.calls, "torch": torch.__version__, "graphs": {}}
    with tempfile.TemporaryDirectory(prefix="graph-profile-") as d:
        for name, (own, prof) in profiled_graphs(bundle, args.recipe, names, Path(d)).items():
            r = result["graphs"][name] = profile(own, prof, graph_inputs(bundle, name, args.position, gen), args.calls,
                                                 args.top)
            print(f"\n{name}: {r['bundle_ms']:.2f} ms per call as built, {r['profiled_ms']:.2f} profiled; kernels "
                  f"{r['kernels_ms']:.2f} of {r['profiled_wall_ms']:.2f} ms under the profiler ({cpu_description()}, "
                  f"{threads} threads, position {args.position})")
            for k in r["kernels"]:
                print(f"  {k['ms_per_call']:8.3f} ms  x{k['calls_per_call']:<4} {k['kernel']}")
    print(json.dumps(result))
    if args.save_result:
        args.save_result.parent.mkdir(parents=True, exist_ok=True)
        args.save_result.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
