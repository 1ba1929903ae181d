"""Recipe loading, defaults, and error reporting (file:line: key: message)."""

from __future__ import annotations

import hashlib
import textwrap
from pathlib import Path

import pytest

from eagle3_build.default_buckets import default_batch_buckets, default_prefill_buckets
from eagle3_build.recipe import PairRecipe, RecipeError, RecipeIssue, load_recipe, select_pair
from eagle3_runtime.buckets import pick_bucket

RECIPES = Path(__file__).resolve().parent.parent / "recipes"

BASE = """\
pairs:
  - name: tiny-llama-eagle3
    target: ./target
    draft:
      source: ./draft
      allow_pickle: true
    dtype: float32
    speculation:
      num_speculative_tokens: 3
    serving:
      max_num_seqs: 1
      max_model_len: 256
"""


def write(tmp_path: Path, text: str, name: str = "recipe.yaml") -> Path:
    (tmp_path / "target").mkdir(exist_ok=True)
    (tmp_path / "draft").mkdir(exist_ok=True)
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def line_no(text: str, needle: str, nth: int = 1) -> int:
    """1-based line of the nth line of (dedented) ``text`` containing ``needle``."""
    hits = [i for i, ln in enumerate(textwrap.dedent(text).splitlines(), 1) if needle in ln]
    return hits[nth - 1]


def load_err(path: Path) -> RecipeError:
    with pytest.raises(RecipeError) as ei:
        load_recipe(path)
    return ei.value


def assert_issue(err: RecipeError, path: Path, line: int | None, key: str, *words: str) -> None:
    prefix = f"{path}:{line}: {key}: " if line is not None else f"{path}: {key}: "
    lines = [ln for ln in str(err).splitlines() if ln.startswith(prefix)]
    assert lines, f"expected a line starting with {prefix!r} in:\n{err}"
    for w in words:
        assert any(w in ln for ln in lines), f"{w!r} not in {lines}"
    assert any(i.line == line and i.key == key for i in err.errors)


# --------------------------------------------------------------------------------- buckets


@pytest.mark.parametrize(
    "n, expected",
    [(2048, [128, 256, 512, 1024, 2048]), (300, [128, 256, 300]), (256, [128, 256]), (128, [128]),
     (100, [100]), (129, [128, 129])],
)
def test_default_prefill_buckets(n, expected):
    assert default_prefill_buckets(n) == expected


@pytest.mark.parametrize("n, expected", [(1, [1]), (2, [1, 2]), (5, [1, 2, 4, 5]), (8, [1, 2, 4, 8])])
def test_default_batch_buckets(n, expected):
    assert default_batch_buckets(n) == expected


def test_pick_bucket():
    assert pick_bucket([128, 256, 300], 1) == 128
    assert pick_bucket([128, 256, 300], 256) == 256
    assert pick_bucket([128, 256, 300], 257) == 300
    assert pick_bucket([128, 256, 300], 301) is None


# ------------------------------------------------------------------------------ valid recipes


def test_valid_recipe_round_trips_with_defaults(tmp_path):
    path = write(tmp_path, BASE)
    recipe = load_recipe(path)
    assert recipe.path == str(path.resolve())
    assert recipe.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    [pair] = recipe.pairs
    assert pair.name == "tiny-llama-eagle3"
    assert pair.target.kind == "local" and pair.target.path == str(tmp_path / "target")
    assert pair.target.uri == "./target" and pair.target.allow_pickle is False
    assert pair.draft.path == str(tmp_path / "draft") and pair.draft.allow_pickle is True
    assert pair.dtype == "float32"
    assert pair.speculation.num_speculative_tokens == 3
    assert pair.serving.model_dump() == {"max_num_seqs": 1, "max_model_len": 256, "max_num_batched_tokens": 256}
    assert pair.parallel.tp_degree == 1 and pair.parallel.padded_hidden_size is None
    assert pair.buckets.prefill == [128, 256] and pair.buckets.batch == [1]
    assert pair.backend == "export" and pair.backend_options == {}
    assert pair.verify.model_dump() == {"min_acceptance_length": None, "num_prompts": 4, "max_tokens": 32,
                                        "chat": False}
    dumped = pair.model_dump(mode="json")
    assert PairRecipe.model_validate(dumped) == pair
    assert select_pair(recipe, None) == [pair]
    assert select_pair(recipe, "tiny-llama-eagle3") == [pair]


