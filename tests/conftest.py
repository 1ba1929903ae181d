import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# decode steps are tiny; multi-threaded small matmuls stall badly on a shared 2-core machine
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
# the width the CLIs' rich consoles take (read when they are created): tables in full, as run_cli's processes get
os.environ.setdefault("COLUMNS", "200")


@pytest.fixture(scope="session", autouse=True)
def _private_compile_cache(tmp_path_factory):
    """Every test process (and the CLI processes they start) shares one throwaway compile cache,
    never the user's ~/.cache/eagle3-build; under pytest -n its workers share it (entries land atomically).
    Tests about the cache itself use their own."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        cache = tmp_path_factory.getbasetemp().parent / "compile-cache"
        cache.mkdir(exist_ok=True)
    else:
        cache = tmp_path_factory.mktemp("compile-cache")
    os.environ["EAGLE3_BUILD_CACHE"] = str(cache)
    # the CLIs and servers the tests start take one thread too: two test workers share the cores
    os.environ.setdefault("EAGLE3_NUM_THREADS", "1")
    # and speculate every round: a tiny bundle's draft costs about what its target does, so `auto` would
    # decode plainly (tests of the choice itself ask for auto)
    os.environ.setdefault("EAGLE3_SPECULATION", "always")
    yield


def free_port() -> int:
    """A free loopback TCP port (for a server or a torchrun rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(*args: str, cwd: Path | None = None, timeout: int = 600, env: dict | None = None
            ) -> subprocess.CompletedProcess:
    """Run a console entry point of this project in a fresh process (the way users run it)."""
    exe = {"eagle3-build": "eagle3_build.cli", "eagle3-run": "eagle3_runtime.cli"}[args[0]]
    code = f"import sys; from {exe} import main; sys.argv[0] = {args[0]!r}; sys.exit(main())"
    env = dict(os.environ, COLUMNS="200", **(env or {}))
    return subprocess.run([sys.executable, "-c", code, *args[1:]], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


def cli_inproc(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """A console entry point's main() in this process (what run_cli proves, without another interpreter start:
    for error paths; each entry point keeps real-process tests). stdout/stderr captured, `env` set meanwhile."""
    import contextlib
    import io

    from typer.testing import CliRunner

    out, err = io.StringIO(), io.StringIO()
    saved = dict(os.environ)  # restored after: `env`, and whatever the command sets (--debug sets EAGLE3_DEBUG)
    os.environ.update({"COLUMNS": "200", **(env or {})})
    try:
        if args[0] == "eagle3-build":
            from eagle3_build.cli import app

            r = CliRunner().invoke(app, [str(a) for a in args[1:]], prog_name="eagle3-build")
            assert r.exception is None or isinstance(r.exception, SystemExit), r.exc_info
            return subprocess.CompletedProcess(args, r.exit_code, r.stdout, r.stderr)
        from eagle3_runtime.cli import main

        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args[1:]])
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        return subprocess.CompletedProcess(args, code or 0, out.getvalue(), err.getvalue())
    finally:
        os.environ.clear()
        os.environ.update(saved)


# `make test` runs `-n 2 --dist loadgroup`: each file is one unit of work for a worker (as --dist loadfile, so
# its module fixtures stay in one process), except files that share a session bundle: one worker builds it once
XDIST_GROUPS = {"test_server.py": "server-bundle", "test_hostile_server.py": "server-bundle",
                "test_hostile_serving.py": "server-bundle"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(XDIST_GROUPS.get(item.path.name, item.path.name)))


# ------------------------------------------------------------------ tiny pairs and bundles (tests/fixtures)

SERVER_RECIPE = {"serving": {"max_num_seqs": 2}, "buckets": {"batch": [1, 2]}}  # two sequence slots
_factories: list = []


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, _private_compile_cache):
    """The session's TinyFactory: every tiny pair and bundle, made once (see tests/fixtures/__init__.py)."""
    from fixtures import TinyFactory

    if os.environ.get("PYTEST_XDIST_WORKER"):  # one directory for every worker's factory (items made once)
        root = tmp_path_factory.getbasetemp().parent / "tiny"
        root.mkdir(exist_ok=True)
    else:
        root = tmp_path_factory.mktemp("tiny")
    f = TinyFactory(root, session_cache=Path(os.environ["EAGLE3_BUILD_CACHE"]))
    _factories.append(f)
    return f


@pytest.fixture(scope="session")
def tiny_pair(tiny):
    """tiny_pair(**make_tiny_pair_kw) -> recipe path, written once per session."""
    return tiny.pair


@pytest.fixture(scope="session")
def built_bundle(tiny):
    """built_bundle(k=, tp=, padded=, backend=, recipe={...}, **make_tiny_pair_kw) -> fixtures.Built."""
    return tiny.bundle


class TinyBundles:
    """`get(draft format, K)` -> (pair dir with target/ draft/ recipe.yaml, bundle dir), from the factory."""

    def __init__(self, factory):
        self.factory = factory

    def get(self, fmt: str, k: int) -> tuple[Path, Path]:
        b = self.factory.bundle(draft_format=fmt, num_speculative_tokens=k)
        return b.pair, b.path


@pytest.fixture(scope="session")
def tiny_bundles(tiny) -> TinyBundles:
    return TinyBundles(tiny)


@pytest.fixture(scope="session")
def bundle(tiny) -> Path:
    """The server tests' bundle (test_server.py, test_hostile_server.py): a tiny speculators pair, K 3,
    with two sequence slots (max_num_seqs 2, batch buckets [1, 2])."""
    from eagle3_build.recipe import load_recipe

    b = tiny.bundle(recipe=SERVER_RECIPE)
    pair = load_recipe(b.recipe).pairs[0]
    assert pair.serving.max_num_seqs == 2 and pair.buckets.batch == [1, 2]
    return b.path


def pytest_sessionfinish(session):
    """Under pytest -n a worker's terminal summary is not shown: each worker leaves its fixture log for
    the controller to print."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and _factories:
        base = session.config._tmp_path_factory.getbasetemp().parent
        (base / f"tiny-fixtures-{worker}.txt").write_text("\n".join(_fixture_lines()) + "\n")


def _fixture_lines() -> list[str]:
    lines = []
    for f in _factories:
        if f.log:
            lines.append(f"tiny fixtures (tests/fixtures): {sum(w == 'pair' for w, _, _ in f.log)} "
                         f"pairs, {sum(w == 'bundle' for w, _, _ in f.log)} bundles, "
                         f"{sum(s for _, _, s in f.log):.0f}s")
            lines.append(f.summary())
    return lines


def pytest_terminal_summary(terminalreporter, config):
    lines = _fixture_lines()
    if not hasattr(config, "workerinput"):  # the controller (or a run without -n)
        base = config._tmp_path_factory.getbasetemp()
        for path in sorted(base.glob("tiny-fixtures-*.txt")):
            lines += [f"{path.stem.removeprefix('tiny-fixtures-')}: {line}" if i == 0 else line
                      for i, line in enumerate(path.read_text().splitlines())]
    for line in lines:
        terminalreporter.write_line(line)
