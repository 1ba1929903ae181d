"""Result files: the host, the command line, the git commit and the date beside what was measured."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .host import host_kind

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def git_commit() -> str | None:
    r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        return None
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True, check=False).stdout.strip()
    return r.stdout.strip() + ("+changes" if dirty else "")


def record_path(name: str) -> Path:
    """Where the one current result of `name` on this kind of host lives."""
    return RESULTS / f"{name}.{host_kind()}.json"


def finish(res: dict, host: dict) -> dict:
    """`res` with the host (load at the end too), the command, the commit and the date; returns it."""
    host = {**host, "loadavg_end": [round(x, 2) for x in os.getloadavg()]}
    return {"host": host, "command": " ".join(["python -m benchmarks", *sys.argv[1:]]), "git_commit": git_commit(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **res}


def save(res: dict, save_result: Path | None = None, record: str | None = None, indent: int | None = 1) -> None:
    """Write `res` to --save-result and / or --record's file."""
    for path in [p for p in (save_result, record and record_path(record)) if p]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=indent) + "\n")
        print(f"wrote {path}", file=sys.stderr)


def emit(res: dict, save_result: Path | None = None, record: str | None = None) -> None:
    """Save `res` and print it as stdout's last line (what scripts and tests read)."""
    save(res, save_result, record)
    print(json.dumps(res), flush=True)
