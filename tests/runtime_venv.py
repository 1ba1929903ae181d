"""The runtime-only venvs of tests/test_runtime_install.py: a fresh venv with `pip install -c requirements-dev.txt
./eagle3_runtime` and nothing else, or with `--torch VERSION` that torch instead of the dev pin (the Neuron SDK's
2.9: PyPI's build). No pytest here: `make test` runs `python3 tests/runtime_venv.py DIR [--torch VERSION]` with
the bare interpreter while .venv is still being installed (DIR/.installed or DIR/.failed when done).

On another torch the install goes through uv: its cache hard-links the files into the venv, so PyPI's torch 2.9
and its CUDA libraries (~6 GB unpacked) are on disk once for this venv and .venv-neuron-stack (which uv installs
from the same cache), not three times (pip's cache of the wheels, then a copy per venv): a CI host with ~15 GB
free ran out of disk with pip."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict:
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONDONTWRITEBYTECODE")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


def pip(venv: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """This interpreter's pip acting on `venv` (which has no pip of its own)."""
    cmd = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def make_runtime_venv(venv: Path, torch_version: str | None = None) -> float:
    """A fresh venv with the runtime distribution alone installed (on `torch_version`, else the dev pin); returns
    the seconds it took."""
    t0 = time.monotonic()
    shutil.rmtree(venv, ignore_errors=True)
    venv.mkdir(parents=True)
    # build from a copy: pip builds in-tree, and with package-dir "." setuptools would leave
    # eagle3_runtime/build/ in the checkout
    src = venv / "src" / "eagle3_runtime"
    shutil.copytree(REPO / "eagle3_runtime", src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    pins = REPO / "requirements-dev.txt"
    if torch_version:  # the dev pins but torch's
        pins = venv / "constraints.txt"
        pins.write_text("".join(line for line in (REPO / "requirements-dev.txt").read_text().splitlines(True)
                                if not line.startswith("torch==")) + f"torch=={torch_version}\n")
    if torch_version:
        uv(venv, "install", "-q", "-c", str(pins), str(src), timeout=1800)
    else:
        pip(venv, "install", "-q", "--no-compile", "-c", str(pins), str(src), timeout=1800)
    return time.monotonic() - t0


def uv(venv: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """uv's pip interface acting on `venv`: uv from PATH or the dev venv, else installed beside `venv` (PyPI `uv`)."""
    exe = shutil.which("uv") or str(REPO / ".venv" / "bin" / "uv")
    if not os.access(exe, os.X_OK):
        tools = venv.parent / f"{venv.name}-uv"
        pip_cmd = [sys.executable, "-m", "pip", "install", "-q", "--target", str(tools), "uv"]
        subprocess.run(pip_cmd, check=True, capture_output=True, timeout=600, env=_env())
        exe = str(tools / "bin" / "uv")
    cmd = [exe, "pip", *args[:1], "--python", str(venv / "bin" / "python"), *args[1:]]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


if __name__ == "__main__":
    target = Path(sys.argv[1]).resolve()
    version = sys.argv[3] if sys.argv[2:3] == ["--torch"] else None
    try:
        seconds = make_runtime_venv(target, version)
    except Exception as e:
        target.mkdir(parents=True, exist_ok=True)
        (target / ".failed").write_text(str(e))
        sys.exit(1)
    (target / ".installed").write_text(f"{seconds:.1f}\n")
    sys.exit(0)
