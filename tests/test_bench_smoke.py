"""Smoke tests of the benchmark harness (`python -m benchmarks`) on tiny pairs: every subcommand's help, the host
kind and result naming, usage errors in one line, and shapes (export backend, a chain and a tree shape, a few
tokens: both shapes with their acceptance and round costs, the PNG, --from-result), graph, engine, vs-vllm (ours
only, interleaved), gemm and prefill measuring for real."""
import collections
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

SUBCOMMANDS = ["demo", "shapes", "engine", "prefill", "graph", "gemm", "gemm-blocking", "serve", "vs-vllm",
               "seeded-repro", "build", "shard", "results"]


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], capture_output=True, text=True, timeout=300,
                          check=False, cwd=REPO)


def _run_bench(*args: str) -> dict:
    r = _bench(*args)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def _recorded(res: dict, threads: int = 1) -> None:
    """What every result carries besides its measurement."""
    h = res["host"]
    assert h["cpu"] and h["isa"] and h["kind"].endswith(h["isa"].lower()) and h["threads"] == threads
    assert len(h["loadavg_start"]) == 3 and len(h["loadavg_end"]) == 3 and h["cores"] >= 1
    assert res["command"].startswith("python -m benchmarks ") and res["date"] and res["git_commit"]


def test_every_subcommand_has_help():
    r = _bench("--help")
    assert r.returncode == 0 and all(c in r.stdout for c in SUBCOMMANDS), r.stdout
    for c in SUBCOMMANDS:
        r = _bench(c, "--help")
        assert r.returncode == 0 and "--help" in r.stdout, (c, r.stdout + r.stderr)


def test_host_kind_and_result_names(monkeypatch, tmp_path):
    from benchmarks import host, results

    monkeypatch.setattr(host, "isa", lambda: "AVX512")
    for model, kind in (("AMD EPYC 9R14 96-Core Processor", "amd-epyc-avx512"),
                        ("Intel(R) Xeon(R) Platinum 8488C", "intel-xeon-avx512"), ("AMD EPYC", "amd-epyc-avx512")):
        monkeypatch.setattr("eagle3_runtime.packing.cpu_model", lambda m=model: m)
        assert host.host_kind() == kind
    assert results.record_path("smollm2-demo-speed") == REPO / "benchmarks/results/smollm2-demo-speed.amd-epyc-avx512.json"
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    res = results.finish({"benchmark": "x"}, host.describe(1))  # --record NAME: NAME.<host-kind>.json, one per kind
    results.save(res, record="m")
    results.save({**res, "again": True}, record="m")
    assert [p.name for p in tmp_path.iterdir()] == ["m.amd-epyc-avx512.json"]
    assert json.loads((tmp_path / "m.amd-epyc-avx512.json").read_text())["again"] and res["host"]["threads"] == 1
    # the committed results follow the scheme: <measurement>.<host-kind>.<ext>, one per measurement and host kind
    names = [p.name for p in (REPO / "benchmarks" / "results").iterdir() if p.name != "neuron-hlo.json"]
    assert all(len(n.split(".")) == 3 and n.split(".")[1].rsplit("-", 1)[1] in ("avx2", "avx512") for n in names), names
    measured = [n.split(".")[0] + "-" for n in names]  # (no host, thread count or retry in the measurement's name)
    assert not [m for m in measured if any(t in m for t in ("-xeon-", "-zen3-", "-r2-", "-reversed-", "-t2-"))], names


def test_usage_errors_are_one_line():
    for args, words in ((["gemm", "--rows", "1,x"], "--rows"), (["gemm-blocking", "--variants", "8y8"], "8y8"),
                        (["shapes", "--phases", "decode,nope"], "nope"), (["engine", "a"], "two bundles"),
                        (["serve"], "--bundle"), (["demo", "/nonexistent-bundle"], "no manifest.json; not a bundle"),
                        (["vs-vllm", "--bundle", "b", "--no-vllm", "--concurrency", "1,4"], "--interleave"),
                        (["vs-vllm", "--bundle", "b", "--no-vllm", "--concurrency", "0"], "--concurrency"),
                        (["vs-vllm", "--bundle", "b", "--no-vllm", "--eagle3", "auto@8k"], "auto@8k")):
        r = _bench(*args)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


