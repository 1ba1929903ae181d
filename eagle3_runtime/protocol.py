"""The OpenAI request bodies this server accepts, and the bounded, strict parsing that gets them there.

Hostile input is refused with a 4xx (APIError) before it costs much: bodies over the byte cap (413)
or slower than the body timeout (408), JSON nested deeper than MAX_JSON_DEPTH or with numbers over
MAX_NUMBER_CHARS characters, lone surrogates, wrong JSON types (strict: `true` is not 1), and
OpenAI / vLLM fields this server does not implement (400 naming the field).
"""
from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect

MAX_BODY_BYTES = 4 << 20   # default --max-body-bytes
MAX_JSON_DEPTH = 64        # nested arrays / objects in a request body
MAX_NUMBER_CHARS = 100     # characters of one JSON number (Python would parse 4,300-digit ints, slowly)
MAX_CHARS_PER_TOKEN = 32   # a prompt over 32 * max_model_len characters is refused without tokenizing it
MAX_STOP = 16              # stop strings per request (each is searched again after every token)


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def response(self) -> Response:
        # json.dumps' default ensure_ascii: any message, even one quoting odd input, encodes
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return Response(json.dumps(body), status_code=self.status, headers=self.headers,
                        media_type="application/json")


# ---------------------------------------------------------------------------------------- request bodies

class _Strict(BaseModel):
    # strict: JSON `true` is not 1, "5" is not 5, 1.5 is not an int; NaN / Infinity are refused; an
    # unknown field is a 400 (known OpenAI fields this server does not implement: see _NOT_IMPLEMENTED)
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = None  # the final chunk always carries usage


class CommonRequest(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    return_token_ids: bool | None = None  # vLLM's flag: choices carry token_ids here whatever it says


class CompletionRequest(CommonRequest):
    prompt: Any  # a string, [one string] or [token ids]: Server.prompt_ids checks it (clearer than a union's errors)
    max_tokens: int | None = 16


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # other keys (name, tool_calls, ...) go to the template
    role: str
    content: str | list[Any] | None = None  # a string, or content parts (text_content makes them a string)


class ChatRequest(CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


# OpenAI (and vLLM) request fields this server does not implement, accepted only at a value that
# asks for nothing; anything else is a 400 naming the field, as vLLM does
_NOT_IMPLEMENTED: dict[str, tuple] = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1), "logit_bias": (None, {}), "min_p": (None, 0), "min_tokens": (None, 0),
    "ignore_eos": (None, False), "stop_token_ids": (None, []), "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True), "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
    "store": (None, False), "metadata": (None, {}),
}

_SURROGATE = re.compile("[\ud800-\udfff]")
_SCALARS = (int, float, bool, type(None))


class _Refused(ValueError):
    """A request body refused while parsing; `path` is where (filled in on the way up)."""

    def __init__(self, problem: str):
        super().__init__(problem)
        self.path: list[str] = []


def _number(parse):
    def bounded(text: str):
        if len(text) > MAX_NUMBER_CHARS:
            raise _Refused(f"a JSON number has {len(text)} characters; at most {MAX_NUMBER_CHARS} are accepted")
        return parse(text)
    return bounded


def _constant(name: str):
    raise _Refused(f"{name} is not valid JSON (send a finite number)")


def _check_tree(v: dict | list, depth: int = 1) -> None:
    """Nesting depth, and strings UTF-8 cannot carry: json decodes a "\\ud800" escape into a lone
    surrogate, which would fail later, as a 500, wherever the text is encoded. Raises
    _Refused("depth" | "key" | "surrogate")."""
    if depth > MAX_JSON_DEPTH:
        raise _Refused("depth")
    for k, x in v.items() if isinstance(v, dict) else enumerate(v):
        if isinstance(k, str) and _SURROGATE.search(k):
            raise _Refused("key")
        if type(x) in _SCALARS:  # the common case (long token-id lists): nothing to look at
            continue
        try:
            if isinstance(x, str):
                if _SURROGATE.search(x):
                    raise _Refused("surrogate")
            else:
                _check_tree(x, depth + 1)
        except _Refused as e:
            e.path.append(str(k))
            raise


