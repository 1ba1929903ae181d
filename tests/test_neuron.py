"""The neuron backend without the Neuron SDK: fast refusal, plan, flags, host checks, and a
CONTRACT TEST with a stand-in `torch_neuronx` (torch.jit.trace on CPU instead of neuronx-cc)."""
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
from conftest import run_cli

from eagle3_build.errors import UserError

REPO = Path(__file__).resolve().parents[1]
COMMON = ["--target", "trn2", "--lnc", "2", "--model-type", "transformer", "--auto-cast", "none"]
# NxDI's defaults (models/model_wrapper.py): context encoding vs token generation / fused speculation
CONTEXT = COMMON + ["-O1", "--tensorizer-options=--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=2 "
                           "--vectorize-strided-dma",
                    "--internal-hlo2tensorizer-options=--modular-flow-mac-threshold=10 --verify-hlo=true"]
TOKEN = COMMON + ["-O2", "--tensorizer-options=--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=1 "
                         "--vectorize-strided-dma",
                  "--internal-hlo2tensorizer-options=--verify-hlo=true"]
ROLE_DEFAULTS = {"target_prefill": CONTEXT, "draft_prefill": CONTEXT, "target_verify": TOKEN,
                 "target_decode": TOKEN, "draft_catchup": TOKEN, "draft_step": TOKEN, "draft_chain": TOKEN}


def test_missing_sdk_fails_fast_without_loading_anything(tmp_path):
    from eagle3_build.testing.tiny import make_tiny_pair

    recipe = make_tiny_pair(tmp_path / "pair")
    art = tmp_path / "artifacts"
    code = ("import sys; from eagle3_build.cli import main; sys.argv = ['eagle3-build', 'compile', sys.argv[1], "
            "'--backend', 'neuron', '--artifacts', sys.argv[2]]\n"
            "try:\n    main()\nexcept SystemExit as e:\n    rc = e.code\n"
            "print('TORCH_IMPORTED' if 'torch' in sys.modules else 'NO_TORCH'); sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code, str(recipe), str(art)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "NO_TORCH" in r.stdout  # refused before torch, transformers or any checkpoint was touched
    msg = " ".join(r.stderr.split())
    assert "torch-neuronx" in msg and "neuronx-cc" in msg and "plan RECIPE --backend neuron" in msg
    assert "Traceback" not in r.stderr and not art.exists()


@pytest.mark.parametrize("recipe,graphs,tp", [
    ("llama31-8b-eagle3.yaml", 5 * 2 + 2 * 4, 8),
    ("gpt-oss-120b-eagle3.yaml", 1 * 2 + 1 * 3, 16),  # K 1: no draft_step
])
def test_plan_neuron_seed_recipes(recipe, graphs, tp):
    r = run_cli("eagle3-build", "plan", str(REPO / "recipes" / recipe), "--backend", "neuron", "--json")
    assert r.returncode == 0, r.stderr
    (plan,) = json.loads(r.stdout)
    assert plan["backend"] == "neuron" and plan["tp_degree"] == tp and len(plan["graphs"]) == graphs
    assert plan["compiler_args"] == ROLE_DEFAULTS  # the seed recipes set only --target / --lnc / --model-type
    # configs only (bundled planning copies: no network, no weights): per-rank weight bytes
    per_rank = plan["weight_bytes_per_rank"]["target"]
    if tp == 8:  # Llama-3.1-8B in bf16: 8.03e9 params x 2 bytes / 8 ranks
        assert abs(per_rank - 8.03e9 * 2 / 8) < 0.02e9, per_rank
    else:  # GPT-OSS-120B in bf16 (116.8e9 params), hidden/intermediate 2880 -> 3072 on the experts, / 16 ranks
        assert 116.8e9 * 2 / 16 < per_rank < 116.8e9 * 2 / 16 * (3072 / 2880) ** 2 * 1.01, per_rank
    assert {g["cache"] for g in plan["graphs"]} == {"unknown"}
    # one NxD ModelBuilder per model: keys (roles + kv_move) with their buckets, priority, flags, rank files
    target, draft = plan["builders"]
    assert (target["model"], draft["model"]) == ("target", "draft") and target["artifact"] == "graphs/target.pt"
    prefill, batch = plan_buckets = (len({g["bucket"] for g in plan["graphs"] if g["role"] == "target_prefill"}),
                                     len({g["bucket"] for g in plan["graphs"] if g["role"] == "target_verify"}))
    assert plan_buckets == ((5, 2) if tp == 8 else (1, 1))
    assert {k["key"]: len(k["buckets"]) for k in target["keys"]} == {
        "target_prefill": prefill, "target_verify": batch, "target_decode": batch, "kv_move": 1}
    # the priority key reads every weight of its model (the draft's step never reads fc)
    assert [k["key"] for k in target["keys"] if k["priority_bucket"] == 0] == ["target_verify"]
    assert [k["key"] for k in draft["keys"] if k["priority_bucket"] == 0] == ["draft_catchup"]
    # the build host's memory: keys with several buckets keep their traced weights + KV cache, then the jobs
    mem = target["memory"]
    assert mem["weight_bytes"] == per_rank + 4 and mem["keys"] == 4 and mem["kept"] == (3 if tp == 8 else 0)
    copy = (mem["weight_bytes"] + mem["state_bytes"]) / 1e9
    assert mem["peak_gb"] == round(3.0 + mem["kept"] * copy + max(copy, mem["compile_jobs"] * 16.0), 2)
    for b in (target, draft):
        for k in b["keys"]:
            assert k["compiler_args"] == ROLE_DEFAULTS.get(k["key"], TOKEN)
        assert [f["path"] for f in b["shard_files"]] == [
            f"weights/{b['model']}/tp{r}_sharded_checkpoint.safetensors" for r in range(tp)]
    assert target["shard_files"][0]["bytes"] == per_rank + 4  # the weights plus the int32 rank weight
    for g in plan["graphs"]:
        assert g["artifact"] == f"graphs/{g['name']}.neff"
        assert g["compiler_command"].startswith(f"neuronx-cc compile --framework XLA {g['name']}.hlo.pb --output "
                                                f"{g['name']}.neff --target trn2 --lnc 2")
        assert (" -O1 " in g["compiler_command"]) == g["role"].endswith("prefill")
        assert ("--cc-pipeline-tiling-factor=1" in g["compiler_command"]) == (not g["role"].endswith("prefill"))


def test_compiler_flags():
    from eagle3_build.backends.neuron.model import compiler_args

    for role, default in ROLE_DEFAULTS.items():
        assert compiler_args({}, role, environ={}) == default
    # recipe flags replace the defaults of the same name (any -O level the other), for every role ...
    got = compiler_args({"compiler_args": ["-O3", "--lnc", "1", "--enable-fast-loading-neuron-binaries"]},
                        "target_prefill", environ={})
    assert got == ["--target", "trn2", "--lnc", "1", "--model-type", "transformer", "--auto-cast", "none", *CONTEXT[9:],
                   "-O3", "--enable-fast-loading-neuron-binaries"]
    # ... and role_compiler_args for one role, last
    opts = {"compiler_args": ["-O3"], "role_compiler_args": {"target_verify": "-O1 --tensorizer-options='--x'"}}
    verify = compiler_args(opts, "target_verify", environ={})
    assert "--tensorizer-options=--x" in verify and "-O1" in verify and not {"-O2", "-O3"} & set(verify)
    assert "-O3" in compiler_args(opts, "target_decode", environ={})
    with pytest.raises(UserError, match="unknown role.*target_verfy"):
        compiler_args({"role_compiler_args": {"target_verfy": ["-O1"]}}, "target_decode", environ={})
    with pytest.raises(UserError, match="NEURON_CC_FLAGS is set"):
        compiler_args({}, "draft_step", environ={"NEURON_CC_FLAGS": "--auto-cast all"})
    folded = compiler_args({"fold_env_flags": True}, "draft_step", environ={"NEURON_CC_FLAGS": "--auto-cast all"})
    assert folded[folded.index("--auto-cast") + 1] == "all"


def test_plan_prints_the_build_hosts_memory():
    r = run_cli("eagle3-build", "plan", str(REPO / "recipes" / "llama31-8b-eagle3.yaml"), "--backend", "neuron")
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stdout.splitlines() if "memory" in x or x.startswith("  ModelBuilder")]
    assert lines[0].startswith("build host memory: peak ~") and "GB available" in lines[0], lines
    assert lines[1].startswith("  ModelBuilder target: 4 keys, 3 keep their traced weights + KV cache (2.08 GB a key)")


