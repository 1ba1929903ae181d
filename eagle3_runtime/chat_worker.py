"""A chat-template render process (started by chat.py; `python -m eagle3_runtime.chat_worker`).

A bundle's chat template is code: this process is where it runs, in jinja2's immutable sandbox the way
transformers' apply_chat_template renders it (trim_blocks / lstrip_blocks, loopcontrols,
raise_exception, tojson), under an address-space limit (RLIMIT_AS) and with its output counted as it is
generated. The parent bounds the time (it kills this process past the limit).

Protocol, one JSON object per line: stdin first {"source", "special", "memory_bytes", "max_chars"}, answered
{"ok": true} or {"error": ...}; then each {"messages", "add_generation_prompt"} is answered {"text": ...}
or {"error": ..., "kind": "template" | "memory" | "size"}. It exits at EOF, and after a memory error.
Imports only the standard library and jinja2 (no torch: it starts in a fraction of a second).
"""
from __future__ import annotations

import json
import resource
import sys


class TooLong(Exception):
    pass


def _environment():
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, indent=indent, ensure_ascii=False)
    return env


def _describe(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    return text[:300]


def render(template, special: dict, messages: list, add_generation_prompt: bool, max_chars: int) -> str:
    out, n = [], 0
    for chunk in template.generate(messages=messages, add_generation_prompt=add_generation_prompt, **special):
        n += len(chunk)
        if n > max_chars:
            raise TooLong(f"the rendered prompt passed {max_chars} characters")
        out.append(chunk)
    return "".join(out)


def main() -> int:
    send = sys.stdout
    init = json.loads(sys.stdin.readline() or "null")
    if not isinstance(init, dict):
        return 2
    env = _environment()
    limit = int(init["memory_bytes"])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    special, max_chars = init["special"], int(init["max_chars"])
    try:
        template = env.from_string(init["source"])
    except Exception as e:  # noqa: BLE001 (a syntax error, or anything the template's compilation raises)
        send.write(json.dumps({"error": _describe(e), "kind": "template"}) + "\n")
        send.flush()
        return 1
    send.write(json.dumps({"ok": True}) + "\n")
    send.flush()
    for line in sys.stdin:
        req = json.loads(line)
        fatal = False
        try:
            reply = {"text": render(template, special, req["messages"], req["add_generation_prompt"], max_chars)}
        except MemoryError:
            reply, fatal = {"error": f"used more than {limit >> 20} MiB of memory", "kind": "memory"}, True
        except TooLong as e:
            reply = {"error": str(e), "kind": "size"}
        except RecursionError:
            reply = {"error": "recursed too deeply", "kind": "template"}
        except Exception as e:  # noqa: BLE001 (raise_exception, SecurityError, a type error in the template, ...)
            reply = {"error": _describe(e), "kind": "template"}
        try:
            send.write(json.dumps(reply) + "\n")
            send.flush()
        except MemoryError:
            return 3
        if fatal:
            return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
