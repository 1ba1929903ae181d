"""Recipe sources: hf://org/model@rev through huggingface_hub (offline, from a local hub cache)."""
import json
import shutil

from conftest import run_cli

from eagle3_build.testing.tiny import make_tiny_pair

COMMIT_T = "1" * 40
COMMIT_D = "2" * 40


def fake_hub_cache(cache, repo_id: str, src_dir, commit: str, ref: str = "main"):
    """Lay out a checkpoint exactly as huggingface_hub caches a downloaded snapshot."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(src_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / ref).write_text(commit)


def test_hf_sources_resolve_and_record_revision(tmp_path):
    pair = make_tiny_pair(tmp_path / "pair", draft_format="speculators").parent
    cache = tmp_path / "hub"
    fake_hub_cache(cache, "tiny-org/tiny-target", pair / "target", COMMIT_T, ref="v1")
    fake_hub_cache(cache, "tiny-org/tiny-draft", pair / "draft", COMMIT_D)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text((pair / "recipe.yaml").read_text()
                      .replace("target: ./target", "target: hf://tiny-org/tiny-target@v1")
                      .replace("draft: ./draft", "draft: hf://tiny-org/tiny-draft"))
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "bundle"
    r = run_cli("eagle3-build", "compile", str(recipe), "--out", str(out), "--no-verify", env=env)
    assert r.returncode == 0, r.stderr
    m = json.loads((out / "manifest.json").read_text())
    assert m["sources"]["target"]["uri"] == "hf://tiny-org/tiny-target@v1"
    assert m["sources"]["target"]["revision"] == "v1"
    assert m["sources"]["target"]["resolved_revision"] == COMMIT_T
    assert m["sources"]["draft"]["resolved_revision"] == COMMIT_D

    # a repo that is not in the cache (and no network): exit 2, one clear line, nothing written
    recipe.write_text(recipe.read_text().replace("tiny-org/tiny-draft", "tiny-org/missing"))
    out2 = tmp_path / "bundle2"
    r = run_cli("eagle3-build", "compile", str(recipe), "--out", str(out2), "--no-verify", env=env)
    assert r.returncode == 2
    assert "hf://tiny-org/missing" in r.stderr and "Traceback" not in r.stderr
    assert not out2.exists()


def test_gguf_target_lossless(tmp_path):
    """A GGUF target (dequantized through transformers + gguf) builds and decodes like transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    from eagle3_runtime.bundle import Bundle
    from eagle3_runtime.engine import Engine
    from eagle3_runtime.tokenizer import BundleTokenizer

    pair = tmp_path / "pair"
    r = run_cli("eagle3-build", "make-tiny-pair", str(pair), "--target-format", "gguf", "--draft-format", "specforge")
    assert r.returncode == 0, r.stderr
    assert "target: ./target.gguf" in (pair / "recipe.yaml").read_text()
    out = tmp_path / "bundle"
    r = run_cli("eagle3-build", "compile", str(pair / "recipe.yaml"), "--out", str(out), "--no-verify")
    assert r.returncode == 0, r.stderr
    m = json.loads((out / "manifest.json").read_text())
    assert m["sources"]["target"]["kind"] == "gguf" and m["sources"]["target"]["gguf_file"] == "target.gguf"
    hf = AutoModelForCausalLM.from_pretrained(pair, gguf_file="target.gguf", dtype=torch.float32)
    engine, tok = Engine(Bundle(out)), BundleTokenizer(out)
    for prompt in ("The quick brown fox", "Once upon a time"):
        ids = tok.encode(prompt)
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
        got = engine.generate(ids, 32)
        assert got.token_ids == ref
        assert got.stats.num_accepted_tokens > 0
