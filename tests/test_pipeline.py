"""The CI artifact pipeline: split builds sharing one cache, assembly from cache hits only, publish to a
remote and serve by reference (file:// remotes take the hf:// code path), and `check` verdicts."""
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import cli_inproc, run_cli
from test_cache import compile_json, statuses
from test_server import ServerProc


@pytest.fixture(scope="module")
def world(built_bundle, tmp_path_factory):
    """The session's tiny pair (speculators, K 3) and its bundle: the single-machine reference."""
    b = built_bundle()
    return {"root": tmp_path_factory.mktemp("pipeline"), "recipe": b.recipe, "single": b.path}


def shard_cmd(recipe: Path, shard: str, cache: Path) -> subprocess.Popen:
    code = ("import sys; from eagle3_build.cli import main; sys.argv = ['eagle3-build', 'compile', *sys.argv[1:]];"
            " sys.exit(main())")
    import os

    return subprocess.Popen([sys.executable, "-c", code, str(recipe), "--shard", shard, "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, EAGLE3_BUILD_CACHE=str(cache)))


def test_split_build_then_assemble_from_cache_only(world):
    root, recipe = world["root"], world["recipe"]
    cache = root / "shared-cache"
    p1, p2 = shard_cmd(recipe, "1/3", cache), shard_cmd(recipe, "2/3", cache)  # two machines at once
    outs = [p.communicate(timeout=900) for p in (p1, p2)]
    p3 = shard_cmd(recipe, "3/3", cache)
    outs.append(p3.communicate(timeout=900))
    shards = []
    for (out, err), p in zip(outs, (p1, p2, p3)):
        assert p.returncode == 0, err[-3000:]
        (done,) = [json.loads(line) for line in out.splitlines() if '"shard_done"' in line]
        shards.append(set(done["graphs"]))
    assert not (root / "artifacts").exists()  # shards write no bundle
    assert all(shards) and sum(len(s) for s in shards) == 6 and len(set.union(*shards)) == 6  # a partition

    # a miss under --require-cached is an error, not a silent compile
    r, ev = compile_json(recipe, root / "partial", root / "empty-cache", "--require-cached")
    assert r.returncode == 1 and not (root / "partial").exists()
    assert set(statuses(ev).values()) == {"failed"}
    assert "--require-cached" in [e for e in ev if e["event"] == "graph_failed"][0]["error"]

    r, ev = compile_json(recipe, root / "assembled", cache, "--require-cached")
    assert r.returncode == 0, r.stderr
    assert set(statuses(ev).values()) == {"cached"}  # 0 compiles
    a = json.loads((root / "assembled" / "manifest.json").read_text())
    s = json.loads((world["single"] / "manifest.json").read_text())
    assert a["digest"] == s["digest"]
    for f in a["graphs"]:
        assert (root / "assembled" / f["file"]["path"]).read_bytes() == (world["single"] / f["file"]["path"]).read_bytes()


def test_push_serve_by_reference_and_refuse_tampering(world, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_RUNTIME_CACHE", str(tmp_path / "runtime-cache"))
    remote = f"file://{tmp_path / 'remote'}@release"
    r = run_cli("eagle3-build", "push", str(world["single"]), remote, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    digest = json.loads((world["single"] / "manifest.json").read_text())["digest"]
    assert info["digest"] == digest
    assert (tmp_path / "remote" / "release" / ".commit_message").read_text().endswith(f"(digest sha256:{digest})")

    r = run_cli("eagle3-build", "pull", remote, "--out", str(tmp_path / "pulled"))
    assert r.returncode == 0 and digest[:16] in r.stderr

    local = run_cli("eagle3-run", str(world["single"]), "--prompt", "The quick brown fox", "--max-tokens", "16", "--json")
    s = ServerProc(remote, log_dir=tmp_path)  # served by reference
    try:
        resp = httpx.post(s.url + "/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 16,
                                                           "temperature": 0}, timeout=120).json()
    finally:
        s.stop()
    assert resp["choices"][0]["token_ids"] == json.loads(local.stdout.strip().splitlines()[-1])["token_ids"]

    # one byte of one remote file changed -> the fetch does not verify, nothing is served
    victim = next((tmp_path / "remote" / "release" / "graphs").glob("*.pt2"))
    data = bytearray(victim.read_bytes())
    data[100] ^= 0x01
    victim.write_bytes(bytes(data))
    r = run_cli("eagle3-run", remote, "--prompt", "hi", "--max-tokens", "4")
    assert r.returncode == 2 and "does not verify" in r.stderr and victim.name in r.stderr
    assert "Traceback" not in r.stderr
    r = run_cli("eagle3-build", "pull", remote)
    assert r.returncode == 2


def test_check_verdicts_and_exit_codes(world, tmp_path):
    import shutil

    ok = cli_inproc("eagle3-build", "check", str(world["single"]), "--files", "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["ok"]
    tp = cli_inproc("eagle3-build", "check", str(world["single"]), "--ranks", "2")
    assert tp.returncode == 5 and "tp_degree 1" in tp.stderr

    from eagle3_runtime.manifest import digest_of

    def variant(name, **update):
        b = tmp_path / name
        shutil.copytree(world["single"], b)
        raw = json.loads((b / "manifest.json").read_text())
        raw.update(update)
        if raw["backend"] == "neuron":  # as data, what a neuron bundle's graphs say: NxD files, int32 indices
            for g in raw["graphs"]:
                g["backend"]["format"] = "nxd-model"
                for spec in g["inputs"][1:]:
                    spec["dtype"] = "int32" if spec["dtype"] == "int64" else spec["dtype"]
        raw["digest"] = digest_of(raw)
        (b / "manifest.json").write_text(json.dumps(raw))
        return b

    neuron = variant("neuron", backend="neuron", toolchain={"torch_neuronx": "2.9.0", "neuronx_cc": "2.21.1",
                                                             "libneuronxla": "2.2.1", "neuron_target": "trn2",
                                                             "neuron_lnc": "2"})
    r = cli_inproc("eagle3-build", "check", str(neuron))
    assert r.returncode == 4 and "not installed" in r.stderr
    schema = variant("schema", schema_version=99)
    r = cli_inproc("eagle3-build", "check", str(schema), "--json")
    assert r.returncode == 3 and "schema version 99" in json.loads(r.stdout)["checks"][0]["detail"]
    r = cli_inproc("eagle3-build", "check", str(tmp_path))
    assert r.returncode == 2 and "not a bundle" in r.stderr