def test_plan_refuses_env_flags(monkeypatch):
    r = run_cli("eagle3-build", "plan", str(REPO / "recipes" / "llama31-8b-eagle3.yaml"), "--backend", "neuron",
                env={"NEURON_CC_FLAGS": "-O3"})
    assert r.returncode == 2 and "NEURON_CC_FLAGS" in r.stderr


# ------------------------------------------------------------------ runtime host checks

def manifest_stub(tp=2, **tc):
    toolchain = {"torch_neuronx": "2.9.0", "neuronx_cc": "2.21.1", "libneuronxla": "2.2.1",
                 "neuronx_distributed": "0.18.0", "neuron_target": "trn2", "neuron_lnc": "2"} | tc
    return types.SimpleNamespace(toolchain=toolchain, tp_degree=tp)


SAME = {"torch_neuronx": "2.9.0", "neuronx_cc": "2.21.1", "libneuronxla": "2.2.1", "neuronx_distributed": "0.18.0"}


def test_host_checks_name_the_fix():
    from eagle3_runtime.backends.neuron import NeuronHostError, check_host

    one_device = ["/dev/neuron0"]  # trn2: 8 physical cores -> 4 logical at lnc 2
    check_host(manifest_stub(), environ={}, devices=one_device, versions=SAME)
    with pytest.raises(NeuronHostError, match="neuronx-cc is not installed"):
        check_host(manifest_stub(), environ={}, devices=one_device, versions={k: v for k, v in SAME.items()
                                                                              if k != "neuronx_cc"})
    with pytest.raises(NeuronHostError, match=r"compiled with neuronx-cc 2.21.1, this host has 2.22.0.*"
                                              r"install neuronx-cc==2.21.1"):
        check_host(manifest_stub(), environ={}, devices=one_device, versions=SAME | {"neuronx_cc": "2.22.0"})
    with pytest.raises(NeuronHostError, match=r"install neuronx-cc==2.21.1 \(the bundle was built for Neuron SDK "
                                              r"2.29.1: install that release's stack, e.g. "
                                              r"`pip install 'eagle3-build\[neuron-2-29-1\]'`\)$"):
        check_host(manifest_stub(neuron_sdk_release="2.29.1"), environ={}, devices=one_device,
                   versions=SAME | {"neuronx_cc": "2.22.0"})
    with pytest.raises(NeuronHostError, match="set NEURON_LOGICAL_NC_CONFIG=2"):
        check_host(manifest_stub(), environ={"NEURON_LOGICAL_NC_CONFIG": "1"}, devices=one_device, versions=SAME)
    with pytest.raises(NeuronHostError, match="needs 8 logical NeuronCores.*has 4"):
        check_host(manifest_stub(tp=8), environ={}, devices=one_device, versions=SAME)
    check_host(manifest_stub(tp=8), environ={}, devices=one_device * 2, versions=SAME)


