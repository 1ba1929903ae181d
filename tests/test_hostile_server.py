"""Hostile HTTP input against a real eagle3-serve process on loopback: each case gets a fast 4xx with
an OpenAI-style error that names the problem, and afterwards the server is healthy with its gauges
(eagle3_num_requests_running / waiting) back at 0 and no traceback in its log."""
import json
import random
import socket
import string
import threading
import time

import httpx
import pytest

from test_server import ServerProc

CAP = 1 << 20       # --max-body-bytes of this module's server
TIMEOUT = 1         # --timeout-keep-alive and --body-timeout (s)
LONG_PROMPT = "Once upon a time, in a land far away"  # greedy runs to max_tokens on the tiny pair


@pytest.fixture(scope="module")
def server(bundle):
    s = ServerProc(bundle, "--max-body-bytes", str(CAP), "--timeout-keep-alive", str(TIMEOUT),
                   "--body-timeout", str(TIMEOUT))
    yield s
    s.stop()


def metrics(url) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def assert_healthy(url, within: float = 5.0):
    """/health answers, and the engine's gauges are back at 0 (a cancelled request: within `within` s)."""
    assert httpx.get(url + "/health", timeout=2).status_code == 200
    deadline = time.time() + within
    while True:
        m = metrics(url)
        if m["eagle3_num_requests_running"] == 0 and m["eagle3_num_requests_waiting"] == 0:
            return
        assert time.time() < deadline, {k: v for k, v in m.items() if k.startswith("eagle3_num_requests")}
        time.sleep(0.05)


def post(url, path: str, body: bytes | dict, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=30, **kw)


def assert_error(r: httpx.Response, status: int, *words: str, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] and all(w in err["message"] for w in words), err
    if param is not None:
        assert err["param"] == param, err
    return err


def raw(url, timeout: float = 10.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    s.settimeout(timeout)
    return s


def read_all(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


# ------------------------------------------------------------------------------------ JSON content

SURROGATES = [
    ("prompt", "/v1/completions", rb'{"prompt": "ab\ud800cd", "max_tokens": 2}', "`prompt`", "prompt"),
    ("chat content", "/v1/chat/completions",
     rb'{"messages": [{"role": "user", "content": "hi \udfff"}], "max_tokens": 2}', "`messages.0.content`",
     "messages"),
    ("key", "/v1/completions", rb'{"prompt": "hi", "\udc00": 1}', "a key", None),
    ("model (echoed in errors)", "/v1/completions", rb'{"prompt": "hi", "model": "\ud800"}', "`model`", "model"),
]


@pytest.mark.parametrize("case", SURROGATES, ids=[c[0] for c in SURROGATES])
def test_lone_surrogate_400(server, case):
    _, path, body, where, param = case
    assert_error(post(server.url, path, body), 400, "surrogate", where, param=param)
    assert_healthy(server.url)


@pytest.mark.parametrize("depth", [100_000, 65])  # past Python's own recursion guard, and just past ours
def test_deep_json_400(server, depth):
    body = b'{"prompt": "hi", "x": ' + b"[" * depth + b"]" * depth + b"}"
    assert_error(post(server.url, "/v1/completions", body), 400, "nested deeper than 64")
    assert_healthy(server.url)


NUMBERS = [
    ("5001-digit integer", b"1" * 5001, "5001 characters"),
    ("200-digit float", b"0." + b"1" * 200, "202 characters"),
    ("NaN", b"NaN", "NaN is not valid JSON"),
    ("Infinity", b"-Infinity", "-Infinity is not valid JSON"),
    ("overflowing float", b"1e400", "finite number"),
]


@pytest.mark.parametrize("case", NUMBERS, ids=[c[0] for c in NUMBERS])
def test_number_limits_400(server, case):
    _, number, words = case
    t0 = time.perf_counter()
    r = post(server.url, "/v1/completions", b'{"prompt": "hi", "temperature": ' + number + b"}")
    assert_error(r, 400, words)
    assert time.perf_counter() - t0 < 2
    assert_healthy(server.url)


# ------------------------------------------------------------------------------------ sizes

def test_content_length_over_cap_413_at_once(server):
    """A 50 MB Content-Length is refused before its body is read: the 413 arrives while the client
    has sent 64 KiB, and /health answers meanwhile."""
    s = raw(server.url)
    t0 = time.perf_counter()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 50000000\r\n\r\n" + b"x" * 65536)
    head = s.recv(65536)
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
    assert time.perf_counter() - t0 < 2
    t1 = time.perf_counter()
    assert httpx.get(server.url + "/health", timeout=1).status_code == 200  # the upload is still "in flight"
    assert time.perf_counter() - t1 < 1
    s.close()
    # the same through an ordinary client, which sends the whole body and then reads the answer
    err = assert_error(post(server.url, "/v1/completions", b"x" * (3 * CAP)), 413, f"larger than {CAP} bytes",
                       "--max-body-bytes")
    assert err["code"] == "request_too_large"
    assert_healthy(server.url)


def test_clients_that_send_the_whole_body_first_read_the_413(server):
    """urllib says `Connection: close` and sends all 20 MB before reading: the server answers early,
    then lingers (half-closed, draining) instead of resetting the connection under it."""
    import urllib.error
    import urllib.request

    for _ in range(3):
        req = urllib.request.Request(server.url + "/v1/completions", data=b"x" * (20 << 20),
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 413 and b"--max-body-bytes" in e.value.read()
    assert_healthy(server.url)


def test_chunked_body_over_cap_413(server):
    """No Content-Length (chunked): the server counts bytes as they arrive and stops at the cap."""
    sent = []

    def chunks():
        for _ in range(40):  # 10 MiB unless the server stops reading
            sent.append(1)
            yield b"x" * (256 << 10)

    t0 = time.perf_counter()
    r = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=30)
    assert_error(r, 413, f"larger than {CAP} bytes")
    assert time.perf_counter() - t0 < 5
    t1 = time.perf_counter()
    assert httpx.get(server.url + "/health", timeout=1).status_code == 200
    assert time.perf_counter() - t1 < 1
    assert_healthy(server.url)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "word " * 100_000, "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 100_000}], "max_tokens": 2}),
], ids=["prompt", "chat"])
def test_prompt_far_over_max_model_len_refused_untokenized(server, path, body):
    t0 = time.perf_counter()
    r = post(server.url, path, body)
    assert_error(r, 400, "500000 characters", "max_model_len 256")
    assert time.perf_counter() - t0 < 1
    assert_healthy(server.url)


