"""`serve`: a load client for eagle3-serve in the style of `vllm bench serve`.

Each request is a streamed POST /v1/completions; per request TTFT, TPOT = (e2e - TTFT) / (output_tokens - 1), ITL
(gaps between streamed chunks that carry tokens: with speculation one gap may cover several tokens, as in vLLM) and
e2e latency. The speculative-decoding block comes from the server's /metrics counters (eagle3_spec_decode_*, else
vllm:spec_decode_*) scraped before and after each run. Prompts are random words drawn from --seed (the same every
pass and concurrency level), their length calibrated against the server's tokenizer by two probe requests that
double as warm-up. With --bundle it starts eagle3-serve twice (speculative, then --no-spec) and compares them."""
from __future__ import annotations

import asyncio
import json
import math
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from eagle3_runtime.spec_counters import parse_prometheus, spec_counters, spec_delta

from .prompts import random_prompts, random_words
from .serving import Server, ServerError, eagle3_serve


@dataclass
class RequestResult:
    index: int
    success: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    usage_reported: bool = False
    ttft: float = 0.0          # s
    tpot: float | None = None  # s, None when output_tokens <= 1
    e2e: float = 0.0           # s
    itl: list[float] = field(default_factory=list)  # s
    chunks: int = 0            # text-bearing chunks
    finish_reason: str | None = None
    generated_text: str = ""


def build_payload(args, model: str | None, prompt: str, max_tokens: int, seed: int | None) -> dict:
    body: dict = {"prompt": prompt, "max_tokens": max_tokens, "temperature": args.temperature, "stream": True}
    if model:
        body["model"] = model
    if args.top_p is not None:
        body["top_p"] = args.top_p
    if args.top_k is not None:
        body["top_k"] = args.top_k
    if seed is not None and args.temperature > 0:
        body["seed"] = seed
    return body


async def send_request(client: httpx.AsyncClient, url: str, body: dict, index: int) -> RequestResult:
    """One streamed completion. HTTP errors, in-stream error objects, malformed chunks and a stream
    that ends without [DONE] all count as failures, with the reason kept in `error`."""
    res = RequestResult(index=index)
    text_parts: list[str] = []
    st = time.perf_counter()
    last_token_t: float | None = None
    last_choice_t: float | None = None
    done = False
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                raw = (await resp.aread()).decode("utf-8", "replace")
                res.error = f"HTTP {resp.status_code}: {raw[:2000]}"
                res.e2e = time.perf_counter() - st
                return res
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line or line.startswith(":"):
                    continue
                if not line.startswith("data:"):
                    continue  # event:/id:/retry: fields carry nothing we need
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError as e:
                    raise ValueError(f"malformed SSE chunk ({e}): {data[:300]!r}") from None
                if not isinstance(chunk, dict):
                    raise ValueError(f"SSE chunk is not a JSON object: {data[:300]!r}")
                if chunk.get("error"):
                    raise ValueError(f"error in stream: {json.dumps(chunk['error'])[:2000]}")
                choices = chunk.get("choices") or []
                if choices:
                    c = choices[0]
                    text = c.get("text") or ""
                    finish = c.get("finish_reason")
                    if finish:
                        res.finish_reason = finish
                    last_choice_t = now
                    # Does this chunk carry generated tokens? token_ids (eagle3-serve, vLLM with
                    # return_token_ids) says so exactly; otherwise: it has text, or it is not merely the
                    # closing finish_reason chunk (tokens whose text the detokenizer still holds back).
                    ids = c.get("token_ids")
                    if ids if isinstance(ids, list) else (text or (not finish and "text" in c)):
                        if last_token_t is None:
                            res.ttft = now - st
                        else:
                            res.itl.append(now - last_token_t)
                        last_token_t = now
                        res.chunks += 1
                        text_parts.append(text)
                usage = chunk.get("usage")
                if usage:
                    res.usage_reported = True
                    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    res.output_tokens = int(usage.get("completion_tokens") or 0)
        res.e2e = time.perf_counter() - st
        if not done:
            res.error = "stream ended without 'data: [DONE]'"
            return res
        if not res.usage_reported:
            res.output_tokens = res.chunks  # best effort: one token per chunk
        if last_token_t is None:
            if res.output_tokens > 0 and last_choice_t is not None:
                res.ttft = last_choice_t - st  # everything arrived in the closing chunk
            elif res.output_tokens > 0:
                res.error = "usage reports output tokens but no choices chunk was streamed"
                return res
            else:
                res.ttft = res.e2e
        if res.output_tokens > 1:
            res.tpot = (res.e2e - res.ttft) / (res.output_tokens - 1)
        res.generated_text = "".join(text_parts)
        res.success = True
    except Exception as e:  # noqa: BLE001 - every failure is recorded, none stops the run
        res.e2e = time.perf_counter() - st
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return res


