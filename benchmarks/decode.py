"""In-process decoding through the runtime (Engine(Bundle(dir)).generate) and transformers eager, and the three
measurements made of it: `demo` (a bundle against transformers), `engine` (two bundles interleaved), `prefill`
(the engine's prefill plan against padding). `shapes` (shapes.py) uses the same measure_runtime.

Decode tok/s = sum(n - 1) / sum(e2e - TTFT) over prompts, per prompt the median of the repeats."""
from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from . import host as hosts
from .timing import median, warm_engine


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


def median_runs(per_prompt: list[list[dict]]) -> list[dict]:
    return [{"n": rs[0]["n"], "e2e": statistics.median(r["e2e"] for r in rs),
             "ttft": statistics.median(r["ttft"] for r in rs)} for rs in per_prompt]


def shape_record(shape) -> dict:
    from .shapes import shape_arg

    return {**shape.model_dump(), "kind": shape.kind, "describe": shape.describe(), "arg": shape_arg(shape)}


def measure_runtime(bundle_dir: Path, prompts: list[list[int]], max_tokens: int, repeats: int,
                    speculation: str = "always") -> dict:
    """Speculative and plain decoding of the same bundle, interleaved per prompt; `speculation` as eagle3-run's
    --speculation (auto: the warm-up times the graphs, the engine chooses among the menu)."""
    from eagle3_runtime.bundle import Bundle
    from eagle3_runtime.engine import Engine, SpecStats

    print(f"loading {bundle_dir}" + (" and timing its graphs (--speculation auto)" if speculation == "auto" else ""),
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    bundle = Bundle(bundle_dir)
    if speculation == "auto":
        bundle.warm_up()
    engine = Engine(bundle, speculation=speculation)
    load_s = time.perf_counter() - t0
    chosen = engine.speculation_report()
    warm_engine(engine, prompts[0], max_tokens)
    warm = engine.metrics.graph_profile()  # profile the measured runs only
    print(f"measuring: {len(prompts)} prompt(s) x {max_tokens} tokens with and without speculation, alternated",
          file=sys.stderr, flush=True)
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
    spec_s, plain_s = summarize(median_runs(runs[True])), summarize(median_runs(runs[False]))
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
            "at_once": at_once(engine, prompts, max_tokens, tokens[False]),
            "load_s": round(load_s, 2), "spec": spec_s, "plain": plain_s,
            "speedup_decode": round(spec_s["decode_tok_s"] / plain_s["decode_tok_s"], 3),
            "speedup_e2e": round(spec_s["e2e_tok_s"] / plain_s["e2e_tok_s"], 3),
            "acceptance": acceptance, "round_ms": round_profile(graphs),
            "spec_equals_plain": f"{same}/{len(prompts)}", "graphs": graphs, "_tokens": tokens[False]}


def round_profile(graphs: dict[str, dict]) -> dict:
    """Per speculative round, from a graph profile ({"role/bucket": calls, total_s}): the verify graph's mean ms,
    the draft graphs' ms per round (draft_step x (depth - 1), or one unrolled draft_chain, + draft_catchup), and a
    plain decode pass's."""
    def role(name: str) -> tuple[int, float]:
        gs = [g for key, g in graphs.items() if key.split("/")[0].split(":")[0] == name]  # (role:tag: a menu shape's)
        return sum(g["calls"] for g in gs), sum(g["total_s"] for g in gs)

    (nv, tv), (ns, ts), (nu, tu), (nc, tc), (nd, td) = (role(r) for r in (
        "target_verify", "draft_step", "draft_chain", "draft_catchup", "target_decode"))
    ms = lambda t, n: round(1000 * t / n, 3) if n else None  # noqa: E731
    return {"rounds": nv, "verify_ms": ms(tv, nv), "draft_ms_per_round": ms(ts + tu + tc, nv),
            "draft_step_ms": ms(ts, ns), "draft_steps_per_round": round(ns / nv, 3) if nv else None,
            "draft_chain_ms": ms(tu, nu), "draft_catchup_ms": ms(tc, nc), "round_ms": ms(tv + ts + tu + tc, nv),
            "plain_decode_ms": ms(td, nd)}


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
    """transformers eager `generate(do_sample=False)` on the same prompt ids; TTFT from a streamer's clock."""
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
    s = summarize(median_runs(per_prompt))
    s["load_s"] = round(load_s, 2)
    s["dtype"] = dtype
    return s, tokens


