"""Hostile and broken builder inputs: bounded recipe parsing, validated checkpoint files, strict options.

Each bad input is refused with one line naming the file and the problem (a UserError / RecipeError,
exit code 2 from the CLI), in bounded time and memory, never a traceback or a hang.
"""
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_cli

from eagle3_build.backends.registry import get_backend
from eagle3_build.checkpoints.load import load_draft, load_target
from eagle3_build.checkpoints.sources import resolve
from eagle3_build.errors import CheckpointError, UserError
from eagle3_build.recipe import MAX_RECIPE_BYTES, MAX_YAML_NODES, RecipeError, load_recipe


@pytest.fixture(scope="module")
def pairs(tiny_pair) -> dict[str, Path]:
    """The session's speculators pair (safetensors draft) and official-EAGLE pair (pytorch_model.bin)."""
    return {"spec": tiny_pair(draft_format="speculators").parent, "eagle": tiny_pair(draft_format="eagle").parent}


@pytest.fixture
def pair(pairs, tmp_path) -> Path:
    """A private copy of the speculators pair to break."""
    return Path(shutil.copytree(pairs["spec"], tmp_path / "pair"))


def recipe_pair(pair_dir: Path):
    return load_recipe(pair_dir / "recipe.yaml").pairs[0]


def load_target_of(pair_dir: Path):
    return load_target(resolve(recipe_pair(pair_dir).target, "target"))


def refused(pair_dir: Path, *phrases: str) -> CheckpointError:
    """Loading the target must raise one single-line CheckpointError containing every phrase."""
    with pytest.raises(CheckpointError) as ei:
        load_target_of(pair_dir)
    msg = str(ei.value)
    assert "\n" not in msg, msg
    for p in phrases:
        assert p in msg, f"{p!r} not in {msg!r}"
    return ei.value


def assert_cli_refused(r: subprocess.CompletedProcess, *phrases: str) -> None:
    """Exit code 2, exactly one line on stderr naming the problem, no traceback."""
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for p in phrases:
        assert p in lines[0], f"{p!r} not in {lines[0]!r}"


# ------------------------------------------------------------------ recipes: size and alias bounds

