"""OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn, 127.0.0.1 by default).

    eagle3-serve BUNDLE [--host 127.0.0.1] [--port 8000] [--no-spec] [--threads N]
    torchrun --nproc-per-node N -m eagle3_runtime.server BUNDLE ...     # TP bundles

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as SSE),
GET /v1/models, /health, /metrics (Prometheus text). The engine runs on one background thread;
each request gets an asyncio queue fed from that thread. A client that disconnects cancels its
sequence, which frees its KV-cache row at the engine's next step.

Hostile input gets a 4xx with an OpenAI-style error body before it costs much (protocol.py:
body cap 413, slow body 408, JSON depth / number limits, lone surrogates, strict types, unimplemented
OpenAI fields); prompts far longer than max_model_len are refused before tokenizing. Parsing and
tokenizing run on a worker thread, so /health stays responsive. Chat templates render in bounded worker
processes (chat.py): a template that loops, allocates or refuses is a 400 for that request, a full
render queue a 503. An idle connection, or one that dribbles its request head, is closed after
--timeout-keep-alive seconds (HeadTimeoutH11).

Failures: an error inside an engine step fails that step's requests with a 500 naming it (streams end
with an error event) and the engine goes on; if the engine stops for good (engine.py), new requests and
/health get 503 and the server exits with status 1. The listening socket is bound before the bundle is
loaded (a bad --host / --port, or a port in use, is one line and exit 2 at once); SIGTERM or Ctrl-C
end the server within a few seconds (in-flight requests get GRACE_SECONDS to finish).
"""
from __future__ import annotations

if __name__ == "__main__":  # (python -m, torchrun -m: the pages set before torch is imported, as the console entry does)
    from eagle3_runtime.launch import use_huge_pages

    use_huge_pages()

import asyncio
import concurrent.futures
import contextlib
import errno
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .adaptive import add_speculation_arg, speculation_mode
from .bundle import Bundle
from .chat import Busy, TemplateRefused
from .connection import HeadTimeoutH11
from .engine import Engine, EngineDead, Event, QueueFull, Request, RequestError, describe_error
from .errors import ArgumentParser, Eagle3Error, seconds, whole_number
from .launch import interrupted, phase, stop_line
from .protocol import (MAX_BODY_BYTES, MAX_CHARS_PER_TOKEN, MAX_STOP, APIError, ChatRequest, CommonRequest,
                       CompletionRequest, parse_json, read_body, short_repr, text_content, validate)
from .sampling import SamplingParams
from .tokenizer import load_text
from .contention import governor_enabled, governor_for
from .torch_thread import TorchThread
from .tp import add_threads_arg, open_bundle, set_threads, shutdown, stop_workers
from .trust import add_trust_args

GRACE_SECONDS = 2  # on SIGTERM / Ctrl-C: what in-flight requests get before they are cancelled
log = logging.getLogger("eagle3_runtime.server")

# ---------------------------------------------------------------------------------------- server