def test_default_buckets_resolved_from_serving(tmp_path):
    text = BASE.replace("max_num_seqs: 1", "max_num_seqs: 5").replace(
        "max_model_len: 256", "max_model_len: 4096\n      max_num_batched_tokens: 2048")
    pair = load_recipe(write(tmp_path, text)).pairs[0]
    assert pair.buckets.prefill == [128, 256, 512, 1024, 2048]
    assert pair.buckets.batch == [1, 2, 4, 5]

    text = BASE.replace("max_num_seqs: 1", "max_num_seqs: 2").replace("max_model_len: 256", "max_model_len: 300")
    pair = load_recipe(write(tmp_path, text)).pairs[0]
    assert pair.buckets.prefill == [128, 256, 300]
    assert pair.buckets.batch == [1, 2]


def test_explicit_buckets_kept(tmp_path):
    text = BASE + "    buckets:\n      prefill: [64, 256]\n      batch: [1, 4]\n"
    text = text.replace("max_num_seqs: 1", "max_num_seqs: 4")
    pair = load_recipe(write(tmp_path, text)).pairs[0]
    assert pair.buckets.prefill == [64, 256] and pair.buckets.batch == [1, 4]


def test_defaults_deep_merge(tmp_path):
    text = """\
    defaults:
      dtype: float16
      backend: aoti
      backend_options: {device: cpu}
      serving:
        max_model_len: 512
        max_num_seqs: 2
      speculation:
        num_speculative_tokens: 4
    pairs:
      - name: a
        target: ./target
        draft: ./draft
      - name: b
        target: ./target
        draft: ./draft
        dtype: float32
        serving:
          max_num_seqs: 4
        backend_options: {inductor_configs: {max_autotune: false}}
    """
    a, b = load_recipe(write(tmp_path, text)).pairs
    assert (a.dtype, a.backend, a.backend_options) == ("float16", "aoti", {"device": "cpu"})
    assert a.serving.model_dump() == {"max_num_seqs": 2, "max_model_len": 512, "max_num_batched_tokens": 512}
    assert a.speculation.num_speculative_tokens == 4
    assert (b.dtype, b.backend, b.backend_options) == (
        "float32", "aoti", {"device": "cpu", "inductor_configs": {"max_autotune": False}})
    # nested mapping merged key by key: max_model_len from defaults, max_num_seqs from the pair
    assert b.serving.model_dump() == {"max_num_seqs": 4, "max_model_len": 512, "max_num_batched_tokens": 512}
    assert b.buckets.batch == [1, 2, 4]


def test_hf_sources(tmp_path):
    text = BASE.replace("target: ./target", "target: hf://org/model@v1.2").replace(
        "source: ./draft", "source: hf://org2/draft-x\n      gguf_file: draft.Q4_1.gguf")
    pair = load_recipe(write(tmp_path, text)).pairs[0]
    t, d = pair.target, pair.draft
    assert (t.kind, t.repo_id, t.revision, t.path, t.gguf_file) == ("hf", "org/model", "v1.2", None, None)
    assert t.uri == "hf://org/model@v1.2"
    assert (d.kind, d.repo_id, d.revision, d.gguf_file, d.allow_pickle) == ("hf", "org2/draft-x", "main", "draft.Q4_1.gguf", True)


def test_gguf_sources(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "t.gguf").write_bytes(b"GGUF")
    text = BASE.replace("target: ./target", "target: models/t.gguf").replace(
        "source: ./draft", "source: ./models\n      gguf_file: t.gguf")
    pair = load_recipe(write(tmp_path, text)).pairs[0]
    assert (pair.target.kind, pair.target.path) == ("gguf", str(tmp_path / "models" / "t.gguf"))
    assert (pair.draft.kind, pair.draft.path) == ("gguf", str(tmp_path / "models" / "t.gguf"))


def test_select_unknown_pair_lists_names(tmp_path):
    recipe = load_recipe(write(tmp_path, BASE))
    with pytest.raises(RecipeError) as ei:
        select_pair(recipe, "nope")
    assert "'nope'" in str(ei.value) and "tiny-llama-eagle3" in str(ei.value)