async def scrape_spec(client: httpx.AsyncClient, base_url: str) -> tuple[dict | None, str]:
    try:
        r = await client.get(base_url + "/metrics", timeout=30)
    except Exception as e:  # noqa: BLE001
        return None, f"GET /metrics failed: {type(e).__name__}: {e}"
    if r.status_code != 200:
        return None, f"GET /metrics returned HTTP {r.status_code}"
    c = spec_counters(parse_prometheus(r.text))
    return c, "" if c is not None else "no spec_decode counters in /metrics"


# ---------------------------------------------------------------------------------------------- one run

def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not xs:
        return 0.0
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def latency_summary(xs: list[float], percentiles: list[float]) -> dict:
    ms = [x * 1000 for x in xs]
    d = {"mean": sum(ms) / len(ms) if ms else 0.0, "median": percentile(ms, 50),
         "std": math.sqrt(sum((x - sum(ms) / len(ms)) ** 2 for x in ms) / len(ms)) if ms else 0.0}
    for p in percentiles:
        d[f"p{p:g}"] = percentile(ms, p)
    return d


async def run_level(args, base_url: str, model: str | None, prompts: list[str], concurrency: int | None,
                    label: str) -> dict:
    url = base_url + "/v1/completions"
    n_conn = concurrency or len(prompts)
    limits = httpx.Limits(max_connections=n_conn, max_keepalive_connections=n_conn)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        before, metrics_note = await scrape_spec(client, base_url)
        sem = asyncio.Semaphore(concurrency) if concurrency else None
        rate_rng = random.Random(args.seed + 1)

        async def one(i: int, prompt: str) -> RequestResult:
            body = build_payload(args, model, prompt, args.output_len, args.seed + i)
            if sem is None:
                return await send_request(client, url, body, i)
            async with sem:
                return await send_request(client, url, body, i)

        print(f"[{label}] {len(prompts)} requests, concurrency={concurrency or 'unlimited'}, "
              f"request rate={args.request_rate} ...", flush=True)
        t0 = time.perf_counter()
        tasks = []
        for i, p in enumerate(prompts):
            tasks.append(asyncio.create_task(one(i, p)))
            if args.request_rate != float("inf") and i + 1 < len(prompts):
                await asyncio.sleep(rate_rng.expovariate(args.request_rate))  # Poisson arrivals
        results: list[RequestResult] = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        after, note2 = await scrape_spec(client, base_url)
        metrics_note = metrics_note or note2

    ok = [r for r in results if r.success]
    pct = args.metric_percentiles
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    m = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": total_out / duration if duration else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration else 0.0,
        "mean_input_tokens": total_in / len(ok) if ok else 0.0,
        "mean_output_tokens": total_out / len(ok) if ok else 0.0,
        "mean_tokens_per_chunk": total_out / max(1, sum(r.chunks for r in ok)),
        "usage_missing": sum(1 for r in ok if not r.usage_reported),
        "ttft_ms": latency_summary([r.ttft for r in ok], pct),
        "tpot_ms": latency_summary([r.tpot for r in ok if r.tpot is not None], pct),
        "itl_ms": latency_summary([x for r in ok for x in r.itl], pct),
        "e2el_ms": latency_summary([r.e2e for r in ok], pct),
    }
    spec = spec_delta(before, after)
    run = {"label": label, "concurrency": concurrency, "request_rate": args.request_rate, "metrics": m,
           "spec_decode": spec, "spec_decode_note": "" if spec is not None else metrics_note,
           "errors": sorted({r.error for r in results if not r.success}),
           "requests": [asdict(r) for r in results]}
    if not args.keep_text:
        for r in run["requests"]:
            r.pop("generated_text")
    print_report(run, pct)
    return run


# ---------------------------------------------------------------------------------------------- reports

W = 50


def _row(name: str, value, fmt: str = "") -> str:
    v = "n/a" if value is None else format(value, fmt)
    return f"{name:<40}{v}"


