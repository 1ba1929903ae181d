"""The runtime's console entry points (eagle3-run, eagle3-serve). Each command's module is imported
inside the guard, so that Ctrl-C during its start-up imports (torch alone takes a second) ends the
same way as later: one line and exit 130, no traceback."""
from __future__ import annotations

import importlib
import sys


def _main(module: str) -> int:
    try:
        return importlib.import_module(module).main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def run() -> None:
    sys.exit(_main("eagle3_runtime.cli"))


def serve() -> None:
    sys.exit(_main("eagle3_runtime.server"))