@pytest.mark.slow  # ~45 s idle (tiny pair + a tree shape's graphs + decode + transformers + one cold process)
def test_shapes_smoke(tiny_bundles, tmp_path):
    pytest.importorskip("matplotlib")
    from eagle3_runtime.reader import read_manifest

    pair, _ = tiny_bundles.get("speculators", 1)  # warms the session's compile cache for the chain's graphs
    out = tmp_path / "report"
    r = _bench("shapes", str(pair / "recipe.yaml"), "--backend", "export", "--shapes", "chain:1,tree:2x2x4",
               "--num-prompts", "2", "--max-tokens", "6", "--phases", "decode,transformers,cold", "--cold-runs", "1",
               "--min-buckets", "--hf-dtypes", "float32", "--out", str(out), "--save-result", str(out / "r.json"),
               "--plot", str(out / "r.png"), "--threads", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "r.json").read_text())
    _recorded(res)
    assert res["shapes"] == ["chain-k1", "tree-2x2x4"] and [e["name"] for e in res["decode"]] == res["shapes"]
    chain, tree = res["decode"]
    assert chain["shape"]["kind"] == "chain" and chain["shape"]["describe"] == "chain K 1"
    assert (tree["shape"]["kind"], tree["shape"]["depth"], tree["shape"]["topk"], tree["shape"]["num_nodes"]) == (
        "dynamic", 2, 2, 4)
    for e, depth, nodes in ((chain, 1, 2), (tree, 2, 4)):
        a, rm, g = e["acceptance"], e["round_ms"], e["graphs"]
        assert e["spec"]["decode_tok_s"] > 0 and e["plain"]["decode_tok_s"] > 0 and e["spec"]["generated_tokens"] > 0
        assert e["K"] == depth and e["nodes_per_verify"] == nodes and e["spec_equals_plain"] == "2/2"
        assert len(a["per_position_acceptance_rate"]) == depth and 1 <= a["mean_acceptance_length"] <= depth + 1
        assert a["num_drafts"] > 0 and a["drafted_nodes_per_round"] == nodes - 1
        # the per-graph profile of the measured runs: every speculative round is one verify pass
        assert g["target_verify/1"]["calls"] == a["num_drafts"] == rm["rounds"] and g["target_decode/1"]["calls"] > 0
        assert rm["verify_ms"] > 0 and rm["draft_ms_per_round"] > 0 and rm["plain_decode_ms"] > 0
    assert "draft_step/1" not in chain["graphs"] and chain["round_ms"]["draft_step_ms"] is None  # K 1: no draft step
    assert tree["graphs"]["draft_step/1"]["calls"] == tree["acceptance"]["num_drafts"]  # depth - 1 steps a round
    assert res["transformers"]["float32"]["decode_tok_s"] > 0
    s = res["summary"]
    assert s["best_shape"] in res["shapes"] and "runtime_vs_transformers" in s and "best_vs_chain_k3" not in s
    assert res["builds"]["chain-k1"]["compiled"] == 0  # every chain graph came from the compile cache
    assert (out / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    c = res["cold_start"]
    assert c["shape"] == s["best_shape"] and c["prebuilt"]["median_s"] > 0  # on the best shape's full bundle
    # --min-buckets: the first shape keeps every prefill bucket (here: the full bundle), the others one (a "-min"
    # bundle where that is fewer than the full bundles have: not with the tiny pair's one bucket and batch 1)
    m = read_manifest(Path(tree["bundle"]))
    assert m.batch_buckets == [1] and len(m.prefill_buckets) == 1
    assert m.prefill_buckets[0] in res["bundle"]["prefill_buckets"]
    fewer = res["bundle"]["prefill_buckets"] != m.prefill_buckets or res["bundle"]["batch_buckets"] != [1]
    assert chain["bundle"].endswith("chain-k1") and tree["bundle"].endswith("tree-2x2x4" + "-min" * fewer)
    # re-rendering the saved report measures nothing
    r = _bench("shapes", "--from-result", str(out / "r.json"), "--note", "n", "--plot", str(out / "again.png"))
    assert r.returncode == 0 and "note: n" in r.stdout and (out / "again.png").exists(), r.stderr[-2000:]


@pytest.mark.slow  # (34 s: a benchmark, not a product component)
def test_graph_smoke(tiny_bundles, tmp_path):
    """Two bundles side by side (the same one twice): every batch-bucket graph timed for each."""
    _, bundle = tiny_bundles.get("speculators", 3)
    res = _run_bench("graph", str(bundle), str(bundle), "--repeats", "2", "--position", "8",
                     "--save-result", str(tmp_path / "g.json"))
    assert json.loads((tmp_path / "g.json").read_text()) == res
    _recorded(res)
    assert {"target_verify_b1", "target_decode_b1", "draft_chain_b1", "draft_catchup_b1"} <= set(res["graphs"])
    assert all(len(v) == 2 and v[0]["ratio_to_first"] == 1.0 and v[1]["median_ms"] > 0 for v in res["graphs"].values())
    bad = _bench("graph", str(bundle), "--graphs", "no_such_graph")
    assert bad.returncode != 0 and "no_such_graph" in bad.stderr


@pytest.mark.slow  # (a benchmark, not a product component)
def test_engine_smoke(tiny_bundles, tmp_path):
    """The same bundle as A and B: both decode, the same tokens, every loop graph timed for each."""
    _, bundle = tiny_bundles.get("speculators", 3)
    prompts = tmp_path / "p.txt"
    prompts.write_text("The quick brown fox\nOnce upon a time\n")
    res = _run_bench("engine", str(bundle), str(bundle), "--prompts", str(prompts), "--num-prompts", "2",
                     "--max-tokens", "12", "--repeats", "1", "--threads", "1", "--no-chat",
                     "--save-result", str(tmp_path / "r.json"))
    assert json.loads((tmp_path / "r.json").read_text()) == res
    _recorded(res)
    assert res["same_tokens"] and min(res["decode_tok_s"].values()) > 0 and set(res["b_over_a"]) == {"speculative", "plain"}
    assert {"target_verify_b1", "target_decode_b1", "draft_chain_b1"} <= set(res["graphs_ms"])
    assert all(v["A"] > 0 and v["B"] > 0 for v in res["graphs_ms"].values())


@pytest.mark.slow  # (a benchmark, not a product component)
def test_vs_vllm_interleaved_smoke(tiny_bundles, tmp_path):
    """vs-vllm --interleave, ours only: both servers up at once and the in-process engines, each prompt through
    every contender in turn (plain decoding also on 4 KB pages); every contender's outputs equal plain greedy
    decoding's; each server's start and its CPU use after a request measured; then the prompts as a closed loop of 2
    clients, the same outputs."""
    _, bundle = tiny_bundles.get("speculators", 3)
    prompts = tmp_path / "p.txt"
    prompts.write_text("The quick brown fox\nOnce upon a time\nName a color.\n")
    res = _run_bench("vs-vllm", "--bundle", str(bundle), "--no-vllm", "--prompts", str(prompts), "--num-prompts",
                     "3", "--max-tokens", "12", "--threads", "1", "--eagle3", "chain3,none,none@4k", "--interleave",
                     "--gap", "0", "--neighbour", "0.01/0.02", "--concurrency", "1,2", "--concurrent-repeats", "2",
                     "--save-result", str(tmp_path / "r.json"))
    assert json.loads((tmp_path / "r.json").read_text()) == res and res["interleaved"]
    _recorded(res)
    served = {"eagle3 chain3", "eagle3 none", "eagle3 none@4k"}
    assert set(res["contenders"]) == served | {f"{n} +neighbour" for n in served}
    assert set(res["in_process"]) == {"chain3", "none"} and set(res["huge_vs_4k_pages"]) == {"eagle3 none"}
    assert set(res["with_neighbour_vs_alone"]) == served and res["neighbour"]["busy_s"] == 0.01
    assert all(c["same_text_as_plain"] == 3 and c["tokens"] > 0 for c in res["contenders"].values())
    assert res["contenders"]["eagle3 chain3"]["acceptance_length"] >= 1.0
    assert res["served_vs_in_process_chain3"] > 0 and res["served_vs_in_process_none"] > 0
    assert all(c["start_s"] > 0 and c["spin_after_request_s"] >= 0 for c in res["contenders"].values())
    two = res["at_once"]["2"]
    assert set(two["servers"]) == served and (res["concurrent_prompts"], res["concurrent_repeats"]) == (3, 2)
    assert all(r["same_text_as_one_at_a_time"] == 6 and r["tok_s_total"] > 0 and r["tpot_ms_median"] > 0
               and len(r["tok_s_per_pass"]) == 2 for r in two["servers"].values()) and two["vllm_best"] is None


def test_gemm_smoke(tmp_path):
    cfg = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    res = _run_bench("gemm", "--config", str(tmp_path / "config.json"), "--rows", "1,4,16", "--repeats", "2",
                     "--threads", "1")
    _recorded(res)
    assert res["projections"] == 2 * 7 + 1 and [r["rows"] for r in res["results"]] == [1, 4, 16]
    import torch  # this CPU torch has oneDNN: its prepacked form is measured too, the fastest and the choice named
    assert torch.backends.mkldnn.is_available() and "onednn" in res["formats"] and "plain" in res["formats"]
    assert all(set(r["ms"]) == set(res["formats"]) and min(r["ms"].values()) > 0 for r in res["results"])
    assert all(r["fastest"] in res["formats"] and r["chosen"] in res["formats"][1:] for r in res["results"])


@pytest.mark.slow  # (a benchmark, not a product component: the plan itself is tests/test_long_prompts.py)
def test_prefill_smoke(tiny_bundles, tmp_path):
    """The plan against padding, a prompt past the largest bucket (64) among them: continued in both arms,
    counted as the plan's."""
    _, bundle = tiny_bundles.get("speculators", 3)
    prompts = tmp_path / "p.txt"
    prompts.write_text("The quick brown fox\n" + "the lazy dog sleeps in the sun " * 15 + "\nOnce upon a time\n")
    res = _run_bench("prefill", str(bundle), "--prompts", str(prompts), "--num-prompts", "3", "--repeats", "1",
                     "--threads", "1", "--no-chat", "--save-result", str(tmp_path / "r.json"))
    assert json.loads((tmp_path / "r.json").read_text()) == res
    _recorded(res)
    assert res["prompts"] == 3 and len(res["continued"]) == 1 and res["continued"][0] > 64
    assert res["plans"][1]["bucket"] == 64 and res["plans"][1]["continued_by"] == "chain K 3"
    assert res["plan"]["all"]["median_ms"] > 0 and res["padded"]["continued"]["mean_ms"] > 0
    assert res["continued_padded_over_plan"] > 0


def test_mtbench_mix_takes_the_categories_in_turn():
    """`--prompts mtbench-mix`: MT-Bench's first turns, the i-th of every category before any (i+1)-th, so any
    first 8n of them hold n of each of the 8 categories (the issue tables' "5 per category" is the first 40)."""
    from benchmarks.prompts import texts
    from training.eval_sets import mtbench_questions

    category = {q["turns"][0]: q["category"] for q in mtbench_questions()}
    mix = texts("mtbench-mix")
    assert sorted(mix) == sorted(texts("mtbench")) and len(mix) == 80
    for n in (1, 2, 5, 10):
        assert collections.Counter(category[t] for t in mix[:8 * n]) == {c: n for c in set(category.values())}