def parse_json(body: bytes) -> dict:
    """A request body as a JSON object, or APIError(400) saying what is wrong with it."""
    try:
        data = json.loads(body, parse_int=_number(int), parse_float=_number(float), parse_constant=_constant)
    except _Refused as e:
        raise APIError(400, f"request body refused: {e}") from e
    except RecursionError as e:  # json's own guard (~1000 levels); _check_tree below bounds it at 64
        raise APIError(400, f"request body is nested deeper than {MAX_JSON_DEPTH} levels") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        _check_tree(data)
    except _Refused as e:
        path, kind = ".".join(reversed(e.path)), str(e)
        param = e.path[-1] if e.path else None
        if kind == "depth":
            raise APIError(400, f"request body is nested deeper than {MAX_JSON_DEPTH} levels", param=param) from e
        where = f"`{path}`" if kind == "surrogate" else f"a key in `{path}`" if path else "a key"
        raise APIError(400, f"{where} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which "
                            "is not valid Unicode; send valid UTF-8 text", param=param) from e
    return data


def short_repr(v: Any) -> str:
    s = json.dumps(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _harmless(value: Any, allowed: tuple) -> bool:
    # (bools only match bools: in Python True == 1 and False == 0)
    return any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed)


def _error_path(data: Any, err: dict) -> str:
    """Where a pydantic error is, as JSON keys / indices (a union's member tags, e.g. "list[str]", left out)."""
    parts, cur, loc = [], data, err["loc"]
    for i, x in enumerate(loc):
        if isinstance(cur, dict) and x in cur or isinstance(cur, list) and isinstance(x, int) and 0 <= x < len(cur):
            cur = cur[x]
        elif not (err["type"] == "missing" and i == len(loc) - 1):
            continue
        parts.append(str(x))
    return ".".join(parts)


def text_content(messages: list[ChatMessage]) -> None:
    """Content given as parts (what the OpenAI SDK and many clients send: [{"type": "text", "text": ...}])
    becomes its text parts joined by newlines, as vLLM does; any other part type is a 400 naming it."""
    for i, m in enumerate(messages):
        if not isinstance(m.content, list):
            continue
        texts = []
        for j, part in enumerate(m.content):
            kind = part.get("type") if isinstance(part, dict) else None
            where = f"messages.{i}.content.{j}"
            if kind != "text":
                what = f"type {short_repr(kind)}" if isinstance(part, dict) else f"a {type(part).__name__}, not an object"
                raise APIError(400, f"{where}: content part {what} is not supported by this server, which takes text "
                                    'only: send {"type": "text", "text": "..."} parts or a string', param="messages")
            if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                raise APIError(400, f'{where}: a text part is {{"type": "text", "text": "<a string>"}}, got '
                                    f"{short_repr(part)}", param="messages")
            texts.append(part["text"])
        m.content = "\n".join(texts)


def validate(model: type[CommonRequest], data: dict) -> CommonRequest:
    for key, allowed in _NOT_IMPLEMENTED.items():
        if key in data:
            value = data.pop(key)
            if not _harmless(value, allowed):
                raise APIError(400, f"`{key}` is not supported by this server (got {short_repr(value)}); leave it out",
                               param=key)
    if data.get("stream_options") is not None and data.get("stream") is not True:
        raise APIError(400, 'stream_options is only allowed with "stream": true (as OpenAI and vLLM require); '
                            "leave it out or stream the response", param="stream_options")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = max(e.errors(), key=lambda x: len(x["loc"]))  # of a union's errors, the deepest says where
        path = _error_path(data, err)
        if err["type"] == "extra_forbidden":
            msg = f"unsupported field `{path}`: this server does not implement it; leave it out"
        else:
            msg = f"{path}: {err['msg']}" if path else err["msg"]
        raise APIError(400, msg, param=path.split(".")[0] or None) from e


async def read_body(request: HTTPRequest, limit: int, timeout: float) -> bytes:
    """The request body: 413 past `limit` bytes (by Content-Length before reading anything, and by
    counting as a chunked body arrives), 408 when it has not all arrived within `timeout` s."""
    def too_large() -> APIError:
        return APIError(413, f"request body is larger than {limit} bytes (eagle3-serve --max-body-bytes)",
                        code="request_too_large")

    size = request.headers.get("content-length")  # h11 has checked that it is digits
    if size is not None and (len(size) > 18 or int(size) > limit):
        raise too_large()
    body = bytearray()

    async def read():
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise too_large()

    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError as e:  # (not the builtin TimeoutError before Python 3.11)
        raise APIError(408, f"the request body did not arrive within {timeout:g} s (eagle3-serve --body-timeout)",
                       code="request_timeout", headers={"Connection": "close"}) from e
    except ClientDisconnect as e:
        raise APIError(400, "the client disconnected while sending the request body") from e
    return bytes(body)