# ------------------------------------------------------------------------------------------------------ demo

def at_once(engine, prompts: list[list[int]], max_tokens: int, alone: list[list[int]]) -> dict | None:
    """As many sequences as the bundle's largest batch bucket decoded together (the prompts in turn, speculation as
    the engine chooses per batch bucket): total tok/s over the wall time against the same sequences one at a time,
    and how many token streams equal the plain ones of one at a time (`alone`, per prompt). None for a bundle of
    batch 1 only."""
    rows = max(engine.batch_buckets)
    if rows < 2:
        return None
    print(f"measuring: {rows} sequences at a time, then one after another", file=sys.stderr, flush=True)
    seqs = [prompts[i % len(prompts)] for i in range(rows)]
    engine.generate_many(seqs, min(4, max_tokens))  # (the batch bucket's graphs' first calls)
    t0 = time.perf_counter()
    many = engine.generate_many(seqs, max_tokens)
    wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    one = [engine.generate(ids, max_tokens) for ids in seqs]
    wall_one = time.perf_counter() - t0
    n, n_one = sum(len(g.token_ids) for g in many), sum(len(g.token_ids) for g in one)
    same = sum(g.token_ids == alone[i % len(alone)] for i, g in enumerate(many))
    return {"sequences": rows, "tok_s": round(n / wall, 2), "one_at_a_time_tok_s": round(n_one / wall_one, 2),
            "speedup": round((n / wall) / (n_one / wall_one), 3), "same_tokens_as_alone": f"{same}/{rows}"}


def demo(bundle: Path, host: dict, prompt_set: str, num_prompts: int, max_tokens: int, repeats: int,
         speculation: str, target: Path | None) -> dict:
    """The bundle speculative and plain, then transformers eager float32 on its target: one run, same prompts."""
    from eagle3_build.verify.reference import target_location
    from eagle3_runtime.reader import read_manifest

    from .prompts import encode, texts

    manifest = read_manifest(bundle)
    target = target or target_location(manifest).directory
    prompts, chat = encode(bundle, texts(prompt_set, num_prompts), chat=True)
    rt = measure_runtime(bundle, prompts, max_tokens, repeats, speculation)
    print("measuring: transformers eager on the same prompts", file=sys.stderr, flush=True)
    hf, hf_tokens = measure_transformers(target, "float32", prompts, max_tokens, list(manifest.eos_token_ids), repeats)
    same = sum(a == b for a, b in zip(rt.pop("_tokens"), hf_tokens))
    res = {"benchmark": "demo", "bundle": str(bundle), "backend": manifest.backend, "chat": chat,
           "prompt_set": prompt_set, "prompts": len(prompts), "max_tokens": max_tokens, "runtime": rt,
           "transformers_eager": hf, "runtime_vs_eager": round(rt["spec"]["decode_tok_s"] / hf["decode_tok_s"], 3),
           "plain_equals_eager": f"{same}/{len(prompts)}"}
    acc = rt["acceptance"]
    print(f"\n== decode speed, {len(prompts)} {prompt_set} chat prompts x {max_tokens} tokens, {hosts.summary(host)}, "
          f"{manifest.backend} backend")
    print(f"  {'eagle3 runtime, speculative:':32}{rt['spec']['decode_tok_s']:7.1f} tok/s   "
          f"({rt['shape']['describe']}, acceptance length {acc['mean_acceptance_length']:.2f})")
    for line in rt["chosen_at_start"]:
        print(f"  --speculation {speculation}: {line}")
    print(f"  eagle3 runtime, no speculation: {rt['plain']['decode_tok_s']:7.1f} tok/s   "
          f"(speculation {rt['speedup_decode']:.2f}x)")
    if rt["at_once"]:
        n = rt["at_once"]["sequences"]
        print(f"  eagle3 runtime, {n} at a time:    {rt['at_once']['tok_s']:7.1f} tok/s in all, prefill included   "
              f"({rt['at_once']['speedup']:.2f}x one after another; same tokens as alone "
              f"{rt['at_once']['same_tokens_as_alone']})")
    print(f"  transformers eager (float32):   {hf['decode_tok_s']:7.1f} tok/s")
    print(f"  runtime vs transformers eager:  {res['runtime_vs_eager']:.2f}x   "
          f"(same tokens as eager: {res['plain_equals_eager']}, speculative == plain: {rt['spec_equals_plain']})")
    return res