def test_pypi_placeholder_sdk_is_refused_in_one_line(tmp_path):
    """PyPI's torch-neuronx is a 'WRONG PACKAGE' placeholder: find_spec finds it, importing it raises.
    The build refuses it as not installed, naming the Neuron pip repository, before touching torch."""
    from eagle3_build.testing.tiny import make_tiny_pair

    site = tmp_path / "site"
    (site / "torch_neuronx").mkdir(parents=True)
    (site / "torch_neuronx" / "__init__.py").write_text(
        'raise ImportError("WRONG PACKAGE. Please install the package from Neuron Repository - '
        'pip.repos.neuron.amazonaws.com")\n')
    info = site / "torch_neuronx-1.0.dist-info"  # the placeholder wheel's own metadata
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch-neuronx\nVersion: 1.0\n\n"
                                   "WRONG PACKAGE. Please install the package from Neuron Repository - "
                                   "pip.repos.neuron.amazonaws.com\n")
    (info / "RECORD").write_text("")
    recipe = make_tiny_pair(tmp_path / "pair")
    code = ("import sys; sys.path.insert(0, sys.argv[3]); from eagle3_build.cli import main; "
            "sys.argv = ['eagle3-build', 'compile', sys.argv[1], '--backend', 'neuron', '--out', sys.argv[2]]\n"
            "try:\n    main()\nexcept SystemExit as e:\n    rc = e.code\n"
            "print('TORCH_IMPORTED' if 'torch' in sys.modules else 'NO_TORCH'); sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code, str(recipe), str(tmp_path / "out"), str(site)],
                       capture_output=True, text=True, timeout=60)
    msg = " ".join(r.stderr.split())
    assert r.returncode == 2 and "NO_TORCH" in r.stdout, r.stderr
    assert "SDK and torch-neuronx, neuronx-cc, libneuronxla, neuronx-distributed are not installed" in msg, msg
    assert "placeholder" in msg and "pip.repos.neuron.amazonaws.com" in msg
    assert "Traceback" not in r.stderr and "WRONG PACKAGE" not in r.stderr




@pytest.mark.parametrize("release", ["2.27.0", "2.29.1"])
def test_each_sdk_release_compiles_a_model_and_is_recorded(monkeypatch, tmp_path, release):
    """The stand-in at each release (NxD 0.16's trace() has no disable_fail_fast): a model compiles through
    its ModelBuilder and the bundle's toolchain names the release."""
    from neuron_standin import install
    from test_neuron_spmd import neuron_pair, spmd_graphs

    from eagle3_build.backends.neuron.backend import NeuronBackend

    install(monkeypatch, tmp_path / "sdk", release=release)
    backend = NeuronBackend({})
    assert backend.toolchain()["neuron_sdk_release"] == release
    pair = neuron_pair(tmp_path, 2)
    pair = pair.model_copy(update={
        "buckets": pair.buckets.model_copy(update={"prefill": [pair.buckets.prefill[0]], "batch": [1]}),
        "speculation": pair.speculation.model_copy(update={"shapes": {1: pair.speculation.shapes[1]}})})
    info = backend.compile_model(spmd_graphs(pair)["draft"], 2, tmp_path / "out")
    assert (tmp_path / "out" / "draft.pt").is_file() and "kv_move" in info


def test_plan_refuses_an_unknown_neuron_generation(tmp_path):
    from eagle3_build.testing.tiny import make_tiny_pair

    recipe = make_tiny_pair(tmp_path / "pair")
    text = recipe.read_text()
    recipe.write_text(text.replace("backend: export", "backend: neuron\n    backend_options: {generation: gen9}"))
    assert "generation: gen9" in recipe.read_text()
    r = run_cli("eagle3-build", "plan", str(recipe))
    assert r.returncode == 2 and "backend_options.generation: 'gen9' is not a Neuron SDK generation" in r.stderr
    assert "Traceback" not in r.stderr
