"""One compile cache shared by several builders: `cache prune` / `cache clear` never remove another live
builder's staging directory in tmp/ (it finishes and stores its entry), nor anything there this tool did
not name; a killed builder's staging directories are removed."""
import os
import subprocess
import sys
import time

from conftest import run_cli

BUILDER = r"""
import sys
from eagle3_build.compile.cache import CompileCache

cache = CompileCache(sys.argv[1])
staged = cache.staging_dir()
(staged / "graph.pt2").write_bytes(b"compiled")
print(staged, flush=True)
sys.stdin.readline()  # (the test prunes here)
entry = cache.put("ab" + "0" * 62, staged, {"backend": "export", "graph": "g", "role": "target_decode"})
print("stored", entry.path, flush=True)
"""


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_prune_and_clear_keep_a_live_builders_staging(tmp_path):
    from eagle3_build.compile.cache import HOST, CompileCache

    root = tmp_path / "cache"
    tmp = root / "tmp"
    env = {"EAGLE3_BUILD_CACHE": str(root)}
    for command in (["prune", "--max-size", "0"], ["prune", "--older-than", "0"], ["clear"]):
        builder = subprocess.Popen([sys.executable, "-c", BUILDER, str(root)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
        try:
            staged = builder.stdout.readline().strip()
            assert staged.startswith(str(tmp)), staged
            dead, hex32 = dead_pid(), "0" * 32
            killed = [tmp / f"{dead}-{HOST}-{hex32}", tmp / f"drop-{dead}-{HOST}-{hex32}"]
            kept = [tmp / f"{dead}-0badc0de-{hex32}",  # another host's: its pids mean nothing here
                    tmp / f"{2**40}-{HOST}-{hex32}",  # no pid of ours
                    tmp / "notes", tmp / hex32]  # not named by this tool
            for d in killed + kept:
                d.mkdir(parents=True, exist_ok=True)
            (tmp / "user-file").write_text("mine")
            outside = tmp_path / "outside"
            (outside / "keep").mkdir(parents=True, exist_ok=True)
            link = tmp / f"{dead}-{HOST}-{'1' * 32}"  # a link named like a killed build's: never followed
            if not link.is_symlink():
                link.symlink_to(outside)
            old = time.time() - 3600
            for d in killed + kept + [link]:
                os.utime(d, (old, old), follow_symlinks=False)

            r = run_cli("eagle3-build", "cache", *command, env=env)
            assert r.returncode == 0, r.stderr
            left = {p.name for p in tmp.iterdir()}
            assert os.path.basename(staged) in left, (command, left)
            assert not left & {d.name for d in killed}, (command, left)
            assert {d.name for d in kept} | {"user-file", link.name} <= left, (command, left)
            assert (outside / "keep").is_dir()

            builder.stdin.write("\n")
            builder.stdin.flush()
            out = builder.stdout.readline()
            assert builder.wait(timeout=60) == 0 and out.startswith("stored"), (command, out)
        finally:
            builder.kill()
            builder.wait()
        entry = CompileCache(root).get("ab" + "0" * 62)
        assert entry is not None and entry.files == ["graph.pt2"]


def test_host_tag_names_where_a_pid_means_something():
    from eagle3_build.compile.cache import host_tag

    here = host_tag("ci", "m1", "pid:[4026531836]")
    assert len(here) == 8 and here == host_tag("ci", "m1", "pid:[4026531836]")
    assert here != host_tag("ci", "m1", "pid:[4026532999]")  # a container with the host's name
    assert here != host_tag("ci", "m2", "pid:[4026531836]")  # another machine with the same name