# ---------------------------------------------------------------------------------------------------- engine

def timed_graphs(bundle, times: dict[str, list[float]]) -> None:
    """Record every call of the bundle's graphs (seconds, by graph name) into `times`."""
    for name, graph in bundle.backend.graphs.items():
        def call(*args, fn=graph.fn, name=name):
            t0 = time.perf_counter()
            out = fn(*args)
            times[name].append(time.perf_counter() - t0)
            return out
        graph.fn = call


def engine_ab(bundles: list[Path], host: dict, prompt_set: str, num_prompts: int, max_tokens: int, repeats: int,
              chat: bool) -> dict:
    """Two bundles in one process, the same prompts speculative and plain, A and B alternating per generation
    (the order flips every repeat); each graph's median ms per call inside the loop."""
    from eagle3_runtime.bundle import Bundle
    from eagle3_runtime.engine import Engine

    from .prompts import encode, texts

    names = ["A", "B"]
    times = {n: defaultdict(list) for n in names}
    engines = {}
    for n, d in zip(names, bundles):
        bundle = Bundle(d)
        timed_graphs(bundle, times[n])
        engines[n] = Engine(bundle, speculation="always")
    prompts, chat = encode(bundles[0], texts(prompt_set, num_prompts), chat)
    for e in engines.values():
        warm_engine(e, prompts[0], max_tokens)
    for t in times.values():
        t.clear()
    tokens, seconds = defaultdict(int), defaultdict(float)
    outputs: dict[tuple[str, bool], list[list[int]]] = defaultdict(list)
    for r in range(repeats):
        for ids in prompts:
            for spec in (True, False):
                for n in (names if r % 2 == 0 else names[::-1]):
                    g = engines[n].generate(ids, max_tokens, speculative=spec)
                    tokens[n, spec] += len(g.token_ids) - 1
                    seconds[n, spec] += g.seconds - (g.ttft or 0.0)
                    if r == 0:
                        outputs[n, spec].append(g.token_ids)
    rate = {f"{n} {'speculative' if s else 'plain'}": round(tokens[n, s] / seconds[n, s], 2)
            for n in names for s in (True, False)}
    graphs = {g: {n: median([1e3 * t for t in times[n][g]]) for n in names} | {"calls": [len(times[n][g]) for n in names]}
              for g in sorted(set(times["A"]) | set(times["B"])) if times["A"][g] or times["B"][g]}
    res = {"benchmark": "engine", "bundles": [str(b) for b in bundles], "prompts": len(prompts),
           "prompt_set": prompt_set, "chat": chat, "max_tokens": max_tokens, "repeats": repeats, "decode_tok_s": rate,
           "b_over_a": {m: round(rate[f"B {m}"] / rate[f"A {m}"], 3) for m in ("speculative", "plain")},
           "same_tokens": all(outputs["A", s] == outputs["B", s] for s in (True, False)), "graphs_ms": graphs}
    print(f"decode tok/s, {len(prompts)} prompts x {max_tokens} x {repeats}, {hosts.summary(host)}, "
          "A / B interleaved in one process")
    for m in ("speculative", "plain"):
        print(f"  {m:>12}: A {rate[f'A {m}']:.1f}  B {rate[f'B {m}']:.1f}  (B/A {res['b_over_a'][m]:.3f})")
    print(f"  same tokens: {res['same_tokens']}\n  median ms per call in the loop (A / B):")
    for g, v in graphs.items():
        print(f"    {g:<40} " + " / ".join("-" if v[n] is None else f"{v[n]:.2f}" for n in names) + f"  calls {v['calls']}")
    return res


