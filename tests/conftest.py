import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# decode steps are tiny; multi-threaded small matmuls stall badly on a shared 2-core machine
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def _private_compile_cache(tmp_path_factory):
    """Every test process (and the CLI processes they start) shares one throwaway compile cache,
    never the user's ~/.cache/eagle3-build. Tests about the cache itself use their own."""
    os.environ["EAGLE3_BUILD_CACHE"] = str(tmp_path_factory.mktemp("compile-cache"))
    yield


def run_cli(*args: str, cwd: Path | None = None, timeout: int = 600, env: dict | None = None
            ) -> subprocess.CompletedProcess:
    """Run a console entry point of this project in a fresh process (the way users run it)."""
    exe = {"eagle3-build": "eagle3_build.cli", "eagle3-run": "eagle3_runtime.cli"}[args[0]]
    code = f"import sys; from {exe} import main; sys.argv[0] = {args[0]!r}; sys.exit(main())"
    env = dict(os.environ, COLUMNS="200", **(env or {}))
    return subprocess.run([sys.executable, "-c", code, *args[1:]], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


class TinyBundles:
    """Builds tiny pairs + bundles once per session, keyed by (draft format, K)."""

    def __init__(self, root: Path):
        self.root = root
        self.built: dict[tuple[str, int], tuple[Path, Path]] = {}

    def get(self, fmt: str, k: int) -> tuple[Path, Path]:
        """-> (pair dir with target/ draft/ recipe.yaml, bundle dir)"""
        key = (fmt, k)
        if key not in self.built:
            pair = self.root / f"{fmt}-k{k}"
            r = run_cli("eagle3-build", "make-tiny-pair", str(pair), "--draft-format", fmt, "-k", str(k))
            assert r.returncode == 0, r.stderr
            out = self.root / "artifacts" / f"{fmt}-k{k}"
            r = run_cli("eagle3-build", "compile", str(pair / "recipe.yaml"), "--out", str(out), "--no-verify")
            assert r.returncode == 0, r.stdout + r.stderr
            self.built[key] = (pair, out)
        return self.built[key]


@pytest.fixture(scope="session")
def tiny_bundles(tmp_path_factory) -> TinyBundles:
    return TinyBundles(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def bundle(tmp_path_factory) -> Path:
    """The server tests' bundle (test_server.py, test_hostile_server.py): a tiny speculators pair, K 3,
    with two sequence slots (max_num_seqs 2, batch buckets [1, 2])."""
    from eagle3_build.build import build_bundle
    from eagle3_build.recipe import load_recipe
    from eagle3_build.testing.tiny import make_tiny_pair

    root = tmp_path_factory.mktemp("server")
    recipe = make_tiny_pair(root / "pair", draft_format="speculators")
    text = recipe.read_text().replace("max_num_seqs: 1", "max_num_seqs: 2").replace("batch: [1]", "batch: [1, 2]")
    recipe.write_text(text)
    pair = load_recipe(recipe).pairs[0]
    assert pair.serving.max_num_seqs == 2 and pair.buckets.batch == [1, 2]
    build_bundle(pair, root / "bundle")
    return root / "bundle"