def test_seed_recipes_load_with_exact_values():
    compiler_args = ["--target", "trn2", "--lnc", "2", "--model-type", "transformer"]

    [llama] = load_recipe(RECIPES / "llama31-8b-eagle3.yaml").pairs
    assert (llama.target.kind, llama.target.repo_id) == ("hf", "meta-llama/Llama-3.1-8B-Instruct")
    assert (llama.draft.kind, llama.draft.repo_id) == ("hf", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B")
    assert llama.draft.allow_pickle is True and llama.target.allow_pickle is False
    assert llama.dtype == "bfloat16" and llama.speculation.num_speculative_tokens == 3
    assert llama.serving.model_dump() == {"max_num_seqs": 2, "max_model_len": 2048, "max_num_batched_tokens": 2048}
    assert llama.parallel.model_dump() == {"tp_degree": 8, "padded_hidden_size": None}
    assert llama.buckets.prefill == [128, 256, 512, 1024, 2048] and llama.buckets.batch == [1, 2]
    assert llama.backend == "neuron" and llama.backend_options == {"compiler_args": compiler_args}

    [oss] = load_recipe(RECIPES / "gpt-oss-120b-eagle3.yaml").pairs
    assert (oss.target.kind, oss.target.repo_id) == ("hf", "openai/gpt-oss-120b")
    assert (oss.draft.kind, oss.draft.repo_id) == ("hf", "RedHatAI/gpt-oss-120b-speculator.eagle3")
    assert oss.draft.allow_pickle is False
    assert oss.dtype == "bfloat16" and oss.speculation.num_speculative_tokens == 1
    assert oss.serving.model_dump() == {"max_num_seqs": 1, "max_model_len": 768, "max_num_batched_tokens": 512}
    assert oss.parallel.model_dump() == {"tp_degree": 16, "padded_hidden_size": 3072}
    assert oss.buckets.prefill == [512] and oss.buckets.batch == [1]
    assert oss.backend == "neuron" and oss.backend_options == {"compiler_args": compiler_args}


# ------------------------------------------------------------------------------------ errors


def test_issue_format():
    issue = RecipeIssue("r.yaml", 7, "pairs[0].dtype", "bad")
    assert str(issue) == "r.yaml:7: pairs[0].dtype: bad"
    assert str(RecipeError([issue, issue])) == "r.yaml:7: pairs[0].dtype: bad\nr.yaml:7: pairs[0].dtype: bad"


def test_unknown_keys(tmp_path):
    text = BASE.replace("    dtype: float32\n", "    dtype: float32\n    colour: red\n").replace(
        "max_num_seqs: 1", "max_seqs: 1")
    path = write(tmp_path, text)
    err = load_err(path)
    assert_issue(err, path, line_no(text, "colour"), "pairs[0].colour", "unknown key", "allowed keys", "speculation")
    assert_issue(err, path, line_no(text, "max_seqs"), "pairs[0].serving.max_seqs", "max_num_seqs, max_model_len")


def test_wrong_types(tmp_path):
    text = BASE.replace("max_num_seqs: 1", 'max_num_seqs: "2"').replace(
        "num_speculative_tokens: 3", "num_speculative_tokens: 2.0").replace("allow_pickle: true", "allow_pickle: 1")
    path = write(tmp_path, text)
    err = load_err(path)
    assert_issue(err, path, line_no(text, "max_num_seqs"), "pairs[0].serving.max_num_seqs", "must be an integer", "'2'")
    assert_issue(err, path, line_no(text, "num_speculative_tokens"), "pairs[0].speculation.num_speculative_tokens",
                 "must be an integer")
    assert_issue(err, path, line_no(text, "allow_pickle"), "pairs[0].draft.allow_pickle", "true or false")


def test_buckets_not_ascending_or_not_positive(tmp_path):
    text = BASE + "    buckets:\n      prefill: [128, 128]\n      batch: [0, 1]\n"
    path = write(tmp_path, text)
    err = load_err(path)
    assert_issue(err, path, line_no(text, "prefill:"), "pairs[0].buckets.prefill[1]", "strictly ascending")
    assert_issue(err, path, line_no(text, "batch:"), "pairs[0].buckets.batch[0]", "positive")


def test_empty_bucket_list(tmp_path):
    text = BASE + "    buckets:\n      prefill: []\n"
    path = write(tmp_path, text)
    assert_issue(load_err(path), path, line_no(text, "prefill:"), "pairs[0].buckets.prefill", "must not be empty")


def test_k_below_one(tmp_path):
    text = BASE.replace("num_speculative_tokens: 3", "num_speculative_tokens: 0")
    path = write(tmp_path, text)
    assert_issue(load_err(path), path, line_no(text, "num_speculative_tokens"),
                 "pairs[0].speculation.num_speculative_tokens", ">= 1")


def test_max_model_len_not_above_k(tmp_path):
    text = BASE.replace("max_model_len: 256", "max_model_len: 3")
    path = write(tmp_path, text)
    assert_issue(load_err(path), path, line_no(text, "max_model_len"), "pairs[0].serving.max_model_len",
                 "greater than speculation.num_speculative_tokens")


def test_max_model_len_must_leave_room_for_a_round(tmp_path):
    """K + 1 is refused too (the engine could never speculate, the runtime's manifest refuses it); K + 2 loads."""
    from eagle3_build.recipe import min_max_model_len

    assert min_max_model_len(3) == 5
    text = BASE.replace("max_model_len: 256", "max_model_len: 4")
    path = write(tmp_path, text)
    assert_issue(load_err(path), path, line_no(text, "max_model_len"), "pairs[0].serving.max_model_len",
                 "greater than speculation.num_speculative_tokens + 1 (4), got 4")
    assert load_recipe(write(tmp_path, BASE.replace("max_model_len: 256", "max_model_len: 5"))).pairs[0]


def test_verify_defaults_are_one_definition(tmp_path):
    from eagle3_build.recipe import VERIFY_DEFAULTS, VerifySettings

    assert load_recipe(write(tmp_path, BASE)).pairs[0].verify == VERIFY_DEFAULTS == VerifySettings()
    chat = load_recipe(write(tmp_path, BASE + "    verify:\n      chat: true\n")).pairs[0].verify
    assert chat == VerifySettings(chat=True)


def test_batched_tokens_above_max_model_len(tmp_path):
    text = BASE.replace("max_model_len: 256", "max_model_len: 256\n      max_num_batched_tokens: 512")
    path = write(tmp_path, text)
    assert_issue(load_err(path), path, line_no(text, "max_num_batched_tokens"),
                 "pairs[0].serving.max_num_batched_tokens", "<= serving.max_model_len (256)")


def test_prefill_bucket_above_max_model_len(tmp_path):
    text = BASE + "    buckets:\n      prefill: [128, 512]\n"
    path = write(tmp_path, text)
    assert_issue(load_err(path), path, line_no(text, "prefill:"), "pairs[0].buckets.prefill[1]",
                 "exceeds serving.max_model_len (256)")


def test_batch_bucket_below_max_num_seqs(tmp_path):
    text = BASE.replace("max_num_seqs: 1", "max_num_seqs: 4") + "    buckets:\n      batch: [1, 2]\n"
    path = write(tmp_path, text)
    assert_issue(load_err(path), path, line_no(text, "batch:"), "pairs[0].buckets.batch",
                 "smaller than serving.max_num_seqs (4)")


def test_missing_required_keys(tmp_path):
    text = BASE.replace("      max_model_len: 256\n", "")
    text = text.replace("    speculation:\n      num_speculative_tokens: 3\n", "")
    path = write(tmp_path, text)
    err = load_err(path)
    # missing key -> line of the enclosing mapping
    assert_issue(err, path, line_no(text, "serving:"), "pairs[0].serving.max_model_len", "required")
    assert_issue(err, path, line_no(text, "- name:"), "pairs[0].speculation", "required")


def test_missing_local_path(tmp_path):
    text = BASE.replace("source: ./draft", "source: ./no-such-draft")
    path = write(tmp_path, text)
    assert_issue(load_err(path), path, line_no(text, "no-such-draft"), "pairs[0].draft.source",
                 "does not exist", str(tmp_path / "no-such-draft"))


def test_bad_hf_uri(tmp_path):
    text = BASE.replace("target: ./target", "target: hf://just-a-name")
    path = write(tmp_path, text)
    assert_issue(load_err(path), path, line_no(text, "hf://"), "pairs[0].target",
                 "hf://org/name or hf://org/name@revision")


def test_duplicate_names(tmp_path):
    body = BASE.split("\n", 1)[1]
    text = BASE + body
    path = write(tmp_path, text)
    assert_issue(load_err(path), path, line_no(text, "- name:", nth=2), "pairs[1].name", "duplicate pair name")


def test_bad_name_dtype_backend(tmp_path):
    text = BASE.replace("tiny-llama-eagle3", "-bad name").replace("float32", "float64") + "    backend: tensorrt\n"
    path = write(tmp_path, text)
    err = load_err(path)
    assert_issue(err, path, line_no(text, "name:"), "pairs[0].name", "[A-Za-z0-9][A-Za-z0-9._-]*")
    assert_issue(err, path, line_no(text, "dtype:"), "pairs[0].dtype", "'float32', 'bfloat16' or 'float16'")
    assert_issue(err, path, line_no(text, "backend:"), "pairs[0].backend", "'export', 'aoti' or 'neuron'")


def test_yaml_syntax_error(tmp_path):
    text = BASE.replace("dtype: float32", "dtype: [float32")
    path = write(tmp_path, text)
    err = load_err(path)
    assert len(err.errors) == 1 and "invalid YAML" in str(err)
    assert err.errors[0].line is not None and err.errors[0].line >= line_no(text, "dtype")


def test_error_from_defaults_reports_defaults_line(tmp_path):
    text = "defaults:\n  dtype: float64\n  verify:\n    max_tokens: 0\n" + BASE.replace("    dtype: float32\n", "")
    path = write(tmp_path, text)
    err = load_err(path)
    assert_issue(err, path, line_no(text, "float64"), "pairs[0].dtype", "from defaults")
    assert_issue(err, path, line_no(text, "max_tokens"), "pairs[0].verify.max_tokens", ">= 1")


def test_collects_all_errors(tmp_path):
    text = BASE.replace("num_speculative_tokens: 3", "num_speculative_tokens: 0").replace(
        "target: ./target", "target: ./missing").replace("float32", "f32") + "    extra: 1\n"
    err = load_err(write(tmp_path, text))
    keys = {i.key for i in err.errors}
    assert {"pairs[0].speculation.num_speculative_tokens", "pairs[0].target", "pairs[0].dtype", "pairs[0].extra"} <= keys


def test_file_and_top_level_errors(tmp_path):
    missing = tmp_path / "nope.yaml"
    assert "not found" in str(load_err(missing))

    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    assert_issue(load_err(path), path, 1, "<root>", "must be a mapping")

    path = tmp_path / "nopairs.yaml"
    path.write_text("defaults: {dtype: float32}\nwhatever: 1\n")
    err = load_err(path)
    assert_issue(err, path, 1, "pairs", "required")
    assert_issue(err, path, 2, "whatever", "allowed keys: defaults, pairs")

    path = tmp_path / "empty.yaml"
    path.write_text("pairs: []\n")
    assert_issue(load_err(path), path, 1, "pairs", "must not be empty")


def test_numbers_too_long_or_too_large_are_reported_at_their_key_and_line(tmp_path):
    """An int of more digits than Python reads (4300), a hex int of 4,000 digits, a float that overflows: each at
    its key and line (not `could not load recipe` with neither, nor a pydantic traceback later)."""
    text = BASE.replace("max_model_len: 256", "max_model_len: " + "9" * 4400) + (
        "    buckets:\n      prefill: [64, 0x" + "f" * 4000 + "]\n"
        "    verify:\n      min_acceptance_length: 1" + "0" * 400 + ".5\n")
    path = write(tmp_path, text)
    err = load_err(path)
    assert_issue(err, path, line_no(text, "max_model_len"), "pairs[0].serving.max_model_len",
                 "(4400 characters) is too long to read as a number; give a number of at most 19 digits")
    assert_issue(err, path, line_no(text, "prefill:"), "pairs[0].buckets.prefill[1]", "0xffffffffff…",
                 "is too large (more than 9223372036854775807)")
    assert_issue(err, path, line_no(text, "min_acceptance_length"), "pairs[0].verify.min_acceptance_length",
                 "overflows to infinity")


def test_sizes_past_what_a_bundle_records_are_refused_at_their_line(tmp_path):
    """serving sizes and bucket lists past the manifest's bounds (what the runtime accepts) are recipe errors."""
    text = BASE.replace("max_num_seqs: 1", "max_num_seqs: 1000000000").replace(
        "max_model_len: 256", "max_model_len: 1000000000000") + "    buckets:\n      prefill: [" + ", ".join(
        str(i) for i in range(1, 71)) + "]\n"
    path = write(tmp_path, text)
    err = load_err(path)
    assert_issue(err, path, line_no(text, "max_model_len"), "pairs[0].serving.max_model_len",
                 "must be <= 16777216, got integer 1000000000000")
    assert_issue(err, path, line_no(text, "max_num_seqs"), "pairs[0].serving.max_num_seqs", "must be <= 16777216")
    assert_issue(err, path, line_no(text, "prefill:"), "pairs[0].buckets.prefill", "at most 64 entries, got 70")
    assert not any("max_num_batched_tokens" in i.key for i in err.errors)  # (its default: no second report)