# ------------------------------------------------------------------------------------ types and fields

STRICT = [
    ("prompt of bools", {"prompt": [True, False]}, "prompt", "got true"),
    ("prompt of floats", {"prompt": [1.0, 2.0]}, "prompt", "got 1.0"),
    ("prompt null", {"prompt": None}, "prompt", "got null"),
    ("max_tokens true", {"prompt": "hi", "max_tokens": True}, "max_tokens", "valid integer"),
    ("max_tokens float", {"prompt": "hi", "max_tokens": 4.0}, "max_tokens", "valid integer"),
    ("stream yes", {"prompt": "hi", "stream": "yes"}, "stream", "valid boolean"),
    ("stream 1", {"prompt": "hi", "stream": 1}, "stream", "valid boolean"),
    ("temperature string", {"prompt": "hi", "temperature": "0.5"}, "temperature", "valid number"),
    ("top_k float", {"prompt": "hi", "top_k": 1.5}, "top_k", "valid integer"),
    ("seed true", {"prompt": "hi", "seed": True}, "seed", "valid integer"),
    ("stop of ints", {"prompt": "hi", "stop": ["a", 7]}, "stop", "stop.1"),
    ("too many stops", {"prompt": "hi", "stop": ["s"] * 17}, "stop", "at most 16"),
    ("n 2", {"prompt": "hi", "n": 2}, "n", "n=1"),
]


@pytest.mark.parametrize("case", STRICT, ids=[c[0] for c in STRICT])
def test_strict_types_400(server, case):
    _, body, param, words = case
    assert_error(post(server.url, "/v1/completions", body), 400, words, param=param)
    assert_healthy(server.url)


CHAT = [{"role": "user", "content": "hi"}]
UNSUPPORTED = [
    ("/v1/completions", {"prompt": "hi", "logprobs": 1}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "hi", "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "suffix": "end"}, "suffix"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": 1}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"7": 100}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "ignore_eos": True}, "ignore_eos"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options"),
    ("/v1/completions", {"prompt": "hi", "frobnicate": 1}, "frobnicate"),
]


@pytest.mark.parametrize("case", UNSUPPORTED, ids=[("chat-" if "chat" in c[0] else "") + c[2] for c in UNSUPPORTED])
def test_unimplemented_fields_400(server, case):
    path, body, field = case
    assert_error(post(server.url, path, body), 400, f"`{field}", "leave it out", param=field)
    assert_healthy(server.url)


