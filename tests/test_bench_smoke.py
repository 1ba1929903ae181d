"""Smoke test of benchmarks/spec_report.py on a tiny pair (export backend, K 1, a few tokens):
the report's JSON has every section and the PNG is written."""
import importlib.util
import json

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
