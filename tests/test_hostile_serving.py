"""A server that keeps serving through its own failures and a hostile bundle's chat template, and ends when
told to: an engine error is a 500 for its request and the next request is served; an engine that cannot go
on answers 503 and the server exits 1; a template that loops, allocates or refuses is a 400 for that request,
in bounded time, while other requests are served; SIGTERM ends the server within 5 s; a bad --host / --port,
a port in use, a broken template or Ctrl-C at start-up are one line."""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from conftest import free_port, run_cli
from test_hostile_bundle import rehash
from test_server import ServerProc, wait_healthy

PROMPT = "Once upon a time, in a land far away"  # greedy runs to max_tokens on the tiny pair
SERVE = [sys.executable, "-c", "import sys; from eagle3_runtime.launch import serve; sys.argv[0] = 'eagle3-serve'; "
         "serve()"]


# ------------------------------------------------------------------ engine failures (a server in this process)

@pytest.fixture(scope="module")
def loaded(bundle):
    from eagle3_runtime.bundle import Bundle

    b = Bundle(bundle)
    b.warm_up()
    return b


class Flaky:
    """A graph whose next `times` calls raise (math.inf: every call)."""

    def __init__(self, graph, times: float):
        self.graph, self.times, self.entry = graph, times, graph.entry

    def __call__(self, *inputs):
        if self.times > 0:
            self.times -= 1
            raise RuntimeError(f"injected fault in {self.entry.name}")
        return self.graph(*inputs)


@contextmanager
def serving(b, faults: dict[str, float]):
    """eagle3-serve's Server and serve() on a loopback port, with graphs of `b` made to fail."""
    from eagle3_runtime.server import Server, bind, serve

    real = dict(b.loaded.graphs)
    for name, g in real.items():
        if name in faults:
            b.loaded.graphs[name] = Flaky(g, faults[name])
    server = Server(b)
    sock = bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    status: list[int] = []
    thread = threading.Thread(target=lambda: status.append(serve(server, sock)), daemon=True)
    thread.start()
    try:
        yield url, server, status, thread
    finally:
        if server.uvicorn is not None:
            server.uvicorn.should_exit = True
        thread.join(10)
        b.loaded.graphs.update(real)


def complete(url, prompt=PROMPT, max_tokens=8, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                     **kw}, timeout=60)


def test_an_engine_error_fails_its_request_and_the_next_is_served(loaded):
    with serving(loaded, {"target_verify_b1": 1}) as (url, server, status, _):
        wait_healthy(url)
        r = complete(url)
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["code"] == "engine_error" and "injected fault in target_verify_b1" in err["message"]
        ok = complete(url)
        assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 8
        assert complete(url).json()["choices"][0]["token_ids"] == ok.json()["choices"][0]["token_ids"]
        # a stream whose step fails: the error arrives in the stream, which still ends with [DONE]
        loaded.loaded.graphs["target_verify_b1"].times = 1
        r = complete(url, stream=True)
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert r.status_code == 200 and events[-1] == "[DONE]"
        assert "injected fault" in json.loads(events[-2])["error"]["message"]
        assert httpx.get(url + "/health").status_code == 200
        assert complete(url).status_code == 200
        metrics = httpx.get(url + "/metrics").text
        assert 'eagle3_request_success_total{finished_reason="error"} 2.0' in metrics
        assert "eagle3_num_requests_running 0.0" in metrics
    assert status == [0]


def test_an_engine_that_cannot_go_on_stops_and_the_server_exits_1(loaded):
    import asyncio

    from eagle3_runtime.protocol import APIError
    from eagle3_runtime.sampling import SamplingParams

    faults = {g.entry.name: math.inf for g in loaded.loaded.graphs.values() if g.entry.role == "target_prefill"}
    with serving(loaded, faults) as (url, server, status, thread):
        wait_healthy(url)
        for _ in range(3):  # MAX_CONSECUTIVE_FAILURES failed steps in a row: each request gets its 500
            r = complete(url)
            assert r.status_code == 500 and "injected fault" in r.text, r.text
        try:  # the server is on its way out: a late request is refused (503) or finds it gone
            r = complete(url)
            assert r.status_code == 503 and "engine stopped" in r.text, r.text
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):  # (gone, or going mid-request)
            pass
        thread.join(10)
        assert not thread.is_alive() and status == [1]
        assert server.engine.dead and "3 steps failed in a row" in server.engine.dead and not server.healthy
        with pytest.raises(APIError) as e:
            server.submit([1, 2, 3], 4, SamplingParams(temperature=0.0), (), asyncio.new_event_loop())
        assert e.value.status == 503 and "engine stopped" in e.value.message