class Server:
    def __init__(self, bundle: Bundle, *, speculative: bool = True, max_queue: int = 64,
                 model_name: str | None = None, max_body_bytes: int = MAX_BODY_BYTES, body_timeout: float = 30.0,
                 speculation: str = "always", torch_thread: TorchThread | None = None):
        self.bundle = bundle
        self.torch_thread = torch_thread  # (the thread that loaded the bundle runs the engine: torch_thread.py)
        self.tokenizer, self.chat = bundle.text or load_text(bundle.root)
        self.engine = Engine(bundle, tokenizer=self.tokenizer, speculative=speculative, max_queue=max_queue,
                             on_dead=self._engine_died, speculation=speculation,
                             governor=governor_for(bundle, os.environ))
        self.model_name = model_name or bundle.manifest.name
        self.created = int(time.time())
        self.max_body_bytes, self.body_timeout = max_body_bytes, body_timeout
        self.thread: threading.Thread | None = None
        limits = self.chat.limits if self.chat else None
        self.renders = 0  # chat renders admitted and not finished (event-loop side)
        self.max_renders = limits.workers + limits.queue if limits else 0
        self.render_pool = concurrent.futures.ThreadPoolExecutor(max(1, self.max_renders), "eagle3-render")
        self.uvicorn = None  # the uvicorn.Server, once serving
        self.exit_code = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self.torch_thread is not None:
            self.torch_thread.submit(self.engine.run_forever, last=True)
            self.thread = self.torch_thread.thread
            return
        self.thread = threading.Thread(target=self.engine.run_forever, name="eagle3-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.engine.shutdown()
        if self.chat:
            self.chat.close()
        self.render_pool.shutdown(wait=False, cancel_futures=True)
        if self.thread:
            self.thread.join(timeout=1)  # (a step in flight ends soon; the thread is a daemon either way)

    def begin_shutdown(self) -> None:
        """SIGTERM / Ctrl-C: renders in flight end (400), every request is aborted (its stream ends)."""
        if self.chat:
            self.chat.close()
        self.engine.abort_all()

    def _engine_died(self, reason: str) -> None:
        """From the engine thread: nothing more can be served, so the server stops with status 1."""
        self.exit_code = 1
        if self.uvicorn is not None:
            self.uvicorn.should_exit = True

    @property
    def healthy(self) -> bool:
        return self.thread is not None and self.thread.is_alive() and self.engine.dead is None

    # ------------------------------------------------------------------ request handling

    def parse(self, body: bytes, kind: type[CommonRequest]) -> tuple[CommonRequest, SamplingParams]:
        """Parse and validate one request body (CPU work, run on a worker thread)."""
        r = validate(kind, parse_json(body))
        if isinstance(r, ChatRequest):
            if self.chat is None:
                raise APIError(400, "this bundle's tokenizer has no chat template; use /v1/completions",
                               param="messages")
            text_content(r.messages)
            self._check_chars(sum(len(m.content or "") for m in r.messages), "messages")
            if r.max_completion_tokens is not None:
                r.max_tokens = r.max_completion_tokens
        return r, self._sampling(r)

    async def chat_ids(self, r: ChatRequest) -> list[int]:
        """Render the chat template in a render worker (bounded: chat.py), then tokenize."""
        if self.renders >= self.max_renders:
            raise APIError(503, "server busy: every chat template render slot is taken; retry later",
                           type_="server_error", code="render_busy", headers={"Retry-After": "1"})
        self.renders += 1
        try:
            messages = [m.model_dump(exclude_none=True) for m in r.messages]
            text = await asyncio.get_running_loop().run_in_executor(self.render_pool, self.chat.render, messages)
        except Busy as e:
            raise APIError(503, f"server busy: {e}", type_="server_error", code="render_busy",
                           headers={"Retry-After": "1"}) from e
        except TemplateRefused as e:
            raise APIError(400, str(e), param="messages") from e
        finally:
            self.renders -= 1
        self._check_chars(len(text), "messages")
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=False)

    def _sampling(self, r: CommonRequest) -> SamplingParams:
        if r.model is not None and r.model != self.model_name:
            raise APIError(404, f"The model `{r.model[:100]}` does not exist; this server serves `{self.model_name}`",
                           param="model", code="model_not_found")
        if r.n != 1:
            raise APIError(400, "only n=1 is supported", param="n")
        if isinstance(r.stop, list) and len(r.stop) > MAX_STOP:
            raise APIError(400, f"stop has {len(r.stop)} strings; at most {MAX_STOP} are supported", param="stop")
        p = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, seed=r.seed)
        try:
            p.validate()
        except ValueError as e:
            raise APIError(400, str(e), param=_param_of(str(e))) from e
        return p

    @staticmethod
    def _stops(r: CommonRequest) -> tuple[str, ...]:
        return (r.stop,) if isinstance(r.stop, str) else tuple(r.stop or ())

    def _max_tokens(self, value: int | None, n_prompt: int) -> int:
        if value is None:
            return self.engine.max_len - n_prompt
        return value

    def _check_chars(self, n: int, param: str) -> None:
        limit = MAX_CHARS_PER_TOKEN * self.engine.max_len
        if n > limit:
            raise APIError(400, f"the prompt has {n} characters, more than {limit} ({MAX_CHARS_PER_TOKEN} per token "
                                f"of max_model_len {self.engine.max_len}); shorten it", param=param)

    def prompt_ids(self, r: CompletionRequest) -> list[int]:
        p = r.prompt
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            if len(p) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            p = p[0]
        if isinstance(p, str):
            self._check_chars(len(p), "prompt")
            return self.tokenizer.encode(p)
        bad = next((t for t in p if type(t) is not int), None) if isinstance(p, list) else p
        if bad is not None or not isinstance(p, list):  # JSON true / 1.0 are not token ids
            raise APIError(400, f"prompt must be a string or a list of token ids (integers); got {short_repr(bad)}",
                           param="prompt")
        if not p:
            raise APIError(400, "prompt is empty", param="prompt")
        vocab = self.bundle.manifest.vocab_size
        if any(not 0 <= t < vocab for t in p):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        return list(p)

    def submit(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams, stop: tuple[str, ...],
               loop: asyncio.AbstractEventLoop) -> tuple[Request, asyncio.Queue]:
        q: asyncio.Queue = asyncio.Queue()
        req = Request(prompt_ids, max_tokens, sampling, stop,
                      on_event=lambda e: loop.call_soon_threadsafe(q.put_nowait, e))
        try:
            self.engine.submit(req)
        except RequestError as e:
            raise APIError(400, str(e), param=e.param) from e
        except QueueFull as e:
            raise APIError(503, f"server busy: {e}; retry later", type_="server_error", code="queue_full",
                           headers={"Retry-After": "1"}) from e
        except EngineDead as e:
            raise APIError(503, str(e), type_="server_error", code="engine_dead") from e
        return req, q


