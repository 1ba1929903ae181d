"""The spine: make-tiny-pair -> compile -> eagle3-run is token-for-token transformers' greedy output."""
import json
import shutil

import pytest
import torch
from conftest import cli_inproc, run_cli

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived a",
    "def main():\n    print(",
    "1, 2, 3, 4,",
]
MAX_TOKENS = 48


def hf_greedy(target_dir, prompt_ids: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, min_new_tokens=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def hf_cache():
    return {}


def reference(hf_cache, pair_dir, prompt_ids, n):
    key = (str(pair_dir), tuple(prompt_ids))
    if key not in hf_cache:
        hf_cache[key] = hf_greedy(pair_dir / "target", prompt_ids, n)
    return hf_cache[key]


@pytest.mark.parametrize("k,fmt", [
    (3, "speculators"),  # (eagle / specforge drafts are loaded and checked in tests/test_tiny.py and others)
    pytest.param(3, "eagle", marks=pytest.mark.slow), pytest.param(3, "specforge", marks=pytest.mark.slow),
    # K 1 adds no new code path (the GPT-OSS twin decodes at K 1 in the default run): full (slow) run only
    pytest.param(1, "speculators", marks=pytest.mark.slow), pytest.param(1, "eagle", marks=pytest.mark.slow),
    pytest.param(1, "specforge", marks=pytest.mark.slow)])
def test_lossless_vs_transformers(tiny_bundles, hf_cache, fmt, k):
    from eagle3_runtime.bundle import Bundle
    from eagle3_runtime.engine import Engine
    from eagle3_runtime.tokenizer import BundleTokenizer

    pair, bundle_dir = tiny_bundles.get(fmt, k)
    # the real CLI once per bundle ...
    r = run_cli("eagle3-run", str(bundle_dir), "--prompt", PROMPTS[0], "--max-tokens", str(MAX_TOKENS), "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["token_ids"] == reference(hf_cache, pair, res["prompt_token_ids"], MAX_TOKENS)
    assert res["spec_decoding"]["num_drafts"] > 0
    # ... and the same engine in-process for the other prompts, with and without speculation
    bundle = Bundle(bundle_dir)
    engine, tok = Engine(bundle), BundleTokenizer(bundle_dir)
    accepted = drafted = 0
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        ref = reference(hf_cache, pair, ids, MAX_TOKENS)
        spec = engine.generate(ids, MAX_TOKENS, speculative=True)
        plain = engine.generate(ids, MAX_TOKENS, speculative=False)
        assert spec.token_ids == ref, f"speculative output differs for {prompt!r}"
        assert plain.token_ids == ref, f"--no-spec output differs for {prompt!r}"
        assert spec.target_passes < plain.target_passes or spec.stats.num_accepted_tokens == 0
        accepted += spec.stats.num_accepted_tokens
        drafted += spec.stats.num_draft_tokens
    # the structured tiny draft must exercise both the accept and the reject path
    assert 0 < accepted < drafted


def test_cli_no_spec_and_text(tiny_bundles, hf_cache):
    pair, bundle_dir = tiny_bundles.get("speculators", 3)
    r = run_cli("eagle3-run", str(bundle_dir), "--prompt", PROMPTS[1], "--max-tokens", "20", "--no-spec", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["token_ids"] == reference(hf_cache, pair, res["prompt_token_ids"], MAX_TOKENS)[:20]
    r = run_cli("eagle3-run", str(bundle_dir), "--prompt", PROMPTS[1], "--max-tokens", "20")
    assert r.returncode == 0
    assert "Mean acceptance length" in r.stderr and "Per-position acceptance rate" in r.stderr


def test_prompt_tokenized_like_hf(tiny_bundles):
    from transformers import AutoTokenizer

    from eagle3_runtime.tokenizer import BundleTokenizer

    pair, bundle_dir = tiny_bundles.get("speculators", 3)
    hf = AutoTokenizer.from_pretrained(pair / "target")
    ours = BundleTokenizer(bundle_dir)
    for p in PROMPTS:
        assert ours.encode(p) == hf(p)["input_ids"]


def test_manifest_contents(tiny_bundles):
    from eagle3_runtime.reader import read_manifest

    _, bundle_dir = tiny_bundles.get("specforge", 3)
    m = read_manifest(bundle_dir)
    assert m.aux_layer_ids == [1, 2, 3]  # SpecForge ids (0, 1, 2) are output-of-layer: +1
    assert m.draft_format == "specforge"
    roles = {(g.role, g.bucket) for g in m.graphs}
    assert roles == {(r, s) for r in ("target_prefill", "draft_prefill") for s in (64,)} | {
        (r, 1) for r in ("target_verify", "target_decode", "draft_catchup", "draft_chain")}
    verify = m.graph("target_verify", 1)
    assert [(i.name, i.shape) for i in verify.inputs] == [("rank", [1]), ("tokens", [1, 4]), ("positions", [1, 4]),
                                                          ("start", [1]), ("tree_mask", [1, 4, 4])]
    assert {b: s.describe() for b, s in m.speculation.items()} == {1: "chain K 3"}
    assert verify.outputs[0].shape == [1, 4, 512] and verify.outputs[1].shape == [1, 4, 3 * 64]
    assert set(m.toolchain) >= {"python", "torch", "transformers", "eagle3_build", "backend"}
    assert m.sources["target"]["kind"] == "local"
    # the draft borrows the target's embedding (SpecForge drafts ship none)
    assert "target/embed_tokens.weight" in m.graph("draft_chain", 1).weights
    for f in m.all_files():
        assert (bundle_dir / f.path).is_file() and len(f.sha256) == 64


def _copy(bundle_dir, tmp_path):
    dst = tmp_path / "bundle"
    shutil.copytree(bundle_dir, dst)
    return dst


def test_refuses_flipped_byte(tiny_bundles, tmp_path):
    _, bundle_dir = tiny_bundles.get("speculators", 3)
    b = _copy(bundle_dir, tmp_path)
    w = b / "weights" / "target" / "rank0.safetensors"
    data = bytearray(w.read_bytes())
    data[len(data) // 2] ^= 0x01
    w.write_bytes(bytes(data))
    r = cli_inproc("eagle3-run", str(b), "--prompt", "hi", "--max-tokens", "2")
    assert r.returncode == 2
    assert "weights/target/rank0.safetensors is corrupt" in r.stderr and "Traceback" not in r.stderr


def test_refuses_missing_graph(tiny_bundles, tmp_path):
    _, bundle_dir = tiny_bundles.get("speculators", 3)
    b = _copy(bundle_dir, tmp_path)
    (b / "graphs" / "target_verify_b1.pt2").unlink()
    r = cli_inproc("eagle3-run", str(b), "--prompt", "hi", "--max-tokens", "2")
    assert r.returncode == 2
    assert "graphs/target_verify_b1.pt2 is missing" in r.stderr and "Traceback" not in r.stderr


def test_refuses_unknown_schema(tiny_bundles, tmp_path):
    _, bundle_dir = tiny_bundles.get("speculators", 3)
    b = _copy(bundle_dir, tmp_path)
    m = json.loads((b / "manifest.json").read_text())
    m["schema_version"] = 999
    (b / "manifest.json").write_text(json.dumps(m))
    r = cli_inproc("eagle3-run", str(b), "--prompt", "hi", "--max-tokens", "2")
    assert r.returncode == 2
    assert "schema version 999" in r.stderr and "rebuild" in r.stderr


def test_refuses_prompt_of_max_model_len(tiny_bundles):
    """(A prompt past the largest prefill bucket is served: tests/test_long_prompts.py.)"""
    _, bundle_dir = tiny_bundles.get("speculators", 3)
    r = cli_inproc("eagle3-run", str(bundle_dir), "--prompt", "word " * 400, "--max-tokens", "2")
    assert r.returncode == 2
    assert "max_model_len is 256: no room to generate" in r.stderr and "Traceback" not in r.stderr


def test_speculation_cutoff_near_max_model_len(tiny_bundles, hf_cache):
    """A sequence close to max_model_len finishes with plain decode, still lossless."""
    from eagle3_runtime.bundle import Bundle
    from eagle3_runtime.engine import Engine
    from eagle3_runtime.tokenizer import BundleTokenizer

    pair, bundle_dir = tiny_bundles.get("speculators", 3)
    bundle = Bundle(bundle_dir)
    engine, tok = Engine(bundle), BundleTokenizer(bundle_dir)
    ids = tok.encode("word " * 40)[:60]
    n = engine.max_len - len(ids)  # generate right up to max_model_len
    out = engine.generate(ids, n)
    assert out.token_ids == hf_greedy(pair / "target", ids, n)
    assert out.finish_reason == "length" and len(ids) + len(out.token_ids) == engine.max_len