def print_report(run: dict, pct: list[float]) -> None:
    m = run["metrics"]
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=W, c="="),
             _row("Run:", run["label"]),
             _row("Maximum request concurrency:", run["concurrency"] or "unlimited"),
             _row("Request rate (req/s):", run["request_rate"]),
             _row("Successful requests:", m["completed"]),
             _row("Failed requests:", m["failed"]),
             _row("Benchmark duration (s):", m["duration_s"], ".2f"),
             _row("Total input tokens:", m["total_input_tokens"]),
             _row("Total generated tokens:", m["total_output_tokens"]),
             _row("Request throughput (req/s):", m["request_throughput"], ".2f"),
             _row("Output token throughput (tok/s):", m["output_throughput"], ".2f"),
             _row("Total Token throughput (tok/s):", m["total_token_throughput"], ".2f")]
    for key, title, short in (("ttft_ms", "Time to First Token", "TTFT"),
                              ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl_ms", "Inter-token Latency", "ITL"),
                              ("e2el_ms", "End-to-end Latency", "E2EL")):
        s = m[key]
        lines.append("{s:{c}^{n}}".format(s=title, n=W, c="-"))
        lines.append(_row(f"Mean {short} (ms):", s["mean"], ".2f"))
        lines.append(_row(f"Median {short} (ms):", s["median"], ".2f"))
        for p in pct:
            lines.append(_row(f"P{p:g} {short} (ms):", s[f"p{p:g}"], ".2f"))
    lines.append("{s:{c}^{n}}".format(s="Speculative Decoding", n=W, c="-"))
    sd = run["spec_decode"]
    if sd is None:
        lines.append(f"(not available: {run['spec_decode_note']})")
    else:
        lines += [_row("Acceptance rate (%):", sd["acceptance_rate"], ".2f"),
                  _row("Acceptance length:", sd["acceptance_length"], ".2f"),
                  _row("Drafts:", sd["num_drafts"]),
                  _row("Draft tokens:", sd["num_draft_tokens"]),
                  _row("Accepted tokens:", sd["num_accepted_tokens"])]
        if sd["per_position_acceptance"]:
            lines.append("Per-position acceptance (%):")
            for p, v in sd["per_position_acceptance"].items():
                lines.append(_row(f"  Position {p}:", v, ".2f"))
    lines.append("=" * W)
    if m["usage_missing"]:
        lines.append(f"warning: {m['usage_missing']} responses had no usage; their output tokens were "
                     "counted as streamed chunks and their input tokens as 0")
    if run["errors"]:
        lines.append(f"{m['failed']} failed requests; distinct errors:")
        lines += [f"  - {e[:500]}" for e in run["errors"][:10]]
    print("\n".join(lines), flush=True)


def comparison(spec_runs: list[dict], base_runs: list[dict]) -> list[dict]:
    rows = []
    by_c = {r["concurrency"]: r for r in base_runs}
    for s in spec_runs:
        b = by_c.get(s["concurrency"])
        if b is None:
            continue
        st, bt = s["metrics"]["output_throughput"], b["metrics"]["output_throughput"]
        stp, btp = s["metrics"]["tpot_ms"]["median"], b["metrics"]["tpot_ms"]["median"]
        sd = s["spec_decode"] or {}
        rows.append({"concurrency": s["concurrency"], "spec_output_throughput": st, "nospec_output_throughput": bt,
                     "speedup": st / bt if bt > 0 else None,
                     "spec_median_tpot_ms": stp, "nospec_median_tpot_ms": btp,
                     "tpot_speedup": btp / stp if stp > 0 else None,
                     "acceptance_length": sd.get("acceptance_length"),
                     "acceptance_rate": sd.get("acceptance_rate"),
                     "failed": s["metrics"]["failed"] + b["metrics"]["failed"]})
    return rows


def print_comparison(rows: list[dict]) -> None:
    def f(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    hdr = (f"{'Concurrency':>11} {'Spec tok/s':>11} {'No-spec tok/s':>14} {'Speedup':>8} "
           f"{'Spec TPOT ms':>13} {'No-spec TPOT ms':>16} {'Accept len':>11}")
    print("\n" + "{s:{c}^{n}}".format(s=" Speculative vs no-spec ", n=len(hdr), c="="))
    print(hdr)
    for r in rows:
        print(f"{r['concurrency'] or 'inf':>11} {r['spec_output_throughput']:>11.2f} "
              f"{r['nospec_output_throughput']:>14.2f} {f(r['speedup'], '.2f') + 'x':>8} "
              f"{r['spec_median_tpot_ms']:>13.2f} {r['nospec_median_tpot_ms']:>16.2f} "
              f"{f(r['acceptance_length'], '.2f'):>11}")
    print("(tok/s: output token throughput; TPOT: median; Accept len: 1 + accepted / drafts)")
    print("=" * len(hdr), flush=True)


async def discover_model(base_url: str) -> str | None:
    try:
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.get(base_url + "/v1/models")
        if r.status_code == 200:
            data = r.json().get("data") or []
            if data and data[0].get("id"):
                return data[0]["id"]
    except Exception:  # noqa: BLE001 - the model field is optional for eagle3-serve
        pass
    return None


async def probe(args, base_url: str, model: str | None, n_words: int, seed: int) -> RequestResult:
    prompt = random_words(random.Random(seed), n_words)
    body = build_payload(args, model, prompt, min(args.output_len, 8), seed)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout, connect=30.0)) as c:
        r = await send_request(c, base_url + "/v1/completions", body, -1)
    if not r.success:
        raise ServerError(f"probe request failed: {r.error}")
    return r