def _param_of(msg: str) -> str | None:
    for p in ("temperature", "top_p", "top_k", "seed"):
        if p in msg:
            return p
    return None


async def _events(req: Request, q: asyncio.Queue) -> AsyncIterator[Event]:
    """The request's events until it finishes; if the consumer goes away first, cancel it."""
    finished = False
    try:
        while True:
            ev = await q.get()
            yield ev
            if ev.finish_reason:
                finished = True
                return
    finally:
        if not finished:
            req.cancel()


async def _collect(req: Request, q: asyncio.Queue) -> tuple[list[int], str, Event | None]:
    tokens, text, last = [], "", None
    async for ev in _events(req, q):
        tokens += ev.token_ids
        text += ev.text
        last = ev
    return tokens, text, last


def engine_error(ev: Event) -> APIError:
    """The answer to a request whose engine step failed."""
    return APIError(500, f"the engine failed while serving this request ({ev.error}); the server logged the "
                         "traceback", type_="server_error", code="engine_error")


async def _client_gone(request: HTTPRequest) -> None:
    """Returns when the client disconnects (the body is read: the next ASGI message is http.disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class _SSE(StreamingResponse):
    """A stream that cancels its request however it ends: a client that leaves before the first
    chunk never starts the generator, so _events' own cleanup would not run."""

    def __init__(self, content, req: Request):
        super().__init__(content, media_type="text/event-stream")
        self.req = req

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.req.cancel()  # a no-op once the request has finished


class _CountRequests:
    """Pure ASGI middleware (BaseHTTPMiddleware would break streaming disconnect handling) counting
    responses per endpoint and status. The endpoint label is a route of this app or "other": a client
    cannot add series."""

    def __init__(self, asgi_app, routes, metrics):
        self.app, self.routes_of, self.metrics = asgi_app, routes, metrics
        self.routes: set[str] | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.routes is None:
            self.routes = self.routes_of()
        endpoint = scope["path"] if scope["path"] in self.routes else "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.http_requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


