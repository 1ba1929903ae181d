"""What a measurement names its host by: CPU model and vector ISA, cores and threads, and what else was running."""
from __future__ import annotations

import contextlib
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

from eagle3_runtime.host import busy_cores


def threads(n: int | None = None) -> int:
    """Set torch's CPU threads: `n`, else $EAGLE3_NUM_THREADS, else the cores this process may use (as eagle3-run)."""
    from eagle3_runtime.tp import set_threads

    return set_threads(n)


def isa() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def host_kind() -> str:
    """A short name for this kind of host from its CPU model and ISA: amd-epyc-avx512, intel-xeon-avx2, ..."""
    from eagle3_runtime.packing import cpu_model

    words = re.sub(r"\((R|TM)\)|CPU|Processor|@.*", " ", cpu_model(), flags=re.I).lower().split()
    vendor = [w for w in words if re.fullmatch(r"[a-z]+", w)][:2] or ["cpu"]
    return "-".join(vendor + [re.sub(r"[^a-z0-9]", "", isa().lower()) or "default"])


def describe(n_threads: int | None) -> dict:
    """The host as results record it; call it before measuring (load and busy cores are the start's)."""
    import torch

    from eagle3_runtime.host import available_cores
    from eagle3_runtime.packing import cpu_description, cpu_model

    return {"kind": host_kind(), "cpu": cpu_description(), "cpu_model": cpu_model(), "isa": isa(),
            "cores": available_cores(), "cpus": os.cpu_count(), "threads": n_threads,
            "loadavg_start": [round(x, 2) for x in os.getloadavg()], "busy_cores_start": busy_cores(),
            "torch": torch.__version__, "python": platform.python_version()}


def summary(host: dict) -> str:
    """One line for a report's header."""
    return (f"{host['threads']} thread(s) on {host['cpu']}, load {host['loadavg_start'][0]}"
            + (f", {host['busy_cores_start']} cores busy at the start" if host.get("busy_cores_start") else ""))


NEIGHBOUR = ("import sys, time\nbusy, period = float(sys.argv[1]), float(sys.argv[2])\nwhile True:\n"
             "    t = time.perf_counter()\n    while time.perf_counter() - t < busy:\n        pass\n"
             "    time.sleep(period - busy)\n")


def parse_neighbour(text: str) -> tuple[float, float]:
    """'BUSY/PERIOD' in seconds (0.05/0.1: busy half of one core) -> (busy, period)."""
    try:
        busy, period = (float(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"{text!r}: expected BUSY/PERIOD in seconds, e.g. 0.05/0.1") from None
    if not 0 < busy < period:
        raise ValueError(f"{text!r}: expected 0 < BUSY < PERIOD")
    return busy, period


@contextlib.contextmanager
def neighbour(busy: float, period: float):
    """Another process on the host while the block runs: one thread busy `busy` s of every `period` s (a log
    shipper, a scrape, a sidecar), placed by the scheduler like any other."""
    proc = subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(busy), str(period)], stdin=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()
