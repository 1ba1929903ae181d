"""The runtime imports and serves with eagle3_build, transformers and compilers made unimportable; its
default torch threads (the cores it is given, shared by torchrun's local ranks)."""
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

BLOCKER = """
import sys
class Block:
    BLOCKED = ("eagle3_build", "transformers", "torch_neuronx", "neuronx_cc", "gguf", "accelerate", "typer")
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.BLOCKED:
            raise ImportError(f"{name} is blocked in this test")
        return None
sys.meta_path.insert(0, Block())
import eagle3_runtime.server  # the HTTP server imports too (FastAPI, uvicorn, jinja2, prometheus_client)
from eagle3_runtime.cli import main
sys.argv[0] = "eagle3-run"
rc = main()
assert not any(m.split(".")[0] in Block.BLOCKED for m in sys.modules), sorted(sys.modules)
sys.exit(rc)
"""


PROMPT, MAX_TOKENS = "Hello there", 8


@functools.cache
def blocked_run(bundle_dir: Path) -> dict:
    """`eagle3-run BUNDLE --prompt PROMPT --max-tokens MAX_TOKENS --json --threads 1` in the dev venv with the
    builder blocked; once per session (test_runtime_install.py compares the runtime-only venv with it)."""
    r = subprocess.run([sys.executable, "-c", BLOCKER, str(bundle_dir), "--prompt", PROMPT,
                        "--max-tokens", str(MAX_TOKENS), "--json", "--threads", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_runtime_runs_without_builder_or_transformers(built_bundle):
    assert len(blocked_run(built_bundle().path)["token_ids"]) == MAX_TOKENS


def test_threads_default_is_the_cores_given_shared_by_local_ranks(monkeypatch):
    import torch

    from eagle3_runtime import tp
    from eagle3_runtime.errors import Eagle3Error

    monkeypatch.setattr(tp.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.delenv("EAGLE3_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert tp.num_threads() == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # torchrun, 3 ranks on this host
    assert tp.num_threads() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert tp.num_threads() == 1
    monkeypatch.setenv("EAGLE3_NUM_THREADS", "5")
    assert tp.num_threads() == 5
    assert tp.num_threads(3) == 3  # --threads wins over the env
    monkeypatch.setenv("EAGLE3_NUM_THREADS", "many")
    with pytest.raises(Eagle3Error, match=r"EAGLE3_NUM_THREADS='many' is not a positive whole number"):
        tp.num_threads()
    before = torch.get_num_threads()
    try:
        assert tp.set_threads(2) == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


CLI_THREADS = """
import os, sys
from eagle3_runtime import cli, server
for env, flag in (("0", []), ("", ["--threads", "0"])):
    os.environ["EAGLE3_NUM_THREADS"] = env
    for main, extra in ((cli.main, ["--prompt", "x"]), (server.main, [])):
        try:
            rc = main(["no-such-bundle", *flag, *extra])
        except SystemExit as e:
            rc = e.code
        print(rc)
"""


def test_both_clis_refuse_bad_thread_counts():
    r = subprocess.run([sys.executable, "-c", CLI_THREADS], capture_output=True, text=True, timeout=300)
    assert r.stdout.split() == ["2"] * 4, r.stdout + r.stderr
    assert r.stderr.count("error: EAGLE3_NUM_THREADS='0' is not a positive whole number of threads") == 2, r.stderr
    assert r.stderr.count("--threads: must be a positive whole number from 1 to 65536, got '0'") == 2, r.stderr