class _Completion:
    """One completion's OpenAI response, whole or streamed (SSE), from the engine's events."""

    def __init__(self, server: Server, ids: list[int], chat: bool):
        self.model, self.n_prompt, self.chat = server.model_name, len(ids), chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def usage(self, n_out: int) -> dict:
        return {"prompt_tokens": self.n_prompt, "completion_tokens": n_out, "total_tokens": self.n_prompt + n_out}

    def envelope(self, obj: str, choice: dict) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}

    async def whole(self, request: HTTPRequest, req: Request, q: asyncio.Queue):
        # wait for the result, or for the client to leave: then cancel, freeing its row at the next step
        result = asyncio.ensure_future(_collect(req, q))
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait((result, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not result.done():
                req.cancel()
                result.cancel()
        if not result.done() or result.cancelled():
            return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
        tokens, text, last = result.result()
        if last is not None and last.finish_reason == "error":
            return engine_error(last).response()
        choice = {"index": 0, "finish_reason": last.finish_reason if last else None, "token_ids": tokens}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice |= {"text": text, "logprobs": None}
        return self.envelope("chat.completion" if self.chat else "text_completion", choice) | {
            "usage": self.usage(len(tokens))}

    async def stream(self, req: Request, q: asyncio.Queue) -> AsyncIterator[str]:
        n_out = 0
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        if self.chat:
            yield _sse(self.envelope(obj, {"index": 0, "delta": {"role": "assistant", "content": ""},
                                           "finish_reason": None}))
        async for ev in _events(req, q):
            if ev.finish_reason == "error":  # (the status line is sent: the error goes in the stream)
                e = engine_error(ev)
                yield _sse({"error": {"message": e.message, "type": e.type, "param": None, "code": e.code}})
                break
            n_out += len(ev.token_ids)
            choice = {"index": 0, "finish_reason": ev.finish_reason, "token_ids": ev.token_ids}
            if self.chat:
                choice["delta"] = {"content": ev.text} if ev.text else {}
            else:
                choice |= {"text": ev.text, "logprobs": None}
            chunk = self.envelope(obj, choice)
            if ev.finish_reason:
                chunk["usage"] = self.usage(n_out)
            yield _sse(chunk)
        yield "data: [DONE]\n\n"


def create_app(server: Server) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        if server.chat:  # (renders still running end now, not at their time limit)
            server.chat.close()

    app = FastAPI(title="eagle3-serve", lifespan=lifespan)
    metrics = server.engine.metrics
    app.add_middleware(_CountRequests, routes=lambda: {r.path for r in app.routes}, metrics=metrics)

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return e.response()

    @app.exception_handler(HTTPException)  # unknown path (404), wrong method (405): OpenAI-style bodies too
    async def http_error(_, e: HTTPException):
        return APIError(e.status_code, str(e.detail), headers=e.headers).response()

    @app.exception_handler(Exception)  # a bug of ours: a 500 naming it (logged with its traceback), never HTML
    async def internal_error(_, e: Exception):
        log.error("request failed: %s", describe_error(e), exc_info=e)
        return APIError(500, f"internal error ({describe_error(e)})", type_="server_error").response()

    @app.get("/health")
    async def health():
        ok = server.healthy
        status = "ok" if ok else f"engine stopped: {server.engine.dead}" if server.engine.dead else "engine stopped"
        return JSONResponse({"status": status}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "eagle3-build", "max_model_len": server.engine.max_len}]}

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await respond(request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        return await respond(request, ChatRequest)

    async def respond(request: HTTPRequest, kind: type[CommonRequest]):
        body = await read_body(request, server.max_body_bytes, server.body_timeout)
        r, sampling = await asyncio.to_thread(server.parse, body, kind)
        ids = await (server.chat_ids(r) if isinstance(r, ChatRequest) else asyncio.to_thread(server.prompt_ids, r))
        req, q = server.submit(ids, server._max_tokens(r.max_tokens, len(ids)), sampling, server._stops(r),
                               asyncio.get_running_loop())
        reply = _Completion(server, ids, chat=isinstance(r, ChatRequest))
        return await reply.whole(request, req, q) if not r.stream else _SSE(reply.stream(req, q), req)

    return app


_port = whole_number(1, 65535, "a TCP port number")


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything slow happens; a bad address or a busy port is one
    Eagle3Error naming the fix."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise Eagle3Error(f"--host {host!r} is not an address or name this host can listen on "
                          f"({getattr(e, 'strerror', None) or e}); use e.g. 127.0.0.1 or 0.0.0.0") from e
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        fix = {errno.EADDRINUSE: "another process listens there: stop it or choose another --port",
               errno.EADDRNOTAVAIL: "that address is not one of this host's: use 127.0.0.1 or 0.0.0.0",
               errno.EACCES: "ports below 1024 need privileges: choose a port above 1023"}.get(e.errno, "check --host "
                                                                                                  "and --port")
        raise Eagle3Error(f"cannot listen on {host}:{port} ({e.strerror}); {fix}") from e
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="eagle3-serve", description="Serve an eagle3-build bundle over HTTP.")
    ap.add_argument("bundle", help="bundle directory, or hf://org/repo@rev / file:///dir@rev (fetched and verified)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=_port, default=8000)
    add_speculation_arg(ap)
    ap.add_argument("--max-queue", type=whole_number(0, 1 << 20), default=64,
                    help="requests that may wait for a free sequence slot before HTTP 503 (default 64)")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--max-body-bytes", type=whole_number(1, 1 << 34), default=MAX_BODY_BYTES,
                    help=f"largest request body; a larger one gets HTTP 413 (default {MAX_BODY_BYTES})")
    ap.add_argument("--body-timeout", type=seconds(0.01, 86400), default=30.0,
                    help="seconds a client has to send a request body; a slower one gets HTTP 408 (default 30)")
    ap.add_argument("--timeout-keep-alive", type=seconds(0.01, 86400), default=5.0,
                    help="seconds a connection may sit idle, or take to send a request's headers, before it is "
                         "closed (default 5)")
    ap.add_argument("--debug", action="store_true", help="on an error, also print its traceback with the causes")
    add_threads_arg(ap)
    add_trust_args(ap)
    args = ap.parse_args(argv)
    from .errors import enable_debug, print_cause

    if args.debug:
        enable_debug()
    logging.basicConfig(format="%(levelname)s: %(message)s")
    logging.getLogger("eagle3_runtime").setLevel(logging.INFO)  # (the speculation switches)
    server = ctx = None
    torch_thread = TorchThread()
    try:
        torch_thread.call(set_threads, args.threads)
        mode = speculation_mode(args, os.environ)
        governor_enabled(os.environ)  # (a bad value refused before the load)
        sock = bind(args.host, args.port) if os.environ.get("RANK", "0") == "0" else None  # (rank 0 serves)
        phase("load")
        bundle, ctx = torch_thread.call(open_bundle, args.bundle, args.expect_digest, args.verify_signature,
                                        args.trust_remote_code)
        if bundle is None:  # a TP worker rank: the driver has finished
            torch_thread.close()
            shutdown(ctx)
            return 0
        server = Server(bundle, max_queue=args.max_queue, speculation=mode, torch_thread=torch_thread,
                        model_name=args.served_model_name, max_body_bytes=args.max_body_bytes,
                        body_timeout=args.body_timeout)
        print("\n".join(server.engine.speculation_report()), file=sys.stderr, flush=True)
        phase("ready")
        if interrupted():  # a signal during start-up whose KeyboardInterrupt was lost
            raise KeyboardInterrupt
    except Eagle3Error as e:
        print_cause(e)
        print(f"error: {e}", file=sys.stderr)
        _stop(server, ctx)
        return 2
    except KeyboardInterrupt:
        line, code = stop_line()
        print(line, file=sys.stderr)
        _stop(server, ctx)
        _leave_if_busy(torch_thread, code)
        return code
    try:
        code = serve(server, sock, args.timeout_keep_alive)
    finally:
        _stop(server, ctx)
    if code:
        print(f"error: the engine stopped ({server.engine.dead}); the server exited", file=sys.stderr)
    return code


