"""Graphs called alone on a built bundle's weights and KV cache: each graph's latency, bundles side by side
(`graph`), and where an aoti graph's time goes kernel by kernel (`graph --profile RECIPE`).

Inputs are built from each graph's manifest entry: token ids drawn from the vocabulary, positions at --position
(the KV cache holds zeros below it; attention reads the whole static cache either way), hidden / aux states
drawn from a normal distribution."""
from __future__ import annotations

import re
import sys
import tempfile
import time
from pathlib import Path

from . import host as hosts
from .timing import interleaved_ms, median

POSITION_INPUTS = ("pos", "start", "positions", "slots")
PROFILE = {"cpp.enable_kernel_profile": True}


def graph_inputs(bundle, name: str, position: int, gen) -> list:
    import torch

    from eagle3_runtime.bundle import DTYPES

    entry = bundle.backend.graphs[name].entry
    out = []
    for spec in entry.inputs[1:]:  # the rank is bound by the Graph
        dtype = DTYPES[spec.dtype]
        if dtype.is_floating_point:
            out.append(torch.randn(spec.shape, generator=gen, dtype=torch.float32).to(dtype))
        elif spec.name in POSITION_INPUTS:
            out.append(torch.full(spec.shape, position, dtype=dtype))
        elif spec.name in ("slot", "last"):
            out.append(torch.zeros(spec.shape, dtype=dtype))
        elif spec.name == "tree_mask":  # a chain's (lower-triangular over the last two dims)
            out.append(torch.ones(spec.shape[-2:], dtype=dtype).tril().expand(spec.shape).contiguous())
        else:  # token ids
            out.append(torch.randint(0, bundle.manifest.vocab_size, spec.shape, generator=gen, dtype=dtype))
    return out


def latency(paths: list[Path], host: dict, graphs: str | None, position: int, repeats: int) -> dict:
    """Median ms per call of each graph (default: every batch-bucket graph all bundles have), calls interleaved
    graph by graph and bundle by bundle; each bundle's ratio to the first (> 1: faster than the first)."""
    import torch

    from eagle3_runtime.bundle import Bundle

    bundles = [Bundle(b) for b in paths]
    names = [{g.name: g.role for g in b.manifest.graphs} for b in bundles]
    common = [n for n in names[0] if all(n in other for other in names[1:])]
    wanted = graphs.split(",") if graphs else [n for n in common if not names[0][n].endswith("prefill")]
    unknown = [n for n in wanted if n not in common]
    if unknown:
        sys.exit(f"graphs {unknown} are not in every bundle (common: {', '.join(common)})")
    for b in bundles:
        if position >= b.manifest.max_model_len - 16:
            sys.exit(f"--position {position} leaves no room in {b.root} (max_model_len {b.manifest.max_model_len})")
    gen = torch.Generator().manual_seed(0)
    calls = {}
    for n in wanted:
        inputs = graph_inputs(bundles[0], n, position, gen)
        for i, b in enumerate(bundles):
            calls[n, i] = lambda g=b.backend.graphs[n], x=inputs: g(*x)
    with torch.inference_mode():
        ms = interleaved_ms(calls, repeats)
    res = {"benchmark": "graph", "bundles": [str(b) for b in paths], "position": position, "repeats": repeats,
           "graphs": {}}
    print(f"median ms per call, {repeats} interleaved calls each, {hosts.summary(host)}, position {position}")
    print(f"{'graph':<30}" + "".join(f"{p.name[-28:]:>30}" for p in paths))
    for n in wanted:
        med = [median(ms[n, i], 6) for i in range(len(bundles))]
        res["graphs"][n] = [{"median_ms": round(m, 2), "ratio_to_first": round(med[0] / m, 3)} for m in med]
        print(f"{n:<30}" + "".join(f"{m:>20.1f} ({med[0] / m:4.2f}x)" for m in med))
    return res


# ----------------------------------------------------------------------------------------------------- profile

def kernel_name(name: str) -> str | None:
    """A profiler event's kernel, named across graphs and layers (None: not one of the graph's kernels)."""
    if name.startswith("aoti_torch_cpu_"):  # ATen called from the graph
        return "aten " + name.removeprefix("aoti_torch_cpu_").strip("_")
    m = re.match(r"graph_\d+_(gemm_m\d+n\d+k\d+)_", name)
    if m:
        return m.group(1).replace("_", " ")
    m = re.match(r"graph_\d+_(cpp_fused_.*?)(_\d+)?$", name)
    return m.group(1)[:60] if m else None


