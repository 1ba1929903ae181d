"""The bundle's chat template, rendered the way transformers' apply_chat_template does (jinja2's sandbox,
trim_blocks/lstrip_blocks, add_generation_prompt, bos/eos tokens), within bounds.

A template is code from the bundle, and a sandbox bounds what it may touch, not how long it runs or how
much it allocates: two nested `range(100000)` loops, or `"y" * 300000000`, would stall or bloat whatever
process renders them. So templates render in worker processes (chat_worker.py), each render under
Limits: a time limit (the worker is killed and replaced past it), an address-space limit and a cap on
the rendered text. A render past a bound, or one the template itself refuses (raise_exception, a
sandbox SecurityError), raises TemplateRefused naming it; the server answers 400 and goes on. A few
workers serve concurrent requests; renders beyond a bounded queue are refused at once (Busy), so slow
templates cannot hold up the rest of the server. `ChatTemplate.from_bundle` reads the template and
renders a probe conversation once: a template that does not compile or cannot render it is refused as
a BundleError at load.
"""
from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import Eagle3Error
from .manifest import BundleError

PROBE = [{"role": "user", "content": "Hello!"}]


@dataclass(frozen=True)
class Limits:
    seconds: float = 3.0  # per render, the worker killed past it
    memory_bytes: int = 512 << 20  # the worker's address space
    max_chars: int = 4 << 20  # of the rendered prompt
    workers: int = 2  # concurrent renders
    queue: int = 16  # renders that may wait for a worker; more are refused at once


class TemplateRefused(Eagle3Error):
    """The template refused these messages, or rendering them passed a bound (the message says which)."""


class Busy(TemplateRefused):
    """Every render worker is busy and the queue is full."""


def read_template(root: Path) -> tuple[str, dict[str, str]] | None:
    """(template source, special tokens) from the bundle's tokenizer/ directory, or None without a template."""
    tok_dir = Path(root) / "tokenizer"
    cfg_path = tok_dir / "tokenizer_config.json"
    cfg = {}
    if cfg_path.exists():
        try:
            cfg = json.loads(cfg_path.read_bytes())
        except (OSError, ValueError, RecursionError) as e:
            raise BundleError(f"{cfg_path}: not valid JSON ({type(e).__name__}); rebuild the bundle") from e
        if not isinstance(cfg, dict):
            raise BundleError(f"{cfg_path}: not a JSON object; rebuild the bundle")
    source = cfg.get("chat_template")
    if isinstance(source, list):  # named templates: use "default"
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    jinja_file = tok_dir / "chat_template.jinja"
    if source is None and jinja_file.exists():
        source = jinja_file.read_text(errors="replace")
    if not source:
        return None
    if not isinstance(source, str):
        raise BundleError(f"{cfg_path}: chat_template is a {type(source).__name__}, not a template string; "
                          "rebuild the bundle")
    special = {}
    for k in ("bos_token", "eos_token", "unk_token", "pad_token"):
        v = cfg.get(k)
        v = v.get("content", "") if isinstance(v, dict) else v
        if v is not None:
            special[k] = v if isinstance(v, str) else ""
    return source, special


class _Worker:
    """One render process; `render` blocks for at most limits.seconds."""

    def __init__(self, source: str, special: dict, limits: Limits):
        self.limits = limits
        self.proc = subprocess.Popen([sys.executable, "-m", "eagle3_runtime.chat_worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True,
                                     env={**os.environ, "PYTHONPATH": _package_parent()})
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        reply = self._ask({"source": source, "special": special, "memory_bytes": limits.memory_bytes,
                           "max_chars": limits.max_chars}, timeout=max(30.0, limits.seconds))
        if "error" in reply:
            self.close()
            raise TemplateRefused(f"the chat template does not compile ({reply['error']})")

    def _ask(self, obj: dict, timeout: float) -> dict:
        try:
            self.proc.stdin.write((json.dumps(obj) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            self.close()
            raise TemplateRefused(f"the chat template's render process died ({type(e).__name__})") from e
        deadline = time.monotonic() + timeout
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not self._sel.select(left):
                self.close()
                raise TemplateRefused(f"the chat template took longer than {timeout:g} s to render")
            chunk = self.proc.stdout.readline()
            if not chunk:
                code = self.proc.poll()
                self.close()
                raise TemplateRefused(f"the chat template's render process died (exit {code}); a template that "
                                      f"needs more than {self.limits.memory_bytes >> 20} MiB is refused")
            line += chunk
        return json.loads(line)

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        reply = self._ask({"messages": messages, "add_generation_prompt": add_generation_prompt}, self.limits.seconds)
        if "error" in reply:
            if reply.get("kind") == "memory":
                self.close()
            raise TemplateRefused(f"chat template error: {reply['error']}")
        return reply["text"]

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        self._sel.close()


def _package_parent() -> str:
    """The directory eagle3_runtime is imported from, first on the worker's path (an uninstalled checkout)."""
    parent = str(Path(__file__).resolve().parent.parent)
    rest = os.environ.get("PYTHONPATH")
    return parent + (os.pathsep + rest if rest else "")


class ChatTemplate:
    """A bundle's chat template and its render workers (thread-safe; workers start on first use)."""

    def __init__(self, source: str, special: dict[str, str], limits: Limits = Limits()):
        self.source, self.special, self.limits = source, special, limits
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._lock = threading.Condition()
        self._waiting = self._busy = 0
        self._closed = False

    @classmethod
    def from_bundle(cls, root: Path, limits: Limits = Limits()) -> "ChatTemplate | None":
        """The bundle's template, compiled and probed (one user message) in a worker; None without one.
        Raises BundleError when the template cannot render the probe within the limits."""
        found = read_template(root)
        if found is None:
            return None
        template = cls(*found, limits)
        try:
            template.render(PROBE)
        except TemplateRefused as e:
            template.close()
            raise BundleError(f"{Path(root) / 'tokenizer'}: {e} (on a one-message probe conversation); fix the "
                              "bundle's chat template or rebuild the bundle") from e
        return template

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        worker = self._take()
        try:
            return worker.render(messages, add_generation_prompt)
        finally:
            self._give_back(worker)

    def _take(self) -> _Worker:
        with self._lock:
            if self._waiting >= self.limits.queue:
                raise Busy(f"{self._busy} chat template renders are running and {self._waiting} waiting; retry later")
            self._waiting += 1
            try:
                while self._busy >= self.limits.workers and not self._closed:
                    self._lock.wait()
                if self._closed:
                    raise TemplateRefused("the server is shutting down")
                self._busy += 1
            finally:
                self._waiting -= 1
            worker = self._idle.pop() if self._idle else None
        if worker is None or not worker.alive:
            try:
                worker = _Worker(self.source, self.special, self.limits)
            except BaseException:
                self._release()
                raise
            with self._lock:
                self._all.add(worker)
        return worker

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            if worker.alive and not self._closed:
                self._idle.append(worker)
            else:
                self._all.discard(worker)
                worker.close()
        self._release()

    def _release(self) -> None:
        with self._lock:
            self._busy -= 1
            self._lock.notify()

    def __enter__(self) -> "ChatTemplate":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop every worker (a render still running ends at once with TemplateRefused)."""
        with self._lock:
            self._closed = True
            idle, busy = self._idle, self._all.difference(self._idle)
            self._idle, self._all = [], set()
            self._lock.notify_all()
        for w in idle:
            w.close()
        for w in busy:
            w.kill()  # (its render thread sees the process end, and closes it)
