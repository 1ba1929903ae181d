"""Smoke test of benchmarks/spec_report.py on a tiny pair (export backend, K 1, a few tokens):
the report's JSON has every section and the PNG is written."""
import importlib.util
import json
import subprocess
import sys

import pytest
from conftest import REPO


def _spec_report():
    spec = importlib.util.spec_from_file_location("spec_report", REPO / "benchmarks" / "spec_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow  # ~40 s idle (tiny pair build + decode + transformers), minutes on a busy machine
def test_spec_report_smoke(tiny_bundles, tmp_path):
    pytest.importorskip("matplotlib")
    pair, _ = tiny_bundles.get("speculators", 1)  # warms the session's compile cache for these graphs
    out = tmp_path / "report"
    rc = _spec_report().main([str(pair / "recipe.yaml"), "--backend", "export", "--k", "1", "--cold-k", "1",
                              "--num-prompts", "2", "--max-tokens", "6", "--phases", "decode,transformers",
                              "--hf-dtypes", "float32", "--out", str(out), "--save-result", str(out / "r.json"),
                              "--plot", str(out / "r.png")])
    assert rc == 0
    res = json.loads((out / "r.json").read_text())
    d = res["decode"]["1"]
    assert d["spec"]["decode_tok_s"] > 0 and d["plain"]["decode_tok_s"] > 0
    assert d["spec"]["generated_tokens"] > 0 and d["K"] == 1
    assert len(d["acceptance"]["per_position_acceptance_rate"]) == 1
    # per-graph profile of the measured runs: every speculative round is one verify (K=1: no draft_step)
    assert d["graphs"]["target_verify/1"]["calls"] == d["acceptance"]["num_drafts"]
    assert d["graphs"]["target_decode/1"]["calls"] > 0 and "draft_step/1" not in d["graphs"]
    assert res["machine"]["threads"] == 1
    assert res["transformers"]["float32"]["decode_tok_s"] > 0
    assert res["summary"]["best_k"] == 1 and "runtime_vs_transformers" in res["summary"]
    assert res["builds"]["k1"]["compiled"] == 0  # every graph came from the compile cache
    assert (out / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _bench(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args], capture_output=True,
                          text=True, timeout=300, check=False)


def _run_bench(script: str, *args: str) -> dict:
    r = _bench(script, *args)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


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


def test_linear_layout_smoke(tmp_path):
    cfg = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    res = _run_bench("linear_layout.py", "--config", str(tmp_path / "config.json"), "--rows", "1,4,16",
                        "--repeats", "2")
    assert res["projections"] == 2 * 7 + 1 and [r["rows"] for r in res["results"]] == [1, 4, 16]
    assert all(r["linear_ms"] > 0 and r["weight_stationary_ms"] > 0 for r in res["results"])
