"""A real eagle3-serve process on loopback: concurrency, chat, bad input, disconnects, metrics, queue."""
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import free_port

PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away", "def main():\n    print(", "1, 2, 3, 4,"]


class ServerProc:
    def __init__(self, bundle: Path | str, *args: str, torchrun: int = 0, log_dir: Path | None = None):
        self.port, self.bundle = free_port(), Path(bundle)
        self.url = f"http://127.0.0.1:{self.port}"
        cli = ["-m", "eagle3_runtime.server", str(bundle), "--port", str(self.port), *args]
        if torchrun:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(torchrun),
                   "--master-port", str(free_port()), *cli]
        else:
            cmd = [sys.executable, *cli]
        self.log = open((log_dir or Path(bundle).parent) / f"server-{self.port}.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, OMP_NUM_THREADS="1"))
        wait_healthy(self.url, 240, lambda: self.proc.poll() is not None and Path(self.log.name).read_text()[-3000:])

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def wait_healthy(url: str, timeout: float = 30, exited=lambda: False) -> None:
    """Until `url`/health answers 200; `exited()` -> the server's log once it has died (then RuntimeError)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        log = exited()
        if log is not False:
            raise RuntimeError(f"server exited: {log}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("server did not become healthy")


@pytest.fixture(scope="module")
def server(bundle):
    s = ServerProc(bundle)
    yield s
    s.stop()


def complete(url, **body):
    r = httpx.post(url + "/v1/completions", json={"temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream_tokens(url, prompt, max_tokens, out: dict, key):
    toks, text = [], ""
    with httpx.stream("POST", url + "/v1/completions", timeout=120,
                      json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                c = json.loads(line[6:])["choices"][0]
                toks += c["token_ids"]
                text += c["text"]
    out[key] = (toks, text)


def test_concurrent_streams_match_solo_greedy(server):
    solo = {p: complete(server.url, prompt=p, max_tokens=24)["choices"][0] for p in PROMPTS}
    out: dict = {}
    threads = [threading.Thread(target=stream_tokens, args=(server.url, p, 24, out, p)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in PROMPTS:
        assert out[p][0] == solo[p]["token_ids"], p
        assert out[p][1] == solo[p]["text"], p


def test_solo_greedy_matches_transformers(server, tiny_pair):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = tiny_pair().parent / "target"  # the `bundle` fixture's pair
    hf, tok = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32), AutoTokenizer.from_pretrained(target)
    ids = tok(PROMPTS[1])["input_ids"]
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    assert complete(server.url, prompt=PROMPTS[1], max_tokens=24)["choices"][0]["token_ids"] == ref


def test_a_prompt_past_the_largest_bucket_runs_beside_a_stream(server):
    """A prompt longer than the largest prefill bucket (64), admitted while another stream decodes: each gives
    what it gives alone (the continuation runs the batch-2 verify graph beside the other row's pending token)."""
    long = "The quick brown fox jumps over the lazy dog. " * 5
    solo_long = complete(server.url, prompt=long, max_tokens=16)
    assert 64 < solo_long["usage"]["prompt_tokens"] < 200
    solo = complete(server.url, prompt=PROMPTS[1], max_tokens=120)["choices"][0]
    out: dict = {}
    t = threading.Thread(target=stream_tokens, args=(server.url, PROMPTS[1], 120, out, "a"))
    t.start()
    time.sleep(0.3)
    both = complete(server.url, prompt=long, max_tokens=16)["choices"][0]
    t.join()
    assert both["token_ids"] == solo_long["choices"][0]["token_ids"] and out["a"][0] == solo["token_ids"]


def test_chat_applies_template(server, tiny_pair):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    tok = AutoTokenizer.from_pretrained(tiny_pair().parent / "target")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": messages, "max_tokens": 10, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["usage"]["prompt_tokens"] == len(ids)
    same = complete(server.url, prompt=list(ids), max_tokens=10)["choices"][0]
    assert body["choices"][0]["token_ids"] == same["token_ids"]
    assert body["choices"][0]["message"] == {"role": "assistant", "content": same["text"]}


BAD = [
    ("malformed json", "{bad", 400, None),
    ("unknown model", {"model": "nope", "prompt": "hi"}, 404, "model"),
    ("missing prompt", {"max_tokens": 3}, 400, "prompt"),
    ("max_tokens zero", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens too large", {"prompt": "hi", "max_tokens": 10_000}, 400, "max_tokens"),
    ("prompt text over max_model_len", {"prompt": "word " * 400, "max_tokens": 3}, 400, "prompt"),
    ("prompt token ids over max_model_len", {"prompt": [5] * 300, "max_tokens": 3}, 400, "prompt"),
    ("negative temperature", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("top_p zero", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("top_p above one", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("wrong type", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
]


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_input_4xx(server, case):
    _, body, status, param = case
    kw = {"content": body} if isinstance(body, str) else {"json": body}
    r = httpx.post(server.url + "/v1/completions", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["param"] == param
    assert httpx.get(server.url + "/health").status_code == 200  # nothing crashed


def test_disconnect_frees_slot(server):
    """Two long streams hold both rows; dropping one lets a new request run while the other continues."""
    url = server.url
    finished = {}

    def long_stream(key):
        stream_tokens(url, PROMPTS[0], 200, {}, key)
        finished[key] = time.perf_counter()

    b = threading.Thread(target=long_stream, args=("b",))
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", url + "/v1/completions",
                      json={"prompt": PROMPTS[1], "max_tokens": 200, "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)  # A is running
            b.start()
            time.sleep(0.5)  # B is running too: both rows busy
        # A's connection is closed here
    r = complete(url, prompt=PROMPTS[2], max_tokens=4)
    done_c = time.perf_counter()
    assert r["choices"][0]["finish_reason"] == "length"
    b.join()
    assert done_c < finished["b"], "the new request had to wait for B: A's row was not freed"
    metrics = httpx.get(url + "/metrics").text
    assert 'eagle3_request_success_total{finished_reason="abort"} 1.0' in metrics


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def test_metrics_match_requests(server):
    before = parse_metrics(httpx.get(server.url + "/metrics").text)
    results = [complete(server.url, prompt=p, max_tokens=12) for p in PROMPTS[:3]]
    after = parse_metrics(httpx.get(server.url + "/metrics").text)
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    assert d['eagle3_request_success_total{finished_reason="length"}'] == 3
    assert d["eagle3_generation_tokens_total"] == sum(r["usage"]["completion_tokens"] for r in results)
    assert d["eagle3_prompt_tokens_total"] == sum(r["usage"]["prompt_tokens"] for r in results)
    drafts, accepted = d["eagle3_spec_decode_num_drafts_total"], d["eagle3_spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and d["eagle3_spec_decode_num_draft_tokens_total"] == 3 * drafts
    per_pos = [d[f'eagle3_spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] for i in range(3)]
    assert sum(per_pos) == accepted and per_pos[0] >= per_pos[1] >= per_pos[2]
    assert d['eagle3_http_requests_total{endpoint="/v1/completions",status="200"}'] == 3
    assert after['eagle3_speculation_shape{bucket="1",shape="chain K 3"}'] == 1  # (EAGLE3_SPECULATION=always)
    # target passes: every generated token beyond the first came from a verify/decode pass
    steps = d['eagle3_step_latency_seconds_count{kind="speculative"}'] + d.get(
        'eagle3_step_latency_seconds_count{kind="decode"}', 0)
    assert steps > 0 and after["eagle3_num_requests_running"] == 0 and after["eagle3_num_requests_waiting"] == 0
    # per-graph latency: one target_prefill per request, one verify and one (unrolled) draft call per round
    calls = {k.split("{")[1].rstrip("}"): v for k, v in d.items() if k.startswith("eagle3_graph_latency_seconds_count")}
    assert sum(v for k, v in calls.items() if 'role="target_prefill"' in k) == 3
    assert sum(v for k, v in calls.items() if 'role="target_verify"' in k) == drafts
    assert sum(v for k, v in calls.items() if 'role="draft_chain"' in k) == drafts
    # the warm-up at start-up timed every graph once on this host
    manifest = json.loads((server.bundle / "manifest.json").read_text())
    warm = {k for k, v in after.items() if k.startswith("eagle3_graph_warmup_seconds{") and v > 0}
    assert warm == {f'eagle3_graph_warmup_seconds{{bucket="{g["bucket"]}",role="{g["role"]}"}}'
                    for g in manifest["graphs"]}, warm


def test_queue_full_503(bundle):
    """--max-queue 0: with both sequence slots busy the next request gets 503 + Retry-After at once."""
    s = ServerProc(bundle, "--max-queue", "0")
    try:
        with httpx.Client(timeout=120) as c:
            body = {"max_tokens": 220, "temperature": 0, "stream": True}
            # (keep the line iterators alive: a dropped httpx iterator closes its connection)
            with c.stream("POST", s.url + "/v1/completions", json={"prompt": PROMPTS[0], **body}) as a:
                lines_a = a.iter_lines()
                next(lines_a)
                with c.stream("POST", s.url + "/v1/completions", json={"prompt": PROMPTS[1], **body}) as b:
                    lines_b = b.iter_lines()
                    next(lines_b)  # both rows busy
                    r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
                    assert r.status_code == 503 and r.headers["retry-after"] == "1"
                    assert r.json()["error"]["code"] == "queue_full"
        # capacity is back once the streams are gone
        deadline = time.time() + 30
        while True:
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
            if r.status_code == 200 or time.time() > deadline:
                break
            time.sleep(0.2)
        assert r.status_code == 200
    finally:
        s.stop()


def test_tp2_server_under_torchrun(built_bundle, server):
    """A TP-2 bundle served by torchrun (rank 0 serves HTTP, rank 1 follows): concurrent requests (a
    chain at batch 2), one finishing early so the other's KV row moves (a broadcast row copy), then a
    tree at batch 1, match TP 1 solo greedy."""
    from test_tree_engine import MIXED

    tp2 = built_bundle(recipe=MIXED, tp=2).path  # (test_tree_lossless.py decodes 20 prompts through it)
    solo = {p: complete(server.url, prompt=p, max_tokens=n)["choices"][0]["token_ids"]
            for p, n in ((PROMPTS[0], 6), (PROMPTS[1], 40))}
    s = ServerProc(tp2, torchrun=2)
    try:
        out: dict = {}
        threads = [threading.Thread(target=stream_tokens, args=(s.url, p, n, out, p))
                   for p, n in ((PROMPTS[0], 6), (PROMPTS[1], 40))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for p in solo:
            assert out[p][0] == solo[p], p
    finally:
        s.stop()


def test_stop_string_ends_sequence(server):
    full = complete(server.url, prompt=PROMPTS[3], max_tokens=30)["choices"][0]
    text = full["text"]
    stop = text[8:12]
    assert stop and stop in text
    cut = text.index(stop)
    got = complete(server.url, prompt=PROMPTS[3], max_tokens=30, stop=[stop, "never-appears"])["choices"][0]
    assert got["finish_reason"] == "stop" and got["text"] == text[:cut]
    # streamed, the stop string is never sent, not even partly
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": PROMPTS[3], "max_tokens": 30, "temperature": 0, "stream": True,
                            "stop": stop}) as r:
        streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                           if line.startswith("data: {"))
    assert streamed == text[:cut]


def test_auto_speculation_reports_its_choice(bundle, server):
    """--speculation auto: the server times its graphs at start, prints per batch bucket what it serves and
    why, exposes the choice and every candidate's expected rate in /metrics, and answers with the same
    greedy tokens as a server that always speculates."""
    auto = ServerProc(bundle, "--speculation", "auto")
    try:
        got = complete(auto.url, prompt=PROMPTS[1], max_tokens=16, temperature=0)
        metrics = parse_metrics(httpx.get(auto.url + "/metrics").text)
    finally:
        auto.stop()
    log = Path(auto.log.name).read_text()
    for b in (1, 2):
        assert f"speculation at batch {b}: " in log and " tok/s per sequence" in log
        served = [k for k, v in metrics.items() if k.startswith(f'eagle3_speculation_shape{{bucket="{b}"') and v == 1]
        assert len(served) == 1, metrics
        for shape in ("none", "chain K 3"):
            assert metrics[f'eagle3_speculation_expected_tokens_per_second{{bucket="{b}",shape="{shape}"}}'] > 0
    assert got["choices"][0]["text"] == complete(server.url, prompt=PROMPTS[1], max_tokens=16, temperature=0)["choices"][0]["text"]