def serve(server: Server, sock: socket.socket, timeout_keep_alive: float = 5.0) -> int:
    """Serve on a bound socket until SIGTERM / Ctrl-C (0) or the engine's death (1)."""
    import uvicorn

    class Uvicorn(uvicorn.Server):
        stopped_at_start = False

        async def startup(self, sockets=None):
            await super().startup(sockets)  # (inside uvicorn's capture_signals: its handlers are in place)
            phase("serving", lambda: self.should_exit)
            if interrupted():  # a signal before uvicorn took the handlers over, whose KeyboardInterrupt was lost
                self.should_exit = self.stopped_at_start = True

        async def shutdown(self, sockets=None):
            server.begin_shutdown()  # in-flight requests end now, so none is left to cancel
            await super().shutdown(sockets)

    config = uvicorn.Config(create_app(server), log_level="warning", http=HeadTimeoutH11,
                            timeout_keep_alive=timeout_keep_alive, timeout_graceful_shutdown=GRACE_SECONDS)
    server.uvicorn = Uvicorn(config)
    server.start()
    try:
        phase("serve")
        server.uvicorn.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn hands a signal it stopped on back to us (ours again), as KeyboardInterrupt
        if not server.uvicorn.started:
            raise  # (before it served: the start-up path, one line and 130 / 143)
    finally:
        server.stop()
    if server.uvicorn.stopped_at_start:
        raise KeyboardInterrupt
    return server.exit_code


def _leave_if_busy(torch_thread: TorchThread, code: int) -> None:
    """After a Ctrl-C during start-up the engine thread may still be in native code (loading the bundle's
    graphs); finalizing the interpreter under it can abort the process ("terminate called without an active
    exception", exit -6). Give it 2 s to finish, else leave at once with `code`."""
    torch_thread.close()
    torch_thread.thread.join(timeout=2.0)
    if torch_thread.thread.is_alive():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _stop(server: Server | None, ctx) -> None:
    """Stop the engine and render workers, then the TP workers once the engine thread is done with them
    (if it is not, the process leaves without them: torchrun ends the other ranks)."""
    if server is not None:
        server.stop()
    if ctx is not None:
        if server is None or server.thread is None or not server.thread.is_alive():
            stop_workers(ctx)
            shutdown(ctx)
        else:
            shutdown(ctx, barrier=False)


if __name__ == "__main__":  # (python -m eagle3_runtime.server: the console entry point's path, its signal handling too)
    from eagle3_runtime.launch import serve as _serve

    _serve()