# --------------------------------------------------------------------------------------------------- prefill

def _ms_summary(ms: list[float]) -> dict:
    return {"median_ms": round(statistics.median(ms), 1), "mean_ms": round(statistics.mean(ms), 1)} if ms else {}


def prefill_plan(bundle_dir: Path, host: dict, prompt_set: str, num_prompts: int, repeats: int, chat: bool) -> dict:
    """Time to first token with the engine's prefill plan (a prompt just past a bucket may run that bucket plus
    verify calls) against padding to the smallest bucket holding it (the warm-up's timings hidden from the
    engine), each prompt both ways in turn. Prompts past the largest bucket run the plan in both arms."""
    import torch

    from eagle3_runtime.bundle import Bundle
    from eagle3_runtime.engine import Engine

    from .prompts import encode, texts

    bundle = Bundle(bundle_dir)
    bundle.warm_up()
    prompts, chat = encode(bundle_dir, texts(prompt_set, num_prompts), chat)
    engine = Engine(bundle, speculation="auto")
    longest = bundle.manifest.longest_prompt()
    prompts = [p for p in prompts if len(p) <= longest]
    timed = (bundle.backend.timings, bundle.backend.costs)
    plans = [engine._prefill_plan(len(p), 1, True) for p in prompts]
    continued = [i for i, (_, shape) in enumerate(plans) if shape is not None]
    ms: dict[str, list[list[float]]] = {"plan": [[] for _ in prompts], "padded": [[] for _ in prompts]}
    with torch.inference_mode():
        for _ in range(repeats):
            for i, ids in enumerate(prompts):
                for arm, (timings, costs) in (("plan", timed), ("padded", ({}, {}))):
                    bundle.backend.timings, bundle.backend.costs = timings, costs
                    t0 = time.perf_counter()
                    engine.generate(ids, 1)
                    ms[arm][i].append((time.perf_counter() - t0) * 1e3)
    bundle.backend.timings, bundle.backend.costs = timed
    res = {"benchmark": "prefill", "bundle": str(bundle_dir), "prompt_set": prompt_set, "repeats": repeats,
           "chat_template": chat, "prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts],
           "continued": [len(prompts[i]) for i in continued],
           "plans": [{"bucket": s, "continued_by": shape.describe() if shape else None} for s, shape in plans]}
    for arm, per in ms.items():
        res[arm] = {"all": _ms_summary([x for xs in per for x in xs]),
                    "continued": _ms_summary([x for i in continued for x in per[i]])}
    sub = res["padded"]["continued"], res["plan"]["continued"]
    res["continued_padded_over_plan"] = round(sub[0]["mean_ms"] / sub[1]["mean_ms"], 3) if continued else None
    print(f"time to first token, {len(prompts)} {prompt_set} prompts x {repeats}, one token each, in-process, "
          f"{hosts.summary(host)}")
    print(f"  continued by the plan: {len(continued)} of {len(prompts)} (prompt tokens {res['continued']})")
    for arm in ("plan", "padded"):
        a, c = res[arm]["all"], res[arm]["continued"]
        print(f"  {arm:7s} all: median {a['median_ms']} ms, mean {a['mean_ms']} ms"
              + (f"; continued prompts: median {c['median_ms']} ms, mean {c['mean_ms']} ms" if c else ""))
    if continued:
        print(f"  continued prompts, padded / plan (mean): {res['continued_padded_over_plan']}x")
    return res
