"""What this host gives a process: its cores (shared by the runtime's thread count and the builder's jobs)."""
from __future__ import annotations

import os


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity: taskset, cgroup cpusets)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1