def profiled_graphs(bundle, recipe: Path, names: list[str], work: Path) -> dict:
    """{name: (the bundle's graph, the same graph compiled again with Inductor's kernel profiling)}: each graph is
    traced from `recipe` again and must get the bundle graph's key (same recipe, code and GEMM choice)."""
    from eagle3_build.backends.per_graph import trace_graphs
    from eagle3_build.backends.registry import get_backend
    from eagle3_build.compile.cache import CompileCache, default_cache_dir
    from eagle3_build.pair import build_models, graph_plan, load_pair
    from eagle3_build.recipe import RecipeError, load_recipe, select_pair
    from eagle3_runtime.backends.base import Graph

    try:
        pair = select_pair(load_recipe(recipe), bundle.manifest.name)[0]
    except RecipeError as e:
        sys.exit(str(e))
    if pair.backend != "aoti" or bundle.manifest.backend != "aoti":
        sys.exit(f"graph --profile reads Inductor's kernels: {bundle.root} and {recipe} must be aoti builds")
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
    layouts = backend.layouts_of(bundle.manifest.build.get("gemm"), pair)  # (the bundle's own GEMM choice)
    for tg in trace_graphs(bm, backend, CompileCache(work / "cache").open(), layouts, specs):
        own = bundle.backend.graphs[tg.spec.name]
        if tg.job.key != own.entry.key:
            sys.exit(f"{tg.spec.name}: {recipe} traces to another graph than {bundle.root}'s (key {tg.job.key[:12]} vs "
                     f"{own.entry.key[:12]}); pass the recipe the bundle was built from, with this code")
        package = work / f"{tg.spec.name}.pt2"
        profiling.compile_exported(tg.job.ep, package, tg.job.key, tg.spec.role)
        fn = bundle.backend.load_graph(package, own.entry, own.weights)
        out[tg.spec.name] = (own, Graph(own.entry, fn, own.weights, own.kv, own.rank))
    return out


def profile_one(own, prof, inputs: list, calls: int, top: int) -> dict:
    """The profiled compile checked against the bundle's graph, both timed interleaved, then the kernels by self
    time per call under torch.profiler (generated GEMMs named by m x n x k), their sum against the call's time."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch.inference_mode():
        want, got = own(*inputs), prof(*inputs)
        if any(not torch.equal(a, b) for a, b in zip(want, got)):
            sys.exit(f"{own.entry.name}: the profiled compile's outputs differ from the bundle's graph")
        ms = interleaved_ms({"bundle": lambda: own(*inputs), "profiled": lambda: prof(*inputs)}, calls)
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
    return {"bundle_ms": median(ms["bundle"]), "profiled_ms": median(ms["profiled"]),
            "profiled_wall_ms": round(wall, 3), "kernels_ms": round(busy, 3), "outside_kernels_ms": round(wall - busy, 3),
            "kernels": [{"kernel": k, "ms_per_call": round(t, 3), "calls_per_call": n} for k, (t, n) in ranked[:top]]}


def profile(path: Path, recipe: Path, host: dict, graphs: str, position: int, calls: int, top: int) -> dict:
    import torch

    from eagle3_runtime.bundle import Bundle

    bundle = Bundle(path)
    names = graphs.split(",")
    unknown = [n for n in names if n not in bundle.backend.graphs]
    if unknown:
        sys.exit(f"graphs {unknown} are not in {path}")
    gen = torch.Generator().manual_seed(0)
    res = {"benchmark": "graph-profile", "bundle": str(path), "recipe": str(recipe), "position": position,
           "calls": calls, "graphs": {}}
    with tempfile.TemporaryDirectory(prefix="graph-profile-") as d:
        for name, (own, prof) in profiled_graphs(bundle, recipe, names, Path(d)).items():
            r = res["graphs"][name] = profile_one(own, prof, graph_inputs(bundle, name, position, gen), calls, top)
            print(f"\n{name}: {r['bundle_ms']:.2f} ms per call as built, {r['profiled_ms']:.2f} profiled; kernels "
                  f"{r['kernels_ms']:.2f} of {r['profiled_wall_ms']:.2f} ms under the profiler ({hosts.summary(host)}, "
                  f"position {position})")
            for k in r["kernels"]:
                print(f"  {k['ms_per_call']:8.3f} ms  x{k['calls_per_call']:<4} {k['kernel']}")
    return res
