"""The compile worker: a long-lived process (`python -m eagle3_build.backends.worker --serve BACKEND PARENT_PID`)
that compiles one staged graph at a time for the scheduler and answers `done <rc>` per task."""
from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

from ..compile.scheduler import COMPILE_ERROR_EXIT, INJECT_ENV


def run_task(staging: Path, backends: dict) -> int:
    """Compile the graph staged in `staging` (task.json, input.pt2); 0 or COMPILE_ERROR_EXIT."""
    task = json.loads((staging / "task.json").read_text())
    print(f"compiling {task['graph']} (key {task['key'][:16]}…) with backend {task['backend']}", flush=True)
    if task.get("inject") == "crash":
        print("injected crash", flush=True)
        os._exit(70)
    try:
        import torch

        from ..compile.tracing import tracing_process_group
        from .registry import get_backend

        torch.set_num_threads(1)
        ident = json.dumps([task["backend"], task["backend_options"], task["cache_root"]], sort_keys=True)
        if ident not in backends:
            backend = backends[ident] = get_backend(task["backend"], task["backend_options"])
            backend.prepare(Path(task["cache_root"]))
        backend = backends[ident]
        with tracing_process_group(task["tp"]):
            ep = torch.export.load(staging / "input.pt2")
            if task.get("inject"):
                raise RuntimeError(f"injected failure ({INJECT_ENV})")
            info = backend.compile_exported(ep, staging / "out" / f"graph{task['suffix']}", task["key"], task["role"])
    except Exception as e:
        traceback.print_exc()
        (staging / "error.json").write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return COMPILE_ERROR_EXIT
    (staging / "input.pt2").unlink(missing_ok=True)
    (staging / "result.json").write_text(json.dumps({"info": info}))
    print("done", flush=True)
    return 0


def die_with_parent(parent: int) -> None:
    """Linux: this process is killed when the build that started it dies (even by kill -9), rather than
    compiling on for nobody into a staging directory that the next build removes."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux
        return
    if os.getppid() != parent:  # the build died before that took effect
        os._exit(1)


def serve(backend: str) -> int:
    """Worker loop: one staging dir per stdin line; the graph's output (ours, Inductor's, g++'s) goes
    to its compile.log; `done <rc>` goes back on the original stdout. Imports first, while the build
    is still tracing."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    idle = os.open(os.devnull, os.O_WRONLY)
    os.dup2(idle, 1)
    os.dup2(idle, 2)
    try:
        import importlib

        from .. import graphs  # noqa: F401  (torch, the models)

        module = importlib.import_module(f"..backends.{backend}", __package__)
        if hasattr(module, "warm_up"):
            module.warm_up()
    except Exception:  # reported by the first task that needs it
        pass
    backends: dict = {}
    for line in sys.stdin:
        staging = Path(line.strip())
        with open(staging / "compile.log", "ab") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            try:
                rc = run_task(staging, backends)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(idle, 1)
                os.dup2(idle, 2)
        proto.write(f"done {rc}\n")
        proto.flush()
    return 0


if __name__ == "__main__":
    from ..progress import quiet_known_warnings

    quiet_known_warnings()
    die_with_parent(int(sys.argv[3]))
    rc = serve(sys.argv[2])  # (python -m eagle3_build.backends.worker --serve BACKEND PARENT_PID)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # Inductor's compile-worker pool can keep a normal interpreter exit waiting
