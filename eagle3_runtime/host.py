"""What this host gives a process: its cores (shared by the runtime's thread count and the builder's jobs)."""
from __future__ import annotations

import os
import time
from pathlib import Path


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity: taskset, cgroup cpusets)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1


def busy_cores(seconds: float = 0.3) -> float | None:
    """Cores' worth of CPU time the host's processes used over `seconds` (/proc/stat; None where unreadable): taken
    while the caller sleeps, what others use."""
    def sample():
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    try:
        (t0, i0), _, (t1, i1) = sample(), time.sleep(seconds), sample()
    except (OSError, ValueError, IndexError):
        return None
    return round((1 - (i1 - i0) / max(1, t1 - t0)) * (os.cpu_count() or 1), 2)
