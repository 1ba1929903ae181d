"""2 MB pages for torch's tensors in every command that serves or builds (eagle3_runtime.launch.use_huge_pages):
the variable must be set before torch is imported, whichever way the command starts, and torch must honour it."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO

from eagle3_runtime.launch import HUGE_PAGES_ENV, use_huge_pages

# Runs `start` (--help) in a fresh interpreter; prints what $THP_MEM_ALLOC_ENABLE was when torch was first imported
# (by the command, or after it where its --help needs no torch: what the command's own work would see).
PROBE = textwrap.dedent("""
    import importlib.abc, os, sys
    seen = []
    class Watch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "torch" and not seen:
                seen.append(os.environ.get({env!r}, "unset"))
                print("torch imported with", seen[0], flush=True)
            return None
    sys.meta_path.insert(0, Watch())
    sys.argv = ["cmd", "--help"]
    try:
        {start}
    except SystemExit:
        pass
    import torch
""")

STARTS = {
    "eagle3-serve": "from eagle3_runtime.launch import serve; serve()",
    "eagle3-run": "from eagle3_runtime.launch import run; run()",
    "python -m eagle3_runtime.server": "import runpy; runpy.run_module('eagle3_runtime.server', run_name='__main__')",
    "python -m eagle3_runtime.cli": "import runpy; runpy.run_module('eagle3_runtime.cli', run_name='__main__')",
    "eagle3-build": "from eagle3_build.cli import main; main()",
}


def _probe(start: str, env: dict) -> str:
    code = PROBE.format(env=HUGE_PAGES_ENV, start=start)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    lines = [x for x in r.stdout.splitlines() if x.startswith("torch imported with")]
    assert lines, f"no answer:\n{r.stdout}\n{r.stderr}"
    return lines[0].rsplit(" ", 1)[1]


@pytest.mark.parametrize("command", list(STARTS))
def test_every_command_sets_huge_pages_before_torch_is_imported(command):
    env = {k: v for k, v in os.environ.items() if k != HUGE_PAGES_ENV}
    assert _probe(STARTS[command], env) == "1"
    assert _probe(STARTS[command], env | {HUGE_PAGES_ENV: "0"}) == "0"  # (the user's choice kept)


def test_use_huge_pages_keeps_an_explicit_choice(monkeypatch):
    monkeypatch.delenv(HUGE_PAGES_ENV, raising=False)
    use_huge_pages()
    assert os.environ[HUGE_PAGES_ENV] == "1"
    monkeypatch.setenv(HUGE_PAGES_ENV, "0")
    use_huge_pages()
    assert os.environ[HUGE_PAGES_ENV] == "0"


HUGE = textwrap.dedent("""
    import re, torch
    x = torch.ones(64 << 18)  # 64 MB, touched
    start = x.data_ptr()
    text = open("/proc/self/smaps").read()
    kb = 0
    for head, body in re.findall(r"^([0-9a-f]+-[0-9a-f]+) .*?\\n((?:[A-Z][^\\n]*\\n)+)", text, re.M):
        lo, hi = (int(v, 16) for v in head.split("-"))
        if lo <= start < hi:
            kb = int(re.search(r"AnonHugePages:\\s+(\\d+)", body).group(1))
    print(kb)
""")


def _thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")]


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="this kernel gives no transparent huge pages")
def test_torch_backs_large_tensors_with_huge_pages_when_asked():
    def huge_kb(value: str) -> int:
        r = subprocess.run([sys.executable, "-c", HUGE], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, **{HUGE_PAGES_ENV: value}))
        assert r.returncode == 0, r.stderr
        return int(r.stdout.split()[-1])

    assert huge_kb("1") >= 32 << 10  # (at least half the tensor on 2 MB pages)
    if _thp_mode() == "madvise":
        assert huge_kb("0") == 0
