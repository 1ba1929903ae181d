"""OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn, 127.0.0.1 by default).

    eagle3-serve BUNDLE [--host 127.0.0.1] [--port 8000] [--no-spec]
    torchrun --nproc-per-node N -m eagle3_runtime.server BUNDLE ...     # TP bundles

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as SSE),
GET /v1/models, /health, /metrics (Prometheus text). The engine runs on one background thread;
each request gets an asyncio queue fed from that thread. A client that disconnects cancels its
sequence, which frees its KV-cache row at the engine's next step.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .bundle import Bundle, BundleError
from .chat import ChatTemplate
from .engine import Engine, Event, QueueFull, Request, RequestError
from .sampling import SamplingParams
from .tokenizer import BundleTokenizer


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=self.headers)


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = 1


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = 16


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


class Server:
    def __init__(self, bundle: Bundle, *, speculative: bool = True, max_queue: int = 64,
                 model_name: str | None = None):
        self.bundle = bundle
        self.tokenizer = BundleTokenizer(bundle.root)
        self.chat = ChatTemplate.from_bundle(bundle.root)
        self.engine = Engine(bundle, detokenize=self.tokenizer.decode, speculative=speculative, max_queue=max_queue)
        self.model_name = model_name or bundle.manifest.name
        self.created = int(time.time())
        self.thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.thread = threading.Thread(target=self.engine.run_forever, name="eagle3-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.engine.shutdown()
        if self.thread:
            self.thread.join(timeout=30)

    # ------------------------------------------------------------------ request handling

    def _sampling(self, r: _Common) -> SamplingParams:
        if r.model is not None and r.model != self.model_name:
            raise APIError(404, f"The model `{r.model}` does not exist; this server serves `{self.model_name}`",
                           param="model", code="model_not_found")
        if r.n != 1:
            raise APIError(400, "only n=1 is supported", param="n")
        p = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, seed=r.seed)
        try:
            p.validate()
        except ValueError as e:
            raise APIError(400, str(e), param=_param_of(str(e))) from None
        return p

    @staticmethod
    def _stops(r: _Common) -> tuple[str, ...]:
        return (r.stop,) if isinstance(r.stop, str) else tuple(r.stop or ())

    def _max_tokens(self, value: int | None, n_prompt: int) -> int:
        if value is None:
            return self.engine.max_len - n_prompt
        return value

    def prompt_ids(self, r: CompletionRequest) -> list[int]:
        p = r.prompt
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            if len(p) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            p = p[0]
        if isinstance(p, str):
            return self.tokenizer.encode(p)
        if not p:
            raise APIError(400, "prompt is empty", param="prompt")
        vocab = self.bundle.manifest.vocab_size
        if any(not 0 <= t < vocab for t in p):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        return list(p)

    def chat_ids(self, r: ChatRequest) -> list[int]:
        if self.chat is None:
            raise APIError(400, "this bundle's tokenizer has no chat template; use /v1/completions", param="messages")
        try:
            text = self.chat.render([m.model_dump(exclude_none=True) for m in r.messages])
        except Exception as e:  # a template may raise on unsupported roles
            raise APIError(400, f"chat template error: {e}", param="messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def submit(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams, stop: tuple[str, ...],
               loop: asyncio.AbstractEventLoop) -> tuple[Request, asyncio.Queue]:
        q: asyncio.Queue = asyncio.Queue()
        req = Request(prompt_ids, max_tokens, sampling, stop,
                      on_event=lambda e: loop.call_soon_threadsafe(q.put_nowait, e))
        try:
            self.engine.submit(req)
        except RequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        except QueueFull as e:
            raise APIError(503, f"server busy: {e}; retry later", type_="server_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
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


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="eagle3-serve")
    metrics = server.engine.metrics

    class CountRequests:
        """Pure ASGI middleware (BaseHTTPMiddleware would break streaming disconnect handling)."""

        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http":
                return await self.app(scope, receive, send)

            async def counting_send(message):
                if message["type"] == "http.response.start":
                    metrics.http_requests.labels(scope["path"], str(message["status"])).inc()
                await send(message)

            await self.app(scope, receive, counting_send)

    app.add_middleware(CountRequests)

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return e.response()

    async def parse(request: HTTPRequest, model: type[BaseModel]):
        body = await request.body()
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise APIError(400, "request body must be a JSON object")
        try:
            return model.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"])
            msg = f"{loc}: {err['msg']}" if loc else err["msg"]
            raise APIError(400, msg, param=str(err["loc"][0]) if err["loc"] else None) from None

    @app.get("/health")
    async def health():
        alive = server.thread is not None and server.thread.is_alive()
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "eagle3-build", "max_model_len": server.engine.max_len}]}

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        r = await parse(request, CompletionRequest)
        sampling = server._sampling(r)
        ids = server.prompt_ids(r)
        return await respond(r, ids, sampling, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        r = await parse(request, ChatRequest)
        sampling = server._sampling(r)
        ids = server.chat_ids(r)
        if r.max_completion_tokens is not None:
            r.max_tokens = r.max_completion_tokens
        return await respond(r, ids, sampling, chat=True)

    async def respond(r: _Common, ids: list[int], sampling: SamplingParams, chat: bool):
        max_tokens = server._max_tokens(r.max_tokens, len(ids))
        req, q = server.submit(ids, max_tokens, sampling, server._stops(r), asyncio.get_running_loop())
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        def usage(n_out: int) -> dict:
            return {"prompt_tokens": len(ids), "completion_tokens": n_out, "total_tokens": len(ids) + n_out}

        if not r.stream:
            tokens, text, reason = [], "", None
            async for ev in _events(req, q):
                tokens += ev.token_ids
                text += ev.text
                reason = ev.finish_reason
            choice = {"index": 0, "finish_reason": reason, "token_ids": tokens}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice |= {"text": text, "logprobs": None}
            return {"id": rid, "object": obj, "created": created, "model": server.model_name,
                    "choices": [choice], "usage": usage(len(tokens))}

        async def stream():
            n_out = 0
            chunk_obj = "chat.completion.chunk" if chat else "text_completion"
            if chat:
                yield _sse({"id": rid, "object": chunk_obj, "created": created, "model": server.model_name,
                            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None}]})
            async for ev in _events(req, q):
                n_out += len(ev.token_ids)
                choice = {"index": 0, "finish_reason": ev.finish_reason, "token_ids": ev.token_ids}
                if chat:
                    choice["delta"] = {"content": ev.text} if ev.text else {}
                else:
                    choice |= {"text": ev.text, "logprobs": None}
                chunk = {"id": rid, "object": chunk_obj, "created": created, "model": server.model_name,
                         "choices": [choice]}
                if ev.finish_reason:
                    chunk["usage"] = usage(n_out)
                yield _sse(chunk)
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="eagle3-serve", description="Serve an eagle3-build bundle over HTTP.")
    ap.add_argument("bundle", help="bundle directory, or hf://org/repo@rev / file:///dir@rev (fetched and verified)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--no-spec", action="store_true", help="disable speculative decoding")
    ap.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a free sequence slot before HTTP 503")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 1)")
    args = ap.parse_args(argv)
    from .cli import set_threads
    from .tp import open_bundle, shutdown, stop_workers

    set_threads(args.threads)
    try:
        bundle, ctx = open_bundle(args.bundle)
    except BundleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if bundle is None:  # a TP worker rank: the driver has finished
        shutdown(ctx)
        return 0
    server = Server(bundle, speculative=not args.no_spec, max_queue=args.max_queue,
                    model_name=args.served_model_name)
    import uvicorn

    server.start()
    try:
        uvicorn.run(create_app(server), host=args.host, port=args.port, log_level="warning")
    finally:
        server.stop()
        if ctx is not None:
            stop_workers(ctx)
        shutdown(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
