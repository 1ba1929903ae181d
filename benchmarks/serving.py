"""Servers on free loopback ports (eagle3-serve, vLLM, ...), one streamed chat completion, the spec-decode
counters of /metrics, and `seeded-repro`: do seeded sampled requests reproduce on a busy server?"""
from __future__ import annotations

import concurrent.futures
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from eagle3_runtime.spec_counters import parse_prometheus, spec_counters, spec_delta


class ServerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def eagle3_serve(cmd: str | None = None) -> list[str]:
    """The eagle3-serve command: `cmd` shell-split, else this interpreter's eagle3_runtime.server."""
    return shlex.split(cmd) if cmd else [sys.executable, "-m", "eagle3_runtime.server"]


def tail(path: Path, n: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


class Server:
    """A server command (`make_cmd(port)`) in its own process group on a free loopback port, logs to files;
    stop() is idempotent."""

    def __init__(self, make_cmd, tag: str, log_dir: Path, env: dict | None = None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.cmd = make_cmd(self.port)
        self.env = env
        self.stdout_path = log_dir / f"server-{tag}.stdout.log"
        self.stderr_path = log_dir / f"server-{tag}.stderr.log"
        self.proc: subprocess.Popen | None = None
        self.start_s: float | None = None  # (seconds to a healthy /health)
        self.spin: dict | None = None  # (spin_after_request's, where measured)

    def start(self, timeout: float) -> None:
        print(f"starting: {shlex.join(self.cmd)}", file=sys.stderr, flush=True)
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            try:
                self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                             start_new_session=True, env=self.env)
            except OSError as e:
                raise ServerError(f"could not start {self.cmd[0]!r}: {e}") from None
        t0 = time.monotonic()
        last = ""
        with httpx.Client(timeout=5.0) as c:
            while True:
                rc = self.proc.poll()
                if rc is not None:
                    raise ServerError(f"server exited with status {rc} before becoming healthy")
                try:
                    r = c.get(self.base_url + "/health")
                    if r.status_code == 200:
                        break
                    last = f"HTTP {r.status_code}"
                except httpx.HTTPError as e:
                    last = type(e).__name__
                if time.monotonic() - t0 > timeout:
                    raise ServerError(f"server not healthy after {timeout:.0f}s (last /health: {last})")
                time.sleep(0.5)
        self.start_s = round(time.monotonic() - t0, 1)
        print(f"server healthy at {self.base_url} after {self.start_s}s", file=sys.stderr, flush=True)

    def stop(self, grace: float = 15.0) -> None:
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(p.pid, sig)  # the whole group: TP launchers spawn workers
            except ProcessLookupError:
                return
            try:
                p.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                if sig == signal.SIGTERM:
                    print(f"server pid {p.pid} ignored SIGTERM for {grace:.0f}s; killing", file=sys.stderr)
        try:  # workers left in the group after the leader exited
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def report_failure(self) -> None:
        print(f"--- server stderr (tail, {self.stderr_path}) ---", file=sys.stderr)
        print(tail(self.stderr_path) or "(empty)", file=sys.stderr)
        out = tail(self.stdout_path, 15)
        if out:
            print(f"--- server stdout (tail, {self.stdout_path}) ---", file=sys.stderr)
            print(out, file=sys.stderr)


def chat_stream(client: httpx.Client, url: str, model: str, text: str, max_tokens: int) -> dict:
    """One streamed greedy chat completion: text, completion tokens, TTFT and e2e seconds."""
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


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds used so far by the live processes of a process group (Linux /proc)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # (after the command name: state, ppid, pgrp, ...)
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


SPINNING = 0.5  # cores: a spinning thread takes a whole one; a server's housekeeping takes a tick (0.1) now and then


def spin_after_request(c: httpx.Client, server: Server, model: str, window: float = 6.0, step: float = 0.1,
                       idle: float = SPINNING) -> dict:
    """After one short request ends, the server's CPU use (cores) every `step` s for `window` s: spin_s, the
    time until it stays below `idle` cores (an idle server's threads spinning on)."""
    chat_stream(c, server.base_url, model, "Say hello.", 32)
    t0 = time.monotonic()
    last, samples = group_cpu_seconds(server.proc.pid), []
    while time.monotonic() - t0 < window:
        time.sleep(step)
        now = group_cpu_seconds(server.proc.pid)
        samples.append((time.monotonic() - t0, (now - last) / step))
        last = now
    busy = [t for t, cores in samples if cores > idle]
    return {"spin_s": round(busy[-1], 2) if busy else 0.0, "cores_per_step": [round(x, 2) for _, x in samples],
            "step_s": step}


def counters(client: httpx.Client, base_url: str) -> tuple[dict | None, str]:
    """The spec-decode counters of /metrics (eagle3 or vLLM names) and the whole text."""
    text = client.get(base_url + "/metrics").text
    return spec_counters(parse_prometheus(text)), text


def warm(c: httpx.Client, server: Server) -> tuple[str, dict]:
    """A server's model name after one unmeasured request, and its spec-decode counters then."""
    model = c.get(server.base_url + "/v1/models").json()["data"][0]["id"]
    chat_stream(c, server.base_url, model, "Say hello.", 8)
    return model, counters(c, server.base_url)[0]


def finish_pass(c: httpx.Client, server: Server, reqs: list[dict], before: dict) -> dict:
    """One pass: its requests, the counters' change since `before`, the speculation shape being served."""
    after, text = counters(c, server.base_url)
    choice = [line for line in text.splitlines()
              if line.startswith("eagle3_speculation_shape{") and line.endswith(" 1.0")]
    return {"requests": reqs, "spec": spec_delta(before, after), "speculation": choice, "start_s": server.start_s,
            "spin": server.spin}


# ------------------------------------------------------------------------------------------------ seeded-repro

def _ask(url: str, prompt: str, seed: int, chat: bool, sampling: dict) -> list[int]:
    body = {**sampling, "seed": seed}
    if chat:
        r = httpx.post(url + "/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": prompt}]},
                       timeout=600)
    else:
        r = httpx.post(url + "/v1/completions", json={**body, "prompt": prompt}, timeout=600)
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def seeded_repro(bundle: Path, pool: list[str], num: int, chat: bool, sampling: dict, server_args: list[str],
                 server_cmd: str | None) -> dict:
    """N seeded requests (seeds 1..N, prompts cycled) each sent alone, then all again two at a time (a pool of
    2 clients: they share batch rows and the shape `auto` serves then); every answer's token ids compared."""
    cases = [(pool[i % len(pool)], i + 1) for i in range(num)]
    log_dir = Path(tempfile.mkdtemp(prefix="seeded_repro_"))
    server = Server(lambda port: eagle3_serve(server_cmd) + [str(bundle), "--port", str(port), *server_args],
                    "seeded", log_dir)
    try:
        server.start(600)
    except ServerError as e:
        server.stop()
        print(f"error: the server did not start ({e}); its log: {server.stderr_path}", file=sys.stderr)
        sys.exit(2)
    try:
        t0 = time.perf_counter()
        alone = [_ask(server.base_url, p, s, chat, sampling) for p, s in cases]
        t1 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(2) as clients:
            paired = list(clients.map(lambda c: _ask(server.base_url, *c, chat, sampling), cases))
        t2 = time.perf_counter()
        metrics = httpx.get(server.base_url + "/metrics", timeout=10).text
    finally:
        server.stop()
    differ = []
    for i, (x, y) in enumerate(zip(alone, paired)):
        if x != y:
            at = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            differ.append({"request": i, "seed": cases[i][1], "first_difference": at, "alone_tokens": len(x),
                           "paired_tokens": len(y)})
    shapes = sorted({ln.split('shape="')[1].split('"')[0] for ln in metrics.splitlines()
                     if ln.startswith("eagle3_spec_decode_shape_num_drafts_total{")})
    return {"benchmark": "seeded-repro", "bundle": str(bundle), "server_args": server_args, "chat": chat,
            "num_requests": len(cases), "sampling": sampling, "reproduced": len(cases) - len(differ),
            "differ": differ, "shapes_served": shapes,
            "seconds": {"alone": round(t1 - t0, 1), "two_at_a_time": round(t2 - t1, 1)},
            "distinct_answers": len({tuple(x) for x in alone})}
