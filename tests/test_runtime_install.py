"""The runtime installed alone: a fresh venv gets `pip install -c requirements-dev.txt ./eagle3_runtime` and
nothing else (the constraints pin torch to the local CPU wheel; unpinned, pip would pick a multi-GB CUDA
build), then serves a bundle the builder built in the dev venv, through its own eagle3-run and eagle3-serve.

The venv is fresh every session (CI starts from a fresh clone, so a cache would save it nothing). `make test`
builds it in the background, with the bare interpreter while .venv is still being installed
(`python3 tests/runtime_venv.py DIR`, then EAGLE3_RUNTIME_VENV=DIR); run on its own, the fixture builds it. Made cheap without cutting corners:
`venv --without-pip` with this interpreter's pip pointed at it (`pip --python`), and `--no-compile`
(the venv's processes byte-compile what they import instead of all of torch up front).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from runtime_venv import _env, make_runtime_venv, pip

from eagle3_runtime.torch_internals import NEURON_TORCH

VENV_ENV = "EAGLE3_RUNTIME_VENV"  # a venv `make test` is building (DIR/.installed or DIR/.failed when done)
BUILDER_DISTS = {"eagle3-build", "transformers", "gguf", "accelerate", "typer", "rich"}


def _wait_for(venv: Path, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while not (venv / ".installed").exists():
        if (venv / ".failed").exists():
            raise RuntimeError(f"building {venv} failed:\n{(venv / '.failed').read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{venv} was not built within {timeout:.0f}s")
        time.sleep(1)


@pytest.fixture(scope="module")
def runtime_venv(tmp_path_factory) -> Path:
    if os.environ.get(VENV_ENV):
        venv = Path(os.environ[VENV_ENV]).resolve()
        t0 = time.monotonic()
        _wait_for(venv)
        print(f"\nruntime-only venv: built in {(venv / '.installed').read_text().strip()}s in the background "
              f"(waited {time.monotonic() - t0:.1f}s)", file=sys.stderr)
    else:
        venv = tmp_path_factory.mktemp("runtime-install") / "venv"
        print(f"\nruntime-only venv: built in {make_runtime_venv(venv):.1f}s", file=sys.stderr)
    return venv


def test_runtime_distribution_has_no_builder_dependency(runtime_venv):
    import torch

    show = pip(runtime_venv, "show", "eagle3-runtime").stdout
    requires = {d.strip().lower().replace("_", "-") for d in show.split("Requires:")[1].splitlines()[0].split(",")}
    assert {"torch", "safetensors", "tokenizers", "pydantic", "jinja2", "fastapi", "uvicorn"} <= requires, show
    assert not requires & BUILDER_DISTS, show
    listed = {p["name"].lower().replace("_", "-"): p["version"]
              for p in json.loads(pip(runtime_venv, "list", "--format", "json").stdout)}
    assert "eagle3-runtime" in listed and not set(listed) & BUILDER_DISTS, sorted(listed)
    # the dev venv's local CPU torch, never a CUDA build from an index
    assert listed["torch"] == torch.__version__ and not any(n.startswith("nvidia-") for n in listed), listed
    # it imports from the venv, with the builder nowhere on its path
    probe = ("import importlib.util as u, eagle3_runtime; print(eagle3_runtime.__file__); "
             "print(u.find_spec('eagle3_build'), u.find_spec('transformers'))")
    r = subprocess.run([runtime_venv / "bin" / "python", "-c", probe], capture_output=True, text=True,
                       timeout=120, cwd=runtime_venv, env=_env())
    assert r.returncode == 0, r.stderr
    origin, specs = r.stdout.splitlines()
    assert Path(origin).is_relative_to(runtime_venv / "lib") and specs == "None None", r.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"eagle3-serve exited:\n{log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as h:
                if h.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"eagle3-serve did not become healthy:\n{log.read_text()[-3000:]}"
        time.sleep(0.3)


def test_runtime_only_venv_serves_a_built_bundle(runtime_venv, built_bundle):
    from test_runtime_slim import MAX_TOKENS, PROMPT, blocked_run

    bundle = built_bundle().path  # the tiny reference pair (speculators, K 3, export), built in the dev venv
    bin_ = runtime_venv / "bin"
    # the server loads while the two eagle3-run processes (this venv's, the dev venv's) run
    port, log = _free_port(), runtime_venv / "serve.log"
    with open(log, "w") as f:
        serve = subprocess.Popen([bin_ / "eagle3-serve", str(bundle), "--host", "127.0.0.1", "--port", str(port)],
                                 stdout=f, stderr=subprocess.STDOUT, cwd=runtime_venv,
                                 env=_env(EAGLE3_NUM_THREADS="1"))
    try:
        with ThreadPoolExecutor(1) as pool:
            dev = pool.submit(blocked_run, bundle)  # the dev venv's eagle3-run, same arguments (once per session)
            r = subprocess.run([bin_ / "eagle3-run", str(bundle), "--prompt", PROMPT, "--max-tokens",
                                str(MAX_TOKENS), "--json", "--threads", "1"], capture_output=True, text=True,
                               timeout=300, cwd=runtime_venv, env=_env())
            dev = dev.result()
        assert r.returncode == 0, r.stderr
        assert "Warning" not in r.stderr, r.stderr  # e.g. torch's "Failed to initialize NumPy"
        alone = json.loads(r.stdout)
        assert alone["token_ids"] == dev["token_ids"] and len(alone["token_ids"]) == MAX_TOKENS

        url = f"http://127.0.0.1:{port}"
        _wait_healthy(serve, url, log)
        body = json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            assert resp.status == 200
            choice = json.loads(resp.read())["choices"][0]
        assert choice["token_ids"] == alone["token_ids"] and choice["text"] == alone["text"]
    finally:
        serve.terminate()
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            serve.kill()


# ------------------------------------------------------------------ the runtime on the Neuron SDK's torch

VENV_29_ENV = "EAGLE3_RUNTIME_TORCH29_VENV"  # the venv `make test` builds in the background for these


@pytest.fixture(scope="module")
def runtime_venv_29(tmp_path_factory) -> Path:
    if os.environ.get(VENV_29_ENV):
        venv = Path(os.environ[VENV_29_ENV]).resolve()
        _wait_for(venv, timeout=1800)
    else:
        venv = tmp_path_factory.mktemp("runtime-torch29") / "venv"
        make_runtime_venv(venv, NEURON_TORCH)
    return venv


def _run_29(venv: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([venv / "bin" / "eagle3-run", *map(str, args)], capture_output=True, text=True,
                          timeout=600, cwd=venv, env=_env(EAGLE3_NUM_THREADS="1"))


def test_export_bundle_decodes_like_transformers_on_torch_29(runtime_venv_29, built_bundle):
    """A bundle the builder made with the dev torch, served by the runtime alone on torch 2.9 (what Neuron hosts
    run): greedy output equals transformers', no warning printed."""
    import torch
    from transformers import AutoModelForCausalLM

    r = subprocess.run([runtime_venv_29 / "bin" / "python", "-c", "import torch; print(torch.__version__)"],
                       capture_output=True, text=True, timeout=300, env=_env())
    assert r.stdout.startswith(NEURON_TORCH), r.stdout + r.stderr
    built = built_bundle()  # the tiny reference pair (speculators, K 3, export)
    r = _run_29(runtime_venv_29, built.path, "--prompt", "Once upon a time", "--max-tokens", "24", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Warning" not in r.stderr and "W1" not in r.stderr, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    hf = AutoModelForCausalLM.from_pretrained(built.pair / "target", dtype=torch.float32)
    ids = got["prompt_token_ids"]
    want = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    assert got["token_ids"] == want and got["spec_decoding"]["num_accepted_tokens"] > 0


def test_aoti_bundle_of_another_torch_is_refused_in_one_line(runtime_venv_29, tiny):
    """Native code is tied to the torch it was compiled against: on torch 2.9 an aoti bundle built with the dev
    torch is refused before any of its code loads, one line naming both versions and the fix, exit 2."""
    import torch
    from test_aoti import AOTI_RECIPE, buildable

    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("the aoti bundle of tests/test_aoti.py's AVX2 test (an x86 host with AVX2)")
    bundle = tiny.bundle(k=1, recipe={**AOTI_RECIPE, "backend": "aoti", "backend_options": {  # (built once a session)
        "cpu_isa": "avx2", **({"pack_weights": "blocked"} if buildable("blocked") else {})}}, jobs=2).path
    r = _run_29(runtime_venv_29, bundle, "--prompt", "hi", "--max-tokens", "4")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"compiled against torch {torch.__version__}" in lines[0] \
        and f"this host has {NEURON_TORCH}" in lines[0] and "rebuild" in lines[0], r.stderr