def test_harmless_fields_accepted(server):
    """Fields that ask for nothing (null / the default) are fine, as with OpenAI's and vLLM's servers."""
    harmless = {"logprobs": None, "echo": False, "n": 1, "best_of": 1, "user": "u-1", "presence_penalty": 0,
                "frequency_penalty": 0.0, "logit_bias": {}, "suffix": None}
    r = post(server.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **harmless})
    assert r.status_code == 200, r.text
    r = post(server.url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "logprobs": False, "tools": [],
                                                  "response_format": {"type": "text"}, "tool_choice": "none"})
    assert r.status_code == 200, r.text
    r = post(server.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True,
                                             "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
    assert_healthy(server.url)


# ------------------------------------------------------------------------------------ connections

def test_nonstreaming_client_disconnect_cancels(server):
    """A non-streaming client that leaves mid-generation: its sequence is aborted at once (a few
    tokens, not the 230 asked for) and its row freed."""
    before = metrics(server.url)
    body = json.dumps({"prompt": LONG_PROMPT, "max_tokens": 230, "temperature": 0}).encode()
    s = raw(server.url)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    deadline = time.time() + 10
    while metrics(server.url)["eagle3_num_requests_running"] != 1:
        assert time.time() < deadline, "the request never started"
        time.sleep(0.02)
    s.close()
    assert_healthy(server.url, within=1.5)
    after = metrics(server.url)
    abort = 'eagle3_request_success_total{finished_reason="abort"}'
    assert after[abort] - before.get(abort, 0) == 1
    assert after["eagle3_generation_tokens_total"] - before["eagle3_generation_tokens_total"] < 115


def test_unknown_paths_do_not_add_metric_series(server):
    def series() -> set[str]:
        return {k for k in metrics(server.url) if k.startswith("eagle3_http_requests_total")}

    first = series()
    rnd = random.Random(0)
    paths = ["/" + "".join(rnd.choices(string.ascii_lowercase, k=12)) for _ in range(500)]
    with httpx.Client(base_url=server.url, timeout=10) as c:
        for p in paths:
            r = c.get(p)
            assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found"
    grown = series() - first
    assert len(grown) <= 1 and all('endpoint="other"' in k for k in grown), grown  # one series for all of them
    assert not any(p in k for k in series() for p in paths)
    assert_healthy(server.url)


def test_idle_connection_closed(server):
    s = raw(server.url, timeout=TIMEOUT + 4)
    t0 = time.perf_counter()
    assert s.recv(100) == b""  # closed by the server, nothing sent
    assert time.perf_counter() - t0 < TIMEOUT + 2
    s.close()
    assert_healthy(server.url)


def test_slowloris_headers_closed(server):
    """A client that dribbles its request head a byte at a time is cut off after --timeout-keep-alive."""
    s = raw(server.url)
    t0 = time.perf_counter()
    with pytest.raises(OSError):
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        for _ in range(40):  # 10 s of dribbling unless the server hangs up
            time.sleep(0.25)
            s.sendall(b"X")
    assert time.perf_counter() - t0 < TIMEOUT + 3
    s.close()
    assert_healthy(server.url)


def test_responses_outlive_the_connection_timeouts(server):
    """The head timer stops once a request has arrived: a stream longer than --timeout-keep-alive
    finishes, and a kept-alive connection serves a second request."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 234, "temperature": 0,
                                                       "stream": True}) as r:
            lines = r.iter_lines()
            first = next(lines)
            time.sleep(TIMEOUT + 0.5)  # a slow reader: the response spans the timeout
            rest = [line for line in lines if line.startswith("data: ")]
        assert first.startswith("data: ") and rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["usage"]["completion_tokens"] == 234
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert_healthy(server.url)


def test_slow_body_408(server):
    s = raw(server.url)
    t0 = time.perf_counter()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b'Content-Length: 100\r\n\r\n{"prompt": ')
    reply = read_all(s)  # the 408, then the server closes the connection
    assert time.perf_counter() - t0 < TIMEOUT + 2
    s.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower(), reply
    assert "did not arrive within 1 s" in json.loads(body)["error"]["message"]
    assert_healthy(server.url)


def test_concurrent_hostile_mix_then_normal_request(server):
    """Some of the above at once; then an ordinary request still works and the gauges settle at 0."""
    bodies = [rb'{"prompt": "\ud800"}', b"[" * 50_000, b"x" * (2 * CAP), b'{"prompt": [true]}',
              b'{"prompt": "hi", "max_tokens": ' + b"9" * 5001 + b"}"]
    codes = []
    threads = [threading.Thread(target=lambda b=b: codes.append(post(server.url, "/v1/completions", b).status_code))
               for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(codes) == [400, 400, 400, 400, 413]
    r = post(server.url, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert_healthy(server.url)


def test_server_log_has_no_traceback(server):
    """Last: nothing above reached the server's exception logging (a 500 would have)."""
    log = open(server.log.name).read()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
    m = metrics(server.url)
    assert not any(k.startswith("eagle3_http_requests_total") and 'status="5' in k for k in m), m
