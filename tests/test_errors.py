"""Bad recipes and bad pairs: exit code 2, one clear message, no bundle (or temp dir) left behind."""
import json
from pathlib import Path

import pytest
import torch
from conftest import cli_inproc, run_cli
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from eagle3_build.cli import app
from eagle3_build.testing.tiny import make_tiny_pair

runner = CliRunner()


def compile_in_process(recipe: Path, artifacts: Path):
    return runner.invoke(app, ["compile", str(recipe), "--artifacts", str(artifacts)])


def assert_refused(result, *phrases, artifacts: Path):
    out = result.output if hasattr(result, "output") else result.stderr
    code = result.exit_code if hasattr(result, "exit_code") else result.returncode
    assert code == 2, out
    flat = " ".join(out.split())
    for p in phrases:
        assert p in flat, f"{p!r} not in {flat!r}"
    assert "Traceback" not in out
    leftovers = list(artifacts.iterdir()) if artifacts.exists() else []
    assert leftovers == [], f"build left {leftovers}"


@pytest.fixture
def pair(tmp_path):
    recipe = make_tiny_pair(tmp_path / "pair", draft_format="speculators")
    return recipe.parent


def edit_config(path: Path, fn):
    cfg = json.loads(path.read_text())
    fn(cfg)
    path.write_text(json.dumps(cfg))


def edit_tensors(path: Path, fn):
    sd = load_file(path)
    fn(sd)
    save_file(sd, path)


# ------------------------------------------------------------------ pair errors

PAIR_CASES = {
    "hidden": (lambda d: edit_config(d / "config.json", lambda c: c.update(target_hidden_size=128)),
               ["hidden size mismatch", "hidden 128", "target has 64"]),
    "vocab": (lambda d: edit_config(d / "config.json",
                                    lambda c: c["transformer_layer_config"].update(vocab_size=600)),
              ["vocab mismatch", "600", "512"]),
    "fc": (lambda d: edit_tensors(d / "model.safetensors",
                                  lambda sd: sd.update({"fc.weight": torch.zeros(64, 190)})),
           ["fc input mismatch", "3 x target hidden = 192"]),
    "qkv": (lambda d: edit_tensors(d / "model.safetensors",
                                   lambda sd: sd.update({"layers.0.self_attn.q_proj.weight": torch.zeros(64, 64)})),
            ["q_proj input is 64", "2 x 64 = 128"]),
    "lm_head": (lambda d: edit_tensors(d / "model.safetensors", lambda sd: sd.pop("lm_head.weight")),
                ["has no lm_head.weight"]),
    "d2t": (lambda d: edit_tensors(d / "model.safetensors", lambda sd: (sd.pop("d2t"), sd.pop("t2d"))),
            ["draft vocab 256 < target vocab 512", "no d2t"]),
    "aux": (lambda d: edit_config(d / "config.json", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 3, 4])),
            ["aux layer ids [2, 3, 4] out of range", "4-layer target"]),
    "t2d": (lambda d: edit_tensors(d / "model.safetensors",
                                   lambda sd: sd.update({"t2d": torch.roll(sd["t2d"], 1)})),
            ["d2t and t2d disagree"]),
    "unknown_tensor": (lambda d: edit_tensors(d / "model.safetensors",
                                              lambda sd: sd.update({"fc.bias": torch.zeros(64)})),
                       ["does not understand", "fc.bias"]),
}


@pytest.mark.parametrize("case", sorted(PAIR_CASES))
def test_pair_error(pair, tmp_path, case):
    mutate, phrases = PAIR_CASES[case]
    mutate(pair / "draft")
    art = tmp_path / "artifacts"
    assert_refused(compile_in_process(pair / "recipe.yaml", art), *phrases, artifacts=art)


def test_pickle_draft_needs_opt_in(tmp_path):
    recipe = make_tiny_pair(tmp_path / "pair", draft_format="eagle")
    text = recipe.read_text()
    assert "allow_pickle: true" in text
    recipe.write_text(text.replace("allow_pickle: true", "allow_pickle: false"))
    art = tmp_path / "artifacts"
    assert_refused(compile_in_process(recipe, art), "only pytorch_model.bin", "allow_pickle: true", artifacts=art)


def test_missing_target_config(pair, tmp_path):
    (pair / "target" / "config.json").unlink()
    art = tmp_path / "artifacts"
    assert_refused(compile_in_process(pair / "recipe.yaml", art), "no config.json", artifacts=art)


def test_pair_error_real_process(pair, tmp_path):
    """The same refusal from the real console script: exit code 2, no traceback."""
    PAIR_CASES["lm_head"][0](pair / "draft")
    art = tmp_path / "artifacts"
    r = run_cli("eagle3-build", "compile", str(pair / "recipe.yaml"), "--artifacts", str(art))
    assert_refused(r, "has no lm_head.weight", artifacts=art)


# ------------------------------------------------------------------ recipe errors (through the CLI)

