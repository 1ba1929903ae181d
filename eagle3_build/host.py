"""What the build host has to give: cores and memory (read each time: they change while a build runs)."""
from __future__ import annotations

import os
from pathlib import Path

from eagle3_runtime.host import available_cores as host_cores  # noqa: F401 (the runtime's definitions)
from eagle3_runtime.host import busy_cores  # noqa: F401


def available_memory_bytes() -> int | None:
    """Memory this host can still give (MemAvailable); None where it cannot tell."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def available_memory_gb(unknown: float = 4.0) -> float:
    """available_memory_bytes() in GiB (`unknown` where it cannot tell)."""
    n = available_memory_bytes()
    return unknown if n is None else n / 2**30