async def calibrate(args, base_url: str, model: str | None) -> tuple[int, dict]:
    """Words per prompt so that prompts come out near --input-len tokens of the server's tokenizer:
    two probes (which also warm the server up) fit tokens = overhead + per_word * words."""
    w1, w2 = max(2, args.input_len // 8), max(4, args.input_len // 4)  # small: stay inside prefill buckets
    r1 = await probe(args, base_url, model, w1, args.seed + 10_001)
    r2 = await probe(args, base_url, model, w2, args.seed + 10_002)
    info = {"probe_words": [w1, w2], "probe_prompt_tokens": [r1.prompt_tokens, r2.prompt_tokens]}
    if args.no_calibrate or not (r1.usage_reported and r2.usage_reported) or r2.prompt_tokens <= r1.prompt_tokens:
        info["tokens_per_word"], info["overhead_tokens"] = None, None
        return max(1, args.input_len), info
    per_word = (r2.prompt_tokens - r1.prompt_tokens) / (w2 - w1)
    overhead = max(0.0, r1.prompt_tokens - per_word * w1)
    info["tokens_per_word"], info["overhead_tokens"] = per_word, overhead
    return max(1, round((args.input_len - overhead) / per_word)), info


async def warmup(args, base_url: str, model: str | None) -> None:
    for i in range(2):
        await probe(args, base_url, model, max(2, args.input_len // 8), args.seed + 10_001 + i)


async def run_pass(args, base_url: str, label: str, state: dict) -> list[dict]:
    model = args.model or await discover_model(base_url)
    if "n_words" not in state:
        state["n_words"], state["calibration"] = await calibrate(args, base_url, model)
        cal = state["calibration"]
        print(f"prompts: {state['n_words']} words each (calibration: {cal})", flush=True)
        state["prompts"] = random_prompts(args.seed, args.num_prompts, state["n_words"])
    else:
        await warmup(args, base_url, model)
    runs = []
    for c in args.concurrency:
        runs.append(await run_level(args, base_url, model, state["prompts"], c,
                                    f"{label}, concurrency={c or 'unlimited'}"))
        runs[-1]["mode"], runs[-1]["model"] = label, model
    return runs


def parse_concurrency(s: str) -> list[int | None]:
    """1,4,inf: the concurrency levels (inf / 0 / none / unlimited: no limit)."""
    out: list[int | None] = []
    for part in s.split(","):
        part = part.strip().lower()
        if part in ("inf", "none", "0", "unlimited"):
            out.append(None)
        elif part:
            n = int(part)
            if n < 0:
                raise ValueError("concurrency must be >= 0")
            out.append(n)
    if not out:
        raise ValueError("empty --concurrency")
    return out


def eagle3_server(args, no_spec: bool, log_dir: Path) -> Server:
    """eagle3-serve on args.bundle (--no-spec, or its default speculation), with every --server-arg."""
    def cmd(port: int) -> list[str]:
        out = eagle3_serve(args.server_cmd) + [args.bundle, "--host", "127.0.0.1", "--port", str(port)]
        out += ["--no-spec"] if no_spec else []
        for a in args.server_arg or []:
            out += shlex.split(a)
        return out

    return Server(cmd, "nospec" if no_spec else "spec", log_dir)


def run(args, result: dict, state: dict, log_dir: Path) -> int:
    """Every pass into result["runs"]; 2 when a server does not start or answer, 1 when a request failed."""
    if args.base_url:
        result["runs"] += asyncio.run(run_pass(args, args.base_url, "server", state))
    else:
        result["server_logs"] = str(log_dir)
        for no_spec in (False, True):
            label = "no-spec" if no_spec else "spec"
            server = eagle3_server(args, no_spec, log_dir)
            result.setdefault("server_cmds", {})[label] = server.cmd
            try:
                server.start(args.server_timeout)
                result["runs"] += asyncio.run(run_pass(args, server.base_url, label, state))
            except ServerError as e:
                print(f"error ({label} server): {e}", file=sys.stderr)
                server.report_failure()
                return 2
            finally:
                server.stop()
        result["comparison"] = comparison([r for r in result["runs"] if r["mode"] == "spec"],
                                          [r for r in result["runs"] if r["mode"] == "no-spec"])
        print_comparison(result["comparison"])
    return 1 if any(r["metrics"]["failed"] for r in result["runs"]) else 0