RECIPE_CASES = {
    "unknown_key": ("    speculation: {num_speculative_tokens: 3, typo: 1}",
                    ["pairs[0].speculation.typo", "recipe.yaml:"]),
    "wrong_type": ("    speculation: {num_speculative_tokens: three}", ["num_speculative_tokens"]),
    "k_zero": ("    speculation: {num_speculative_tokens: 0}", ["num_speculative_tokens"]),
    "buckets_order": ("    buckets: {prefill: [128, 64], batch: [1]}", ["buckets.prefill", "ascending"]),
    "bucket_too_big": ("    buckets: {prefill: [64, 512], batch: [1]}", ["buckets.prefill", "max_model_len"]),
}


@pytest.mark.parametrize("case", sorted(RECIPE_CASES))
def test_recipe_error(pair, tmp_path, case):
    line, phrases = RECIPE_CASES[case]
    recipe = pair / "recipe.yaml"
    lines = recipe.read_text().splitlines()
    key = line.split(":")[0]
    lines = [line if ln.startswith(key + ":") else ln for ln in lines]
    assert line in lines
    recipe.write_text("\n".join(lines) + "\n")
    art = tmp_path / "artifacts"
    assert_refused(compile_in_process(recipe, art), *phrases, artifacts=art)


def test_failed_graph_leaves_nothing(pair, tmp_path, monkeypatch):
    """A build that dies half-way (here: the 3rd graph fails) leaves no bundle and no temp dir."""
    from eagle3_build.backends import per_graph
    from eagle3_build.backends import export
    from eagle3_build.build import build_bundle
    from eagle3_build.compile.cache import CompileCache
    from eagle3_build.compile.scheduler import CompileFailed
    from eagle3_build.recipe import load_recipe

    calls = {"n": 0}
    real = export.compile_exported

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("compiler crashed")
        return real(*a, **k)

    monkeypatch.setattr(export, "compile_exported", flaky)
    art = tmp_path / "artifacts"
    p = load_recipe(pair / "recipe.yaml").pairs[0]
    with pytest.raises(CompileFailed) as e:  # one graph failed: the others still compiled, no bundle
        build_bundle(p, art / "b", cache=CompileCache(tmp_path / "cache"))
    assert [f.job.name for f in e.value.failures] == ["target_verify_b1"]
    assert "compiler crashed" in e.value.failures[0].error
    assert list(art.iterdir()) == []

    # a crash after the graphs (while writing weights) leaves nothing either
    def crash(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(per_graph, "write_rank_files", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        build_bundle(p, art / "b", cache=CompileCache(tmp_path / "cache"))
    assert list(art.iterdir()) == []


def test_rebuild_replaces_bundle_atomically(pair, tmp_path):
    from eagle3_build.build import build_bundle
    from eagle3_build.recipe import load_recipe

    p = load_recipe(pair / "recipe.yaml").pairs[0]
    art = tmp_path / "artifacts"
    m1 = build_bundle(p, art / "b")
    m2 = build_bundle(p, art / "b")
    assert sorted(x.name for x in art.iterdir()) == ["b"]
    # same inputs -> byte-identical files and the same digest
    for name in ("target", "draft"):
        assert m1.models[name].weight_files == m2.models[name].weight_files
    assert [g.file for g in m1.graphs] == [g.file for g in m2.graphs]
    assert m1.digest == m2.digest != ""


def test_errors_keep_their_cause_and_debug_shows_it(tmp_path):
    """One line and exit 2 by default; --debug (or EAGLE3_DEBUG=1) adds the traceback with the chained cause,
    for the builder and the runtime alike. Every refusal shares one base class."""
    from eagle3_build.errors import UserError
    from eagle3_build.recipe import RecipeError
    from eagle3_runtime.engine import RequestError
    from eagle3_runtime.errors import Eagle3Error
    from eagle3_runtime.manifest import BundleError

    assert all(issubclass(c, Eagle3Error) for c in (UserError, RecipeError, BundleError, RequestError))
    bad = tmp_path / "bundle"
    bad.mkdir()
    (bad / "manifest.json").write_text("{")  # -> BundleError("not valid JSON") from the JSONDecodeError
    for cmd in (["eagle3-build", "inspect", str(bad)], ["eagle3-run", str(bad), "--prompt", "hi"]):
        plain = run_cli(*cmd)
        assert plain.returncode == 2 and "not valid JSON" in plain.stderr and "Traceback" not in plain.stderr
        debug_argv = [cmd[0], "--debug", *cmd[1:]] if cmd[0] == "eagle3-build" else [*cmd, "--debug"]
        for r in (cli_inproc(*debug_argv), cli_inproc(*cmd, env={"EAGLE3_DEBUG": "1"})):  # (main() in-process)
            assert r.returncode == 2 and "Traceback" in r.stderr and "JSONDecodeError" in r.stderr, r.stderr
            assert "error:" in r.stderr and "not valid JSON" in r.stderr
