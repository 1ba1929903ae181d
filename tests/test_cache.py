"""Compile cache, parallel compile, failures and reproducible bundles (export backend: the cache
logic is backend-independent; tests/test_aoti.py covers the aoti backend through the same path)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import cli_inproc, run_cli

GRAPHS = 6  # the tiny pair's bundle: target prefill (one bucket), decode, verify; draft prefill, catch-up, the unrolled chain


def compile_json(recipe: Path, out: Path, cache: Path, *extra: str, env: dict | None = None, inproc: bool = False):
    """`compile --json` in a fresh process (or, `inproc`, its main() in this one); -> (result, events)."""
    run = cli_inproc if inproc else run_cli
    r = run("eagle3-build", "compile", str(recipe), "--out", str(out), "--json", "--no-verify", *extra,
            env={"EAGLE3_BUILD_CACHE": str(cache), **(env or {})})
    events = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    return r, events


def statuses(events) -> dict[str, str]:
    """Final status of every graph."""
    out = {}
    for e in events:
        if e["event"] == "graph" and e["status"] in ("cached", "compiled", "failed"):
            out[e["graph"]] = e["status"]
    return out


def tree_bytes(root: Path, sub: str) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted((root / sub).rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def world(built_bundle):
    """The session's tiny pair (speculators, K 3), built once into a cold cache of its own (every test
    below starts from a copy of that cache)."""
    b = built_bundle()
    return {"recipe": b.recipe, "cache": b.cache, "bundle": b.path, "events": list(b.events)}


@pytest.fixture
def pair(world):
    return world["recipe"]


def warm_cache(world, tmp_path) -> Path:
    dst = tmp_path / "cache"
    shutil.copytree(world["cache"], dst)
    return dst


def test_warm_rebuild_compiles_nothing_and_clean_builds_are_identical(world, pair, tmp_path):
    cache_a, cache_b = warm_cache(world, tmp_path), tmp_path / "cache-b"
    shutil.copytree(world["bundle"], tmp_path / "b1")
    first = statuses(world["events"])
    assert len(first) == GRAPHS and set(first.values()) == {"compiled"}
    (built,) = [e for e in world["events"] if e["event"] == "built"]
    assert built["compiled"] == GRAPHS and built["cached"] == 0

    # warm: same recipe, same cache -> every graph is a hit, nothing compiles
    r, ev = compile_json(pair, tmp_path / "b2", cache_a)
    assert r.returncode == 0, r.stderr
    assert set(statuses(ev).values()) == {"cached"}
    assert [e for e in ev if e["event"] == "built"][0]["compiled"] == 0

    # clean: an empty cache elsewhere -> the same bytes and the same digest
    r, _ = compile_json(pair, tmp_path / "b3", cache_b)
    assert r.returncode == 0, r.stderr
    m = [json.loads((tmp_path / b / "manifest.json").read_text()) for b in ("b1", "b2", "b3")]
    assert m[0]["digest"] == m[1]["digest"] == m[2]["digest"] != ""
    assert m[0]["created_at"] and m[0]["build"]["compiled"] == GRAPHS and m[1]["build"]["cached"] == GRAPHS
    for sub in ("weights", "graphs", "tokenizer", "configs"):
        assert tree_bytes(tmp_path / "b1", sub) == tree_bytes(tmp_path / "b3", sub), sub
    keys = [{g["name"]: g["key"] for g in mm["graphs"]} for mm in m]
    assert keys[0] == keys[1] == keys[2]

    # the runtime refuses a manifest edited after the build (the digest covers it)
    from eagle3_runtime.bundle import Bundle, BundleError

    path = tmp_path / "b2" / "manifest.json"
    raw = json.loads(path.read_text())
    raw["max_num_seqs"] = 4
    path.write_text(json.dumps(raw))
    with pytest.raises(BundleError, match="modified after the build"):
        Bundle(tmp_path / "b2")


def test_changing_k_recompiles_only_graphs_whose_shapes_changed(world, tiny, tmp_path):
    cache = warm_cache(world, tmp_path)
    k1 = tiny.recipe(k=1)  # the same pair, num_speculative_tokens 1
    r, ev = compile_json(k1, tmp_path / "k1", cache)
    assert r.returncode == 0, r.stderr
    st = statuses(ev)
    assert {g for g, s in st.items() if s == "compiled"} == {"target_verify_b1", "draft_catchup_b1"}
    assert sum(s == "cached" for s in st.values()) == GRAPHS - 3  # (K 1 has no draft_step)
    assert not {"draft_step_b1", "draft_chain_b1"} & set(st)


def test_renamed_or_finetuned_checkpoint_hits_the_cache(world, pair, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    cache = warm_cache(world, tmp_path)
    shutil.copytree(world["bundle"], tmp_path / "orig")
    copy = tmp_path / "renamed-pair"
    shutil.copytree(pair.parent, copy)
    (copy / "target").rename(copy / "my-finetune")
    recipe = copy / "recipe.yaml"
    recipe.write_text(recipe.read_text().replace("./target", "./my-finetune"))
    # a "fine-tune": same architecture, different weights
    st = copy / "my-finetune" / "model.safetensors"
    w = load_file(st)
    name = next(n for n in w if n.endswith("mlp.down_proj.weight"))
    w[name] = w[name] + 0.01 * torch.randn_like(w[name])
    save_file(w, st, metadata={"format": "pt"})
    r, ev = compile_json(recipe, tmp_path / "renamed", cache)
    assert r.returncode == 0, r.stderr
    assert set(statuses(ev).values()) == {"cached"}
    m0 = json.loads((tmp_path / "orig" / "manifest.json").read_text())
    m1 = json.loads((tmp_path / "renamed" / "manifest.json").read_text())
    assert m0["digest"] != m1["digest"]  # a different artifact (its weights differ), the same graphs
    assert [g["file"]["sha256"] for g in m0["graphs"]] == [g["file"]["sha256"] for g in m1["graphs"]]


@pytest.mark.parametrize("jobs", [pytest.param("1", marks=pytest.mark.slow), "2"])
def test_failed_graph_gives_table_exit_1_no_bundle_and_is_retried(world, pair, tmp_path, jobs):
    # a warm cache without three graphs: the failing one, the crashing one and one that compiles
    cache, art = warm_cache(world, tmp_path), tmp_path / "art"
    missing = {"target_decode_b1", "draft_chain_b1", "target_verify_b1"}
    for entry in (cache / "graphs").glob("*/*/entry.json"):
        if json.loads(entry.read_text())["graph"] in missing:
            shutil.rmtree(entry.parent)
    r, ev = compile_json(pair, art / "b", cache, "--jobs", jobs,
                         env={"EAGLE3_BUILD_INJECT_FAILURE": "target_decode_b1,draft_chain_b1:crash"})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    st = statuses(ev)
    assert st["target_decode_b1"] == "failed"
    # one failure does not stop the others
    assert {g for g, s in st.items() if s == "compiled"} == missing - {"target_decode_b1"}
    assert sum(s == "cached" for s in st.values()) == GRAPHS - 3
    if jobs == "2":  # a worker that dies is retried once (the injected crash is transient)
        assert any(e["event"] == "graph" and e["status"] == "retrying" and e["graph"] == "draft_chain_b1" for e in ev)
    (failure,) = [e for e in ev if e["event"] == "graph_failed"]
    assert failure["graph"] == "target_decode_b1" and "injected failure" in failure["error"]
    assert Path(failure["log"]).is_file() and "injected failure" in Path(failure["log"]).read_text()
    assert not art.exists() or not any(art.iterdir())  # no bundle, no temporary directory

    # the human-readable table (same failure, without --json; main() in-process, one job: the table is the same)
    r2 = cli_inproc("eagle3-build", "compile", str(pair), "--out", str(art / "b"), "--jobs", "1",
                    env={"EAGLE3_BUILD_CACHE": str(cache), "EAGLE3_BUILD_INJECT_FAILURE": "target_decode_b1"})
    assert r2.returncode == 1
    text = " ".join(r2.stderr.split())
    assert "target_decode_b1" in text and "injected failure" in text and "no bundle written" in text
    assert "failed last time" in cli_inproc("eagle3-build", "cache", "ls", env={"EAGLE3_BUILD_CACHE": str(cache)}).stdout

    # the failure is recorded, not cached: the next build compiles exactly that graph
    r, ev = compile_json(pair, art / "b", cache, "--jobs", "1", inproc=True)
    assert r.returncode == 0, r.stderr
    assert statuses(ev) == {**{g: "cached" for g in st}, "target_decode_b1": "compiled"}
    assert (art / "b" / "manifest.json").is_file()


def test_cache_ls_prune_clear(world, pair, tmp_path):
    cache = warm_cache(world, tmp_path)
    env = {"EAGLE3_BUILD_CACHE": str(cache)}
    r = cli_inproc("eagle3-build", "cache", "ls", "--json", env=env)
    listing = json.loads(r.stdout)
    assert len(listing["entries"]) == GRAPHS and all(e["bytes"] > 0 for e in listing["entries"])
    assert cli_inproc("eagle3-build", "cache", "prune", env=env).returncode == 2  # needs a criterion
    r = cli_inproc("eagle3-build", "cache", "prune", "--older-than", "1", env=env)
    assert r.returncode == 0 and "removed 0" in r.stderr  # everything was used today
    r = cli_inproc("eagle3-build", "cache", "prune", "--max-size", "0", env=env)
    assert r.returncode == 0 and f"removed {GRAPHS}" in r.stderr
    (plan,) = json.loads(cli_inproc("eagle3-build", "plan", str(pair), "--json", env=env).stdout)
    assert {g["cache"] for g in plan["graphs"]} == {"miss"}
    shutil.copytree(world["cache"] / "graphs", cache / "graphs", dirs_exist_ok=True)
    r = cli_inproc("eagle3-build", "cache", "clear", env=env)
    assert r.returncode == 0 and f"removed {GRAPHS}" in r.stderr
    assert json.loads(cli_inproc("eagle3-build", "cache", "ls", "--json", env=env).stdout)["entries"] == []


def test_corrupt_cache_entry_is_recompiled(world, pair, tmp_path):
    cache = warm_cache(world, tmp_path)
    victim = next(cache.glob("graphs/*/*/graph.pt2"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    r, ev = compile_json(pair, tmp_path / "b", cache)
    assert r.returncode == 0
    assert sum(s == "compiled" for s in statuses(ev).values()) == 1


def test_ctrl_c_stops_cleanly(pair, tmp_path):
    """SIGINT during a parallel build: workers stopped, staging and bundle temp dirs removed, exit 130."""
    cache, art = tmp_path / "cache", tmp_path / "art"
    # Ctrl-C handler installed explicitly: a test run started in the background (`pytest &`, nohup) has SIGINT
    # ignored, the child inherits that, and Python only installs its handler over the default disposition
    code = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from eagle3_build.cli import main; sys.argv = ['eagle3-build', 'compile', sys.argv[1], "
            "'--out', sys.argv[2], '--jobs', '2', '--json']; sys.exit(main())")
    env = dict(os.environ, EAGLE3_BUILD_CACHE=str(cache))
    p = subprocess.Popen([sys.executable, "-c", code, str(pair), str(art / "b")], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in p.stdout:
            if '"status": "compiling"' in line:
                break
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        rc = p.wait(timeout=60)
    finally:
        p.kill()
    assert rc == 130, p.stderr.read()
    assert not art.exists() or not any(art.iterdir())
    assert not any((cache / "tmp").iterdir()) if (cache / "tmp").exists() else True


def test_plan_reports_cache_status_estimates_and_weight_sizes(world, pair, tmp_path):
    from safetensors import safe_open

    r = cli_inproc("eagle3-build", "plan", str(pair), "--json", env={"EAGLE3_BUILD_CACHE": str(tmp_path / "empty")})
    assert r.returncode == 0, r.stderr
    (before,) = json.loads(r.stdout)
    assert len(before["graphs"]) == GRAPHS and {g["cache"] for g in before["graphs"]} == {"miss"}
    assert all(g["estimate_s"] > 0 and g["key"] for g in before["graphs"])
    verify = next(g for g in before["graphs"] if g["name"] == "target_verify_b1")
    assert verify["inputs"][1] == {"name": "tokens", "shape": [1, 4], "dtype": "int64"}
    env = {"EAGLE3_BUILD_CACHE": str(world["cache"])}
    (after,) = json.loads(cli_inproc("eagle3-build", "plan", str(pair), "--json", env=env).stdout)
    assert {g["cache"] for g in after["graphs"]} == {"hit"} and after["estimate_s"] == 0
    m = json.loads((world["bundle"] / "manifest.json").read_text())
    assert [g["key"] for g in after["graphs"]] == [g["key"] for g in m["graphs"]]
    # per-rank weight bytes from configs + headers == the tensor bytes the build wrote
    for model in ("target", "draft"):
        with safe_open(world["bundle"] / "weights" / model / "rank0.safetensors", "pt") as f:
            written = sum(f.get_tensor(k).nbytes for k in f.keys())
        assert after["weight_bytes_per_rank"][model] == written
    text = cli_inproc("eagle3-build", "plan", str(pair), env=env).stdout
    assert f"{GRAPHS} graphs (0 to compile)" in " ".join(text.split())


def test_entry_json_that_is_not_an_entry_is_a_miss_listed_and_pruned(world, pair, tmp_path):
    """entry.json holding `[]`, an object without its files, or truncated JSON: `compile` compiles that graph again
    (the entry replaced), `cache ls` lists it as corrupt, `cache prune` removes it; a failure record or trace memo
    that is not an object is no traceback either."""
    from eagle3_build.compile.cache import CompileCache

    cache = warm_cache(world, tmp_path)
    bad = {"[]": "[]", "no files": '{"key": "x", "files": 3}', "truncated": '{"backend": "export", "fi'}
    entries = sorted(cache.glob("graphs/*/*/entry.json"))[:len(bad)]
    for path, text in zip(entries, bad.values()):
        path.write_text(text)
    (cache / "failures").mkdir(exist_ok=True)
    (cache / "failures" / f"{'0' * 64}.json").write_text("[]")
    next(cache.glob("traces/*.json")).write_text("[]")
    env = {"EAGLE3_BUILD_CACHE": str(cache)}

    listing = json.loads(cli_inproc("eagle3-build", "cache", "ls", "--json", env=env).stdout)
    corrupt = {e["key"] for e in listing["entries"] if e.get("corrupt")}
    assert corrupt == {p.parent.name for p in entries} and len(listing["entries"]) == GRAPHS
    r = cli_inproc("eagle3-build", "cache", "ls", env=env)
    assert r.returncode == 0 and r.stdout.count("corrupt") >= len(bad), r.stdout

    copy = tmp_path / "copy"
    shutil.copytree(cache, copy)
    r, ev = compile_json(pair, tmp_path / "b", cache, inproc=True)
    assert r.returncode == 0, r.stderr
    assert sum(s == "compiled" for s in statuses(ev).values()) == len(bad)
    assert all(json.loads(p.read_text())["files"] for p in entries)  # replaced by the new compiles
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["digest"] == \
        json.loads((world["bundle"] / "manifest.json").read_text())["digest"]

    r = cli_inproc("eagle3-build", "cache", "prune", "--older-than", "1", env={"EAGLE3_BUILD_CACHE": str(copy)})
    assert r.returncode == 0 and f"removed {len(bad)} entries" in r.stderr, r.stderr
    assert not any((copy / p.relative_to(cache)).parent.exists() for p in entries)
    assert len(CompileCache(copy).entries()) == GRAPHS - len(bad)
