"""The runtime's console entry points (eagle3-run, eagle3-serve). Each command's module is imported
inside the guard, so that Ctrl-C during its start-up imports (torch alone takes a second) ends the
same way as later: one line and exit 130, no traceback. A Ctrl-C is also remembered (`interrupted()`): Python
drops a KeyboardInterrupt raised where C code swallows errors (a dict lookup's __eq__, a finalizer), so a
command checks before it starts serving, instead of serving after a Ctrl-C that was lost; and an error escaping the
command after a Ctrl-C (native code that wraps the KeyboardInterrupt in its own exception) ends the same way."""
from __future__ import annotations

import importlib
import os
import signal
import sys

_interrupts: list[int] = []


def _on_sigint(signum, frame):
    _interrupts.append(signum)
    raise KeyboardInterrupt


def _unraisable(u) -> None:
    """A KeyboardInterrupt that C code swallowed is remembered by _on_sigint and reported once by the command:
    not also as Python's "Exception ignored in ..." traceback."""
    if not isinstance(u.exc_value, KeyboardInterrupt):
        sys.__unraisablehook__(u)


def interrupted() -> bool:
    """Whether Ctrl-C was pressed since the command started (even if its KeyboardInterrupt was lost)."""
    return bool(_interrupts)


def _main(module: str) -> int:
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # (not where the parent ignores it)
        signal.signal(signal.SIGINT, _on_sigint)
        sys.unraisablehook = _unraisable
    try:
        return importlib.import_module(module).main()
    except KeyboardInterrupt:  # (escaped the command: during its imports, before it could clean up anything)
        _exit_interrupted()
    except Exception:
        if not _interrupts:
            raise
        _exit_interrupted()  # (native code turned the KeyboardInterrupt into its own error: pydantic-core's, seen)


def _exit_interrupted() -> None:
    print("interrupted", file=sys.stderr, flush=True)
    os._exit(130)  # an import stopped half-way (torch's native init) can abort in interpreter shutdown


def run() -> None:
    sys.exit(_main("eagle3_runtime.cli"))


def serve() -> None:
    sys.exit(_main("eagle3_runtime.server"))