def billion_laughs(levels: int = 9, width: int = 9) -> str:
    lines = ["defaults: {}", "a0: &a0 [" + ", ".join(["lol"] * width) + "]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join(lines) + f"\npairs: *a{levels - 1}\n"


BOMB_PROBE = """
import resource, sys, time
from eagle3_build.recipe import RecipeError, load_recipe
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
try:
    load_recipe(sys.argv[1])
    print("loaded")
except RecipeError as e:
    print(str(e))
print(time.perf_counter() - t0)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""


def merge_bomb(levels: int = 40) -> str:
    """The same through merge keys: every level merges the previous one 4 times."""
    lines = ["m0: &m0 {k: 1}"]
    for i in range(1, levels):
        lines.append(f"m{i}: &m{i} {{<<: [{', '.join([f'*m{i - 1}'] * 4)}], x{i}: 1}}")
    return "\n".join(lines) + f"\npairs: [*m{levels - 1}]\n"


@pytest.mark.parametrize("text", [billion_laughs(), merge_bomb()], ids=["sequences", "merge-keys"])
def test_alias_bomb_refused_in_bounded_time_and_memory(tmp_path, text):
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    r = subprocess.run([sys.executable, "-c", BOMB_PROBE, str(path)], capture_output=True, text=True, timeout=60,
                       cwd=REPO)
    assert r.returncode == 0, r.stderr
    message, seconds, grown_mb = r.stdout.strip().splitlines()
    assert f"recipe expands to more than {MAX_YAML_NODES} nodes through YAML aliases" in message
    assert float(seconds) < 5, seconds
    assert float(grown_mb) < 200, grown_mb


def test_recursive_alias_refused(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("pairs: &p [*p]\n")
    with pytest.raises(RecipeError, match="recursive YAML alias"):
        load_recipe(path)


@pytest.mark.parametrize("text, message", [
    ("pairs: [" + "0, " * (MAX_YAML_NODES + 10) + "]\n", f"recipe has more than {MAX_YAML_NODES} YAML nodes"),
    ("pairs: " + "[" * 5000 + "]" * 5000 + "\n", "recipe nests deeper than 64 levels"),
    # defaults are merged into every pair, so the number of pairs is bounded too
    ("defaults: {buckets: {prefill: [" + ", ".join(map(str, range(1, 5001))) + "]}}\npairs:\n" + "  - {}\n" * 5000,
     "pairs: 5000 pairs, at most 100"),
], ids=["nodes", "depth", "pairs"])
def test_other_recipe_bounds(tmp_path, text, message):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError) as ei:
        load_recipe(path)
    assert len(ei.value.errors) == 1 and message in str(ei.value)


def test_oversized_recipe_refused_before_parsing(tmp_path):
    path = tmp_path / "big.yaml"
    size = 26 << 20
    path.write_text("pairs: [" + "1, " * (size // 3) + "]\n")  # would take minutes to parse
    with pytest.raises(RecipeError) as ei:
        load_recipe(path)
    msg = str(ei.value)
    assert f"recipe is {path.stat().st_size} bytes" in msg and f"{MAX_RECIPE_BYTES}-byte (1 MiB) cap" in msg


def test_alias_bomb_and_oversized_recipe_through_cli(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(billion_laughs())
    r = run_cli("eagle3-build", "compile", str(bomb), "--artifacts", str(tmp_path / "art"), timeout=60)
    assert_cli_refused(r, "bomb.yaml", "through YAML aliases")
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * MAX_RECIPE_BYTES + "\n")
    r = run_cli("eagle3-build", "plan", str(big), timeout=60)
    assert_cli_refused(r, "big.yaml", "1 MiB) cap")


ANCHORED = """\
defaults:
  dtype: float32
pairs:
  - &first
    name: a
    target: ./target
    draft: ./draft
    speculation: {num_speculative_tokens: 3}
    serving: &serving
      max_num_seqs: 2
      max_model_len: 256
  - <<: *first
    name: b
    serving:
      <<: *serving
      max_num_seqs: 1
"""


def write_recipe(tmp_path: Path, text: str) -> Path:
    (tmp_path / "target").mkdir(exist_ok=True)
    (tmp_path / "draft").mkdir(exist_ok=True)
    path = tmp_path / "recipe.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def line_of(text: str, needle: str) -> int:
    return next(i for i, ln in enumerate(text.splitlines(), 1) if needle in ln)


def test_anchors_and_merge_keys_still_work(tmp_path):
    a, b = load_recipe(write_recipe(tmp_path, ANCHORED)).pairs
    assert (a.name, a.serving.max_num_seqs, a.serving.max_model_len) == ("a", 2, 256)
    assert (b.name, b.serving.max_num_seqs, b.serving.max_model_len) == ("b", 1, 256)
    assert b.target == a.target and b.speculation.shapes[1] == a.speculation.shapes[1]


def test_merged_values_keep_their_line_numbers(tmp_path):
    # an error in anchored text is reported where it is written, for the pair that merged it, and an
    # override is reported at the override
    text = ANCHORED.replace("num_speculative_tokens: 3", "num_speculative_tokens: 0").replace(
        "      max_num_seqs: 1", "      max_num_seqs: two")
    path = write_recipe(tmp_path, text)
    with pytest.raises(RecipeError) as ei:
        load_recipe(path)
    lines = str(ei.value).splitlines()
    k_line = line_of(text, "num_speculative_tokens")
    assert f"{path}:{k_line}: pairs[0].speculation.num_speculative_tokens: must be >= 1, got integer 0" in lines
    assert f"{path}:{k_line}: pairs[1].speculation.num_speculative_tokens: must be >= 1, got integer 0" in lines
    assert (f"{path}:{line_of(text, 'max_num_seqs: two')}: pairs[1].serving.max_num_seqs: must be an integer, "
            "got string 'two'") in lines


# ------------------------------------------------------------------ recipes: lenient values now refused

BASE = """\
pairs:
  - name: p
    target: ./target
    draft: ./draft
    speculation: {num_speculative_tokens: 3}
    serving: {max_num_seqs: 2, max_model_len: 256}
"""


def test_batch_bucket_above_max_num_seqs(tmp_path):
    text = BASE + "    buckets:\n      batch: [1, 2, 4]\n"
    path = write_recipe(tmp_path, text)
    with pytest.raises(RecipeError) as ei:
        load_recipe(path)
    assert str(ei.value) == (f"{path}:{line_of(text, 'batch:')}: pairs[0].buckets.batch[2]: batch bucket 4 exceeds "
                             "serving.max_num_seqs (2); its graphs could never run (a batch holds at most "
                             "max_num_seqs sequences)")


def test_unknown_export_backend_option(tmp_path):
    text = BASE + "    backend: export\n    backend_options: {threads: 4}\n"
    path = write_recipe(tmp_path, text)
    with pytest.raises(RecipeError) as ei:
        load_recipe(path)
    assert str(ei.value) == (f"{path}:{line_of(text, 'backend_options')}: pairs[0].backend_options.threads: "
                             "unknown option 'threads' for backend export (it takes no options)")
    # the same rule where the backend is made (a --backend override, the library API)
    with pytest.raises(UserError, match=r"backend_options.threads: unknown option 'threads' for backend export"):
        get_backend("export", {"threads": 4})
    with pytest.raises(UserError, match=r"'threads' for backend aoti \(it takes device, inductor_configs, pack_weights, "
                                        r"draft_bfloat16, cpu_isa\)"):
        get_backend("aoti", {"threads": 4})


def test_unknown_backend_option_through_cli(pair, tmp_path):
    recipe = pair / "recipe.yaml"
    recipe.write_text(recipe.read_text().replace("    backend: export\n",
                                                 "    backend: export\n    backend_options: {device: cuda}\n"))
    r = run_cli("eagle3-build", "compile", str(recipe), "--artifacts", str(tmp_path / "art"), timeout=120)
    assert_cli_refused(r, "recipe.yaml:", "backend_options.device", "unknown option 'device' for backend export")


# ------------------------------------------------------------------ safetensors files

def st_split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def st_write(path: Path, header: dict, data: bytes) -> None:
    h = json.dumps(header).encode()
    path.write_bytes(len(h).to_bytes(8, "little") + h + data)


def cut_in_half(p: Path):
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def cut_to_100(p: Path):
    p.write_bytes(p.read_bytes()[:100])


def header_len_2_62(p: Path):
    raw = p.read_bytes()
    p.write_bytes((1 << 62).to_bytes(8, "little") + raw[8:])


def shape_past_end(p: Path):
    header, data = st_split(p)
    header["model.embed_tokens.weight"]["shape"][0] *= 1000
    st_write(p, header, data)


def claims_64_gib(p: Path):
    header, data = st_split(p)
    name = max((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"])  # the last
    header[name] = {"dtype": "U8", "shape": [64 << 30], "data_offsets": [0, 64 << 30]}
    st_write(p, header, data)


def overlapping(p: Path):
    header, data = st_split(p)
    a, b = sorted((i["data_offsets"], n) for n, i in header.items() if n != "__metadata__")[:2]
    header[b[1]]["data_offsets"] = [x - 4 for x in header[b[1]]["data_offsets"]]
    st_write(p, header, data)


def unknown_dtype(p: Path):
    header, data = st_split(p)
    header["model.norm.weight"]["dtype"] = "F128"
    st_write(p, header, data)


def header_not_json(p: Path):
    header, data = st_split(p)
    h = json.dumps(header).encode()
    p.write_bytes(len(h).to_bytes(8, "little") + b"{" + h[1:-1] + b"," + b"}" + data)


SAFETENSORS_CASES = {
    "cut_in_half": (cut_in_half, "run past the end of the data"),
    "cut_to_100_bytes": (cut_to_100, "runs past the end of the file (100 bytes)"),
    "header_length_2_62": (header_len_2_62, f"header length {1 << 62} runs past the end of the file"),
    "shape_past_file_end": (shape_past_end, "tensor model.embed_tokens.weight: shape [512000, 64]"),
    "claims_64_gib": (claims_64_gib, f"data_offsets [0, {64 << 30}] run past the end of the data"),
    "overlapping_offsets": (overlapping, "tensors overlap or leave a gap"),
    "header_not_json": (header_not_json, "header is not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(SAFETENSORS_CASES))
def test_corrupt_safetensors(pair, case):
    mutate, phrase = SAFETENSORS_CASES[case]
    st = pair / "target" / "model.safetensors"
    mutate(st)
    refused(pair, f"truncated or corrupt safetensors file {st}: ", phrase, "re-download it")


def test_unknown_safetensors_dtype(pair):
    st = pair / "target" / "model.safetensors"
    unknown_dtype(st)
    refused(pair, str(st), "tensor model.norm.weight has dtype 'F128'")


def test_corrupt_safetensors_through_cli(pair, tmp_path):
    st = pair / "target" / "model.safetensors"
    header_len_2_62(st)
    assert_cli_refused(run_cli("eagle3-build", "plan", str(pair / "recipe.yaml"), timeout=120),
                       f"truncated or corrupt safetensors file {st}", "re-download it")
    shutil.copyfile(REPO / "tests" / "conftest.py", st)  # not a safetensors file at all
    r = run_cli("eagle3-build", "compile", str(pair / "recipe.yaml"), "--artifacts", str(tmp_path / "art"),
                "--no-verify", timeout=120)
    assert_cli_refused(r, f"truncated or corrupt safetensors file {st}", "re-download it")
    assert not (tmp_path / "art").exists() or list((tmp_path / "art").iterdir()) == []


# ------------------------------------------------------------------ JSON files

def edit_json(path: Path, fn) -> None:
    path.write_text(json.dumps(fn(json.loads(path.read_text()))))


def test_config_field_of_wrong_type(pair):
    cfg = pair / "target" / "config.json"
    edit_json(cfg, lambda c: {**c, "hidden_size": "64"})
    refused(pair, f"target {cfg}: hidden_size must be a positive integer", 'got "64"')


def test_nested_config_field_of_wrong_type(pair):
    cfg = pair / "draft" / "config.json"
    edit_json(cfg, lambda c: {**c, "transformer_layer_config": {**c["transformer_layer_config"],
                                                                "num_attention_heads": 0}})
    target = load_target_of(pair)
    with pytest.raises(CheckpointError, match=r"transformer_layer_config.num_attention_heads must be a positive "
                                              r"integer \(at most 16777216\), got 0"):
        load_draft(resolve(recipe_pair(pair).draft, "draft"), target)


def test_config_not_an_object(pair):
    cfg = pair / "target" / "config.json"
    cfg.write_text("[1, 2]")
    refused(pair, f"target {cfg}: must be a JSON object, got a list")


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
def test_invalid_json_names_the_file(pair, name):
    path = pair / "target" / name
    path.write_text('{"eos_token_id": 2,')
    err = refused(pair, f"target {path}: invalid JSON (", "re-download it")
    assert isinstance(err.__cause__, json.JSONDecodeError)


def test_generation_config_eos_of_wrong_type(pair):
    path = pair / "target" / "generation_config.json"
    edit_json(path, lambda g: {**g, "eos_token_id": "2"})
    refused(pair, f"target {path}: eos_token_id must be a non-negative integer or a list of them", 'got "2"')


def test_invalid_safetensors_index(pair):
    index = pair / "target" / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"lm_head.weight": "model.safetensors"')
    err = refused(pair, f"{index}: invalid JSON (")
    assert isinstance(err.__cause__, json.JSONDecodeError)
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": "../../etc/passwd"}}))
    refused(pair, f"{index}: weight_map names '../../etc/passwd', which is not a .safetensors file in this directory")


# ------------------------------------------------------------------ official-EAGLE pickles

def test_legacy_pytorch_model_bin_loads_with_allow_pickle(pairs, tmp_path):
    pair_dir = Path(shutil.copytree(pairs["eagle"], tmp_path / "pair"))
    bin_path = pair_dir / "draft" / "pytorch_model.bin"
    sd = torch.load(bin_path, weights_only=True)
    torch.save(sd, bin_path, _use_new_zipfile_serialization=False)  # the pre-1.6 (non-zip) format

    spec = recipe_pair(pair_dir)
    assert spec.draft.allow_pickle
    draft = load_draft(resolve(spec.draft, "draft"), load_target(resolve(spec.target, "target")))
    assert draft.format == "eagle"
    assert torch.equal(draft.tensors.get("fc.weight"), sd["fc.weight"])

    recipe = pair_dir / "recipe.yaml"
    recipe.write_text(recipe.read_text().replace("allow_pickle: true", "allow_pickle: false"))
    spec = recipe_pair(pair_dir)
    with pytest.raises(CheckpointError, match="pickles are not loaded by default"):
        load_draft(resolve(spec.draft, "draft"), load_target(resolve(spec.target, "target")))