# ------------------------------------------------------------------ chat templates from the bundle

HOSTILE = ("{% for m in messages %}"
           "{% if 'LOOP' in m.content %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
           "{% endfor %}{% endif %}"
           "{% if 'HOG' in m.content %}{{ m.content * 1000000000 }}{% endif %}"
           "{% if 'RAISE' in m.content %}{{ raise_exception('role ' + m.role + ' is not supported') }}{% endif %}"
           "<|{{ m.role }}|>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def with_template(good: Path, dst: Path, template=None, config_text: str | None = None) -> Path:
    """A copy of the bundle whose tokenizer_config.json carries `template` (or is `config_text`), re-digested."""
    shutil.copytree(good, dst)
    cfg = dst / "tokenizer" / "tokenizer_config.json"
    if config_text is None:
        data = json.loads(cfg.read_text())
        data["chat_template"] = template
        config_text = json.dumps(data)
    cfg.write_text(config_text)
    rehash(dst)
    return dst


def chat(url, content: str, timeout: float = 60) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=timeout,
                      json={"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0})


def test_hostile_templates_are_refused_per_request_while_others_are_served(bundle, tmp_path):
    b = with_template(bundle, tmp_path / "b", HOSTILE)
    s = ServerProc(b, log_dir=tmp_path)
    try:
        assert chat(s.url, "hello").status_code == 200
        r = chat(s.url, "RAISE")
        assert r.status_code == 400 and "role user is not supported" in r.json()["error"]["message"]
        r = chat(s.url, "HOG")
        assert r.status_code == 400 and "MiB" in r.json()["error"]["message"], r.text
        # six looping renders at once (the report: six filled the pool and every endpoint hung)
        answers: list = []
        t0 = time.perf_counter()
        loops = [threading.Thread(target=lambda: answers.append((chat(s.url, "LOOP"), time.perf_counter() - t0)))
                 for _ in range(6)]
        for t in loops:
            t.start()
        time.sleep(0.5)
        for _ in range(3):  # meanwhile the server answers everything else at once
            t1 = time.perf_counter()
            assert complete(s.url, max_tokens=4).status_code == 200
            assert httpx.get(s.url + "/v1/models", timeout=5).status_code == 200
            assert time.perf_counter() - t1 < 3
        for t in loops:
            t.join(60)
        assert [r.status_code for r, _ in answers] == [400] * 6, [r.text for r, _ in answers]
        assert all("took longer than 3 s" in r.json()["error"]["message"] for r, _ in answers)
        assert max(secs for _, secs in answers) < 20  # 3 rounds of 2 workers x 3 s, and their restarts
        assert chat(s.url, "hello again").status_code == 200
        # SIGTERM with a looping render and a stream in flight: the server is gone within 5 s
        pending = [threading.Thread(target=lambda: _quietly(lambda: chat(s.url, "LOOP"))),
                   threading.Thread(target=lambda: _quietly(lambda: complete(s.url, max_tokens=200, stream=True)))]
        for t in pending:
            t.start()
        time.sleep(0.5)
        t0 = time.perf_counter()
        s.proc.terminate()
        s.proc.wait(10)
        assert time.perf_counter() - t0 < 5
    finally:
        s.stop()
    log = Path(s.log.name).read_text()
    assert "Traceback" not in log, log[-3000:]


def _quietly(fn):
    try:
        fn()
    except httpx.HTTPError:
        pass


def serve_main(capsys, *argv: str) -> tuple[int, list[str]]:
    """eagle3-serve's main() in this process -> (exit status, its stderr lines)."""
    from eagle3_runtime.server import main

    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as e:  # (argparse)
        code = e.code
    return code, [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


@pytest.mark.parametrize("case, template, config_text, needle", [
    ("syntax error", "{% if %}", None, "does not compile"),
    ("raises on every conversation", "{{ raise_exception('no chat here') }}", None, "no chat here"),
    ("sandbox escape", "{{ ''.__class__.__mro__ }}", None, "SecurityError"),
    ("300 MB from 20 bytes", "{{ 'y' * 300000000 }}", None, "MemoryError"),  # (jinja2 folds it while compiling)
    ("tokenizer_config.json not JSON", None, "{not json", "tokenizer_config.json: not valid JSON"),
])
def test_a_bundle_whose_template_cannot_render_is_refused_at_start(bundle, tmp_path, capsys, case, template,
                                                                   config_text, needle):
    from eagle3_runtime.compat import check_bundle

    b = with_template(bundle, tmp_path / "b", template, config_text)
    if case == "syntax error":  # one of them through the console entry point, in its own process
        r = subprocess.run([*SERVE, str(b), "--port", str(free_port())], capture_output=True, text=True, timeout=120)
        code, lines = r.returncode, [ln for ln in r.stderr.splitlines() if ln.strip()]
    else:
        code, lines = serve_main(capsys, str(b), "--port", str(free_port()))
    assert code == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in lines[0], lines
    v = check_bundle(b, files=True)  # `check --files` runs what start-up runs
    assert v.code == 2 and needle in v.reasons()[0], v.reasons()


def test_eagle3_run_chat_with_a_looping_template_is_one_line(bundle, tmp_path):
    b = with_template(bundle, tmp_path / "b", HOSTILE)
    t0 = time.perf_counter()
    r = run_cli("eagle3-run", str(b), "--chat", "--prompt", "LOOP", "--max-tokens", "4")
    assert r.returncode == 2 and "took longer than 3 s" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert time.perf_counter() - t0 < 60


# ------------------------------------------------------------------ start-up

@pytest.mark.parametrize("args, needle", [
    (("--port", "-1"), "from 1 to 65535"), (("--port", "70000"), "from 1 to 65535"),
    (("--port", "http"), "from 1 to 65535"), (("--host", "999.1.1.1"), "is not an address"),
    (("--threads", "0"), "positive whole number"), (("--max-queue", "-1"), "--max-queue: must be a whole number from 0"),
    (("--max-queue", "1e9"), "--max-queue"), (("--max-body-bytes", "0"), "--max-body-bytes"),
    (("--max-body-bytes", "9" * 5000), "--max-body-bytes"), (("--body-timeout", "nan"), "--body-timeout: must be a number"),
    (("--body-timeout", "inf"), "--body-timeout"), (("--timeout-keep-alive", "-5"), "--timeout-keep-alive"),
])
def test_bad_listen_arguments_are_one_line(tmp_path, capsys, args, needle):
    """Refused before the bundle is even read (it does not exist here)."""
    if args[-1] == "70000":  # (one of them through the console entry point, in its own process)
        r = subprocess.run([*SERVE, str(tmp_path / "no-bundle"), *args], capture_output=True, text=True, timeout=60)
        code, lines = r.returncode, [ln for ln in r.stderr.splitlines() if ln.strip()]
    else:
        code, lines = serve_main(capsys, str(tmp_path / "no-bundle"), *args)
    assert code == 2 and len(lines) == 1 and needle in lines[0], lines


def test_a_port_in_use_is_one_line_at_once(bundle, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        t0 = time.perf_counter()
        code, lines = serve_main(capsys, str(bundle), "--port", str(taken.getsockname()[1]))
    assert code == 2 and len(lines) == 1 and "in use" in lines[0] and "--port" in lines[0], lines
    assert time.perf_counter() - t0 < 1  # (the socket is bound before the bundle is loaded)


# where eagle3-serve's start-up hands over (eagle3_runtime.launch.phase): before the command's imports, before
# the bundle's load, once the engine is ready, just before uvicorn, and serving (uvicorn's handlers in place);
# ":lost": the pause swallows the KeyboardInterrupt there, as C code can
STOPS = [("imports", signal.SIGINT, 130), ("load", signal.SIGINT, 130), ("ready", signal.SIGINT, 130),
         ("ready:lost", signal.SIGINT, 130), ("serve", signal.SIGINT, 130), ("serve:lost", signal.SIGINT, 130),
         ("serving", signal.SIGINT, 0), ("load", signal.SIGTERM, 143), ("serve:lost", signal.SIGTERM, 143),
         ("serving", signal.SIGTERM, 0)]


def stop_at(bundle, phase: str, sig: int) -> tuple[int, str, float]:
    """Start eagle3-serve paused at `phase` ($EAGLE3_PAUSE_AT), signal it there -> (status, stderr, seconds the
    process took to end after the signal)."""
    import queue

    p = subprocess.Popen([*SERVE, str(bundle), "--port", str(free_port())], stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1", EAGLE3_PAUSE_AT=phase))
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in p.stderr] + [lines.put(None)], daemon=True)
    reader.start()
    seen = []
    try:
        while not (seen and seen[-1] and seen[-1].startswith(f"paused at {phase.split(':')[0]}")):
            seen.append(lines.get(timeout=120))  # (waits for the line: no timing to guess)
            assert seen[-1] is not None, "".join(seen[:-1])
        t0 = time.perf_counter()
        p.send_signal(sig)
        p.wait(60)
        secs = time.perf_counter() - t0
        reader.join(10)
        while not lines.empty():
            seen.append(lines.get() or "")
        return p.returncode, "".join(seen), secs
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("phase, sig, code", STOPS, ids=[f"{p}-{signal.Signals(s).name}" for p, s, _ in STOPS])
def test_a_stop_signal_in_every_phase_of_start_up_is_honoured(bundle, phase, sig, code):
    """SIGINT / SIGTERM at each hand-over of start-up (driven there, not slept to): one line, 130 / 143, no
    traceback; once serving, a graceful stop (0). The signal lost in C code is still honoured."""
    status, err, secs = stop_at(bundle, phase, sig)
    assert status == code, err
    assert "Traceback" not in err and secs < 30, err
    if code:
        assert err.strip().splitlines()[-1] == ("interrupted" if sig == signal.SIGINT else "terminated"), err


@pytest.mark.slow
def test_stop_signals_under_load_50_times(bundle):
    """The same, 50 rounds over every phase, with both cores kept busy meanwhile."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        for i in range(50):
            phase, sig, code = STOPS[i % len(STOPS)]
            status, err, _ = stop_at(bundle, phase, sig)
            assert status == code and "Traceback" not in err, (i, phase, err)
    finally:
        for b in burners:
            b.kill()


def test_ctrl_c_that_native_code_wraps_is_one_line(tmp_path):
    """A Ctrl-C inside native code during the imports can come out as that code's own error (pydantic-core's
    SchemaError while FastAPI builds its models: seen once in CI); after a Ctrl-C it is one line and 130 too."""
    (tmp_path / "wrapping_import.py").write_text(
        "from eagle3_runtime import launch\n"
        "try:\n    launch._on_signal(2, None)\n"
        "except KeyboardInterrupt as e:\n    raise RuntimeError('SchemaError: KeyboardInterrupt') from e\n")
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); from eagle3_runtime import launch; " \
           "sys.exit(launch._main('wrapping_import'))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 130 and "interrupted" in r.stderr and "Traceback" not in r.stderr, r.stderr
    (tmp_path / "failing_import.py").write_text("raise RuntimeError('a real error')\n")  # (no Ctrl-C: as it is)
    r = subprocess.run([sys.executable, "-c", code.replace("wrapping_import", "failing_import")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and "a real error" in r.stderr, r.stderr


def test_thread_counts_are_capped_at_the_cores(bundle, monkeypatch):
    """A million threads (which segfaulted after 50 s) is the cores this process may use; WORLD_SIZE that
    is not a number is one line."""
    from eagle3_runtime.tp import available_cores, num_threads

    monkeypatch.setenv("EAGLE3_NUM_THREADS", "1000000")
    assert num_threads() == num_threads(10 ** 6) == available_cores()
    r = run_cli("eagle3-run", str(bundle), "--prompt", "hi", "--max-tokens", "2", env={"WORLD_SIZE": "abc"})
    assert r.returncode == 2 and "WORLD_SIZE='abc'" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = run_cli("eagle3-build", "check", str(bundle), env={"WORLD_SIZE": "abc"})
    assert r.returncode == 2 and "WORLD_SIZE='abc'" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_finished_request_frees_its_slot_for_the_next_at_once(tiny):
    """--max-queue 0, one sequence slot, back-to-back requests: each is admitted the moment the previous one has
    its last event (its row, finished but not yet freed by the engine thread, no longer counts as busy)."""
    from eagle3_runtime.bundle import Bundle
    from eagle3_runtime.engine import Engine, QueueFull, Request

    engine = Engine(Bundle(tiny.bundle().path), max_queue=0)
    assert engine.max_num_seqs == 1
    thread = threading.Thread(target=engine.run_forever, daemon=True)
    thread.start()
    refused = 0
    try:
        for i in range(200):
            done = threading.Event()
            try:
                engine.submit(Request([5 + i % 7, 9, 11], 2, on_event=lambda e, d=done: e.finish_reason and d.set()))
            except QueueFull:
                refused += 1
                time.sleep(0.01)
                continue
            assert done.wait(30)
    finally:
        engine.shutdown()
        thread.join(10)
    assert refused == 0, f"{refused} of 200 back-to-back requests refused"
