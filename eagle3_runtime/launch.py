"""The runtime's console entry points (eagle3-run, eagle3-serve), and the one path every stop signal takes.

From before the command's first import until uvicorn takes the signals over (and again after it hands them
back), SIGINT and SIGTERM go to `_on_signal`: it remembers the signal and raises KeyboardInterrupt, so that
imports, the bundle's load and the engine's start stop where they are; the command then ends with one line
and 130 (SIGINT, "interrupted") or 143 (SIGTERM, "terminated"), no traceback. Python drops a
KeyboardInterrupt raised where C code swallows errors (a dict lookup's __eq__, a finalizer, a library's
`except BaseException`), so a remembered signal is also checked where start-up hands over: before the
server is handed to uvicorn and once uvicorn's own handlers are in place (`interrupted()`); an error escaping
the command after a signal (native code that wraps the KeyboardInterrupt in its own exception) ends the same
way. While uvicorn serves, its handlers stop the server gracefully.

`phase(name)` marks the hand-over points; with $EAGLE3_PAUSE_AT naming one (a test hook), the process stops
there until a signal arrives, so that a test can signal each phase without guessing its timing.
"""
from __future__ import annotations

import importlib
import os
import signal
import sys
import time
from typing import Callable

HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"  # (PyTorch's CPU allocator)
PAUSE_ENV = "EAGLE3_PAUSE_AT"  # "<phase>" or "<phase>:lost" (the pause swallows the KeyboardInterrupt, as C code can)
SIGNALS = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}
_signals: list[int] = []


def _on_signal(signum, frame):
    _signals.append(signum)
    raise KeyboardInterrupt


def _unraisable(u) -> None:
    """A KeyboardInterrupt that C code swallowed is remembered by _on_signal and reported once by the command:
    not also as Python's "Exception ignored in ..." traceback."""
    if not isinstance(u.exc_value, KeyboardInterrupt):
        sys.__unraisablehook__(u)


def interrupted() -> bool:
    """Whether SIGINT or SIGTERM arrived since the command started (even if its KeyboardInterrupt was lost)."""
    return bool(_signals)


def stop_line() -> tuple[str, int]:
    """What the command prints and exits with after a stop signal: ("interrupted", 130) for SIGINT (and a
    KeyboardInterrupt of no signal), ("terminated", 143) for SIGTERM."""
    sig = _signals[-1] if _signals else signal.SIGINT
    return SIGNALS.get(sig, "interrupted"), 128 + int(sig)


def phase(name: str, stopped: Callable[[], bool] = lambda: False) -> None:
    """A hand-over point of start-up. With $EAGLE3_PAUSE_AT naming it: print "paused at NAME" and wait for a
    signal (or `stopped()`), as if it arrived exactly here."""
    want = os.environ.get(PAUSE_ENV, "")
    if want.split(":")[0] != name:
        return
    print(f"paused at {name}", file=sys.stderr, flush=True)
    try:
        while not _signals and not stopped():
            time.sleep(0.02)
    except KeyboardInterrupt:
        if not want.endswith(":lost"):
            raise


def use_huge_pages() -> None:
    """2 MB pages for torch's large CPU tensors (weights, KV cache), unless $THP_MEM_ALLOC_ENABLE says otherwise
    (0: 4 KB pages). PyTorch's allocator then aligns them to 2 MB and asks the kernel for huge pages (madvise),
    which is what counts where transparent huge pages are "madvise": fewer TLB misses while a step streams every
    weight (docs/serving.md, Memory pages). Torch reads the variable at its first allocation, so this runs before
    torch is imported."""
    os.environ.setdefault(HUGE_PAGES_ENV, "1")


def _main(module: str) -> int:
    use_huge_pages()
    for sig in SIGNALS:  # (not where the parent ignores one: a shell's `cmd &` ignores SIGINT)
        if signal.getsignal(sig) in (signal.default_int_handler, signal.SIG_DFL):
            signal.signal(sig, _on_signal)
    sys.unraisablehook = _unraisable
    try:
        phase("imports")
        return importlib.import_module(module).main()
    except KeyboardInterrupt:  # (escaped the command: during its imports, before it could clean up anything)
        _exit_stopped()
    except Exception:
        if not _signals:
            raise
        _exit_stopped()  # (native code turned the KeyboardInterrupt into its own error: pydantic-core's, seen)


def _exit_stopped() -> None:
    line, code = stop_line()
    print(line, file=sys.stderr, flush=True)
    os._exit(code)  # an import stopped half-way (torch's native init) can abort in interpreter shutdown


def run() -> None:
    sys.exit(_main("eagle3_runtime.cli"))


def serve() -> None:
    sys.exit(_main("eagle3_runtime.server"))
