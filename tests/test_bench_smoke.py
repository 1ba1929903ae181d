"""Smoke tests of the benchmarks on tiny pairs: spec_report.py (export backend, a chain and a tree shape,
a few tokens: the report's JSON has both shapes with their acceptance and round costs, the PNG is
written, and --from-result re-renders it), graph_latency.py, engine_ab.py, vs_vllm.py (ours only, interleaved),
linear_layout.py, prefill_plan.py."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO


def _spec_report():
    spec = importlib.util.spec_from_file_location("spec_report", REPO / "benchmarks" / "spec_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow  # ~45 s idle (tiny pair + a tree shape's graphs + decode + transformers + one cold process)
def test_spec_report_smoke(tiny_bundles, tmp_path):
    pytest.importorskip("matplotlib")
    from eagle3_runtime.reader import read_manifest

    pair, _ = tiny_bundles.get("speculators", 1)  # warms the session's compile cache for the chain's graphs
    out = tmp_path / "report"
    report = _spec_report()
    rc = report.main([str(pair / "recipe.yaml"), "--backend", "export", "--shapes", "chain:1,tree:2x2x4",
                      "--num-prompts", "2", "--max-tokens", "6", "--phases", "decode,transformers,cold",
                      "--cold-runs", "1", "--min-buckets",
                      "--hf-dtypes", "float32", "--out", str(out), "--save-result", str(out / "r.json"),
                      "--plot", str(out / "r.png")])
    assert rc == 0
    res = json.loads((out / "r.json").read_text())
    assert res["shapes"] == ["chain-k1", "tree-2x2x4"] and [e["name"] for e in res["decode"]] == res["shapes"]
    chain, tree = res["decode"]
    assert chain["shape"]["kind"] == "chain" and chain["shape"]["describe"] == "chain K 1"
    assert (tree["shape"]["kind"], tree["shape"]["depth"], tree["shape"]["topk"], tree["shape"]["num_nodes"]) == (
        "dynamic", 2, 2, 4)
    for e, depth, nodes in ((chain, 1, 2), (tree, 2, 4)):
        a, r, g = e["acceptance"], e["round_ms"], e["graphs"]
        assert e["spec"]["decode_tok_s"] > 0 and e["plain"]["decode_tok_s"] > 0 and e["spec"]["generated_tokens"] > 0
        assert e["K"] == depth and e["nodes_per_verify"] == nodes and e["spec_equals_plain"] == "2/2"
        assert len(a["per_position_acceptance_rate"]) == depth and 1 <= a["mean_acceptance_length"] <= depth + 1
        assert a["num_drafts"] > 0 and a["drafted_nodes_per_round"] == nodes - 1
        # the per-graph profile of the measured runs: every speculative round is one verify pass
        assert g["target_verify/1"]["calls"] == a["num_drafts"] == r["rounds"] and g["target_decode/1"]["calls"] > 0
        assert r["verify_ms"] > 0 and r["draft_ms_per_round"] > 0 and r["plain_decode_ms"] > 0
    assert "draft_step/1" not in chain["graphs"] and chain["round_ms"]["draft_step_ms"] is None  # K 1: no draft step
    assert tree["graphs"]["draft_step/1"]["calls"] == tree["acceptance"]["num_drafts"]  # depth - 1 steps a round
    assert res["machine"]["threads"] == 1
    assert res["transformers"]["float32"]["decode_tok_s"] > 0
    s = res["summary"]
    assert s["best_shape"] in res["shapes"] and "runtime_vs_transformers" in s and "best_vs_chain_k3" not in s
    assert res["builds"]["chain-k1"]["compiled"] == 0  # every chain graph came from the compile cache
    assert (out / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    c = res["cold_start"]
    assert c["shape"] == s["best_shape"] and c["prebuilt"]["median_s"] > 0  # on the best shape's full bundle
    # --min-buckets: the first shape keeps every prefill bucket (here: the full bundle), the others one
    assert chain["bundle"].endswith("chain-k1") and tree["bundle"].endswith("tree-2x2x4-min")
    m = read_manifest(Path(tree["bundle"]))
    assert m.batch_buckets == [1] and len(m.prefill_buckets) == 1
    assert m.prefill_buckets[0] in res["bundle"]["prefill_buckets"]
    # re-rendering the saved report measures nothing
    assert report.main(["--from-result", str(out / "r.json"), "--note", "n", "--plot", str(out / "again.png")]) == 0
    assert (out / "again.png").exists()


def _bench(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args], capture_output=True,
                          text=True, timeout=300, check=False)


def _run_bench(script: str, *args: str) -> dict:
    r = _bench(script, *args)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # (34 s: a benchmark, not a product component)
def test_graph_latency_smoke(tiny_bundles, tmp_path):
    """Two bundles side by side (the same one twice): every batch-bucket graph timed for each."""
    _, bundle = tiny_bundles.get("speculators", 3)
    res = _run_bench("graph_latency.py", str(bundle), str(bundle), "--repeats", "2", "--position", "8",
                        "--save-result", str(tmp_path / "g.json"))
    assert json.loads((tmp_path / "g.json").read_text()) == res
    assert {"target_verify_b1", "target_decode_b1", "draft_step_b1", "draft_catchup_b1"} <= set(res["graphs"])
    assert all(len(v) == 2 and v[0]["ratio_to_first"] == 1.0 and v[1]["median_ms"] > 0 for v in res["graphs"].values())
    bad = _bench("graph_latency.py", str(bundle), "--graphs", "no_such_graph")
    assert bad.returncode != 0 and "no_such_graph" in bad.stderr


@pytest.mark.slow  # (a benchmark, not a product component)
def test_engine_ab_smoke(tiny_bundles, tmp_path):
    """The same bundle as A and B: both decode, the same tokens, every loop graph timed for each."""
    _, bundle = tiny_bundles.get("speculators", 3)
    prompts = tmp_path / "p.txt"
    prompts.write_text("The quick brown fox\nOnce upon a time\n")
    res = _run_bench("engine_ab.py", str(bundle), str(bundle), "--prompts", str(prompts), "--num-prompts", "2",
                     "--max-tokens", "12", "--repeats", "1", "--threads", "1", "--no-chat",
                     "--save-result", str(tmp_path / "r.json"))
    assert json.loads((tmp_path / "r.json").read_text()) == res
    assert res["same_tokens"] and min(res["decode_tok_s"].values()) > 0 and set(res["b_over_a"]) == {"speculative", "plain"}
    assert {"target_verify_b1", "target_decode_b1", "draft_step_b1"} <= set(res["graphs_ms"])
    assert all(v["A"] > 0 and v["B"] > 0 for v in res["graphs_ms"].values())


@pytest.mark.slow  # (a benchmark, not a product component)
def test_vs_vllm_interleaved_smoke(tiny_bundles, tmp_path):
    """vs_vllm.py --interleave, ours only: both servers up at once and the in-process engines, each prompt through
    every contender in turn; every contender's outputs equal plain greedy decoding's."""
    _, bundle = tiny_bundles.get("speculators", 3)
    prompts = tmp_path / "p.txt"
    prompts.write_text("The quick brown fox\nOnce upon a time\nName a color.\n")
    res = _run_bench("vs_vllm.py", "--bundle", str(bundle), "--no-vllm", "--prompts", str(prompts), "--num-prompts",
                     "3", "--max-tokens", "12", "--threads", "1", "--eagle3", "chain3,none", "--interleave",
                     "--gap", "0", "--save-result", str(tmp_path / "r.json"))
    assert json.loads((tmp_path / "r.json").read_text()) == res and res["interleaved"]
    assert set(res["contenders"]) == {"eagle3 chain3", "eagle3 none"} and set(res["in_process"]) == {"chain3", "none"}
    assert all(c["same_text_as_plain"] == 3 and c["tokens"] > 0 for c in res["contenders"].values())
    assert res["contenders"]["eagle3 chain3"]["acceptance_length"] >= 1.0
    assert res["served_vs_in_process_chain3"] > 0 and res["served_vs_in_process_none"] > 0


def test_linear_layout_smoke(tmp_path):
    cfg = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    res = _run_bench("linear_layout.py", "--config", str(tmp_path / "config.json"), "--rows", "1,4,16",
                        "--repeats", "2")
    assert res["projections"] == 2 * 7 + 1 and [r["rows"] for r in res["results"]] == [1, 4, 16]
    import torch  # this CPU torch has oneDNN: its prepacked form is measured too, the fastest and the choice named
    assert torch.backends.mkldnn.is_available() and "onednn" in res["forms"] and "plain" in res["forms"]
    assert all(set(r["ms"]) == set(res["forms"]) and min(r["ms"].values()) > 0 for r in res["results"])
    assert all(r["fastest"] in res["forms"] and r["chosen"] in res["forms"][1:] for r in res["results"])
    assert res["machine_info"]["cpu"] and res["machine_info"]["threads"] == 1


@pytest.mark.slow  # (a benchmark, not a product component: the plan itself is tests/test_long_prompts.py)
def test_prefill_plan_smoke(tiny_bundles, tmp_path):
    """The plan against padding, a prompt past the largest bucket (64) among them: continued in both arms,
    counted as the plan's."""
    _, bundle = tiny_bundles.get("speculators", 3)
    prompts = tmp_path / "p.txt"
    prompts.write_text("The quick brown fox\n" + "the lazy dog sleeps in the sun " * 15 + "\nOnce upon a time\n")
    res = _run_bench("prefill_plan.py", str(bundle), "--prompts", str(prompts), "--num-prompts", "3", "--repeats", "1",
                     "--threads", "1", "--no-chat", "--save-result", str(tmp_path / "r.json"))
    assert json.loads((tmp_path / "r.json").read_text()) == res
    assert res["prompts"] == 3 and len(res["continued"]) == 1 and res["continued"][0] > 64
    assert res["plans"][1]["bucket"] == 64 and res["plans"][1]["continued_by"] == "chain K 3"
    assert res["plan"]["all"]["median_ms"] > 0 and res["padded"]["continued"]["mean_ms"] > 0
    assert res["machine"]["cpu"] and res["continued_padded_over_plan"] > 0
