"""What a neuron build asks of the host that runs ModelBuilder: the weight layout it optimises (the priority
key reads every weight), its working directory, its compiler jobs, its memory. Through the stand-in SDK
(tests/neuron_standin.py), whose ModelBuilder does what NxD 0.16-0.18's does at each of these points."""
import json
import resource
from pathlib import Path

import pytest
import torch
from neuron_standin import COMPILES, StandInModelBuilder, install, standin_sdk  # noqa: F401 (fixture)
from test_neuron_spmd import neuron_pair

from eagle3_build.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def build(pair, out: Path, cache_dir: Path, **kw):
    from eagle3_build.build import build_bundle
    from eagle3_build.compile.cache import CompileCache

    events = []
    m = build_bundle(pair, out, events.append, cache=CompileCache(cache_dir), **kw)
    return m, events


def test_priority_key_reads_every_weight_and_each_builder_has_its_own_directory(standin_sdk, tmp_path,
                                                                                  monkeypatch):
    """ModelBuilder lays out for the priority key's HLO only the weights that HLO reads (the rest keep their
    checkpoint layout in every graph): the draft's step never reads fc, so the priority is its catch-up.
    The layout step writes <key>_<bucket>.hlo into the current directory: each builder runs in its own."""
    user_dir = tmp_path / "user"
    user_dir.mkdir()
    monkeypatch.chdir(user_dir)
    build(neuron_pair(tmp_path, 2), tmp_path / "bundle", tmp_path / "cache")
    target, draft = StandInModelBuilder.instances
    for b in (target, draft):
        assert b.unoptimized == {}, b.unoptimized  # every weight any graph reads is in the priority HLO
        read = set().union(*(h["reads"] for h in b.hlos.values()))
        assert b.layout_weights == read
    assert {"model.fc.weight", "model.embed_tokens.weight"} <= draft.layout_weights
    assert "model.fc.weight" not in draft.hlos[("draft_chain", 0)]["reads"]  # why the steps cannot be the priority
    cwds = {Path(b.cwd) for b in (target, draft)}
    assert len(cwds) == 2 and user_dir not in cwds and all(tmp_path / "cache" in c.parents for c in cwds)
    assert Path.cwd() == user_dir and list(user_dir.iterdir()) == []


def test_a_priority_key_that_misses_a_weight_is_refused(standin_sdk, tmp_path, monkeypatch):
    """The plan-time check: a priority key that does not read every weight is refused, naming what it misses."""
    from eagle3_build.backends.neuron import model as neuron
    from eagle3_build.plan import plan_pair
    from eagle3_build.compile.cache import CompileCache

    monkeypatch.setitem(neuron.PRIORITY_ROLES, "draft", ("draft_chain",))
    with pytest.raises(UserError, match=r"no key of the draft reads every weight \(draft_chain does not read "
                                        r"fc\.weight"):
        plan_pair(neuron_pair(tmp_path, 2), CompileCache(tmp_path / "cache"))


@pytest.mark.parametrize("jobs", [1, 2])
def test_modelbuilders_compiler_pool_is_bounded_by_jobs(standin_sdk, tmp_path, jobs):
    """ModelBuilder compiles through an unbounded ThreadPoolExecutor; --jobs bounds the neuronx-cc jobs."""
    pair = neuron_pair(tmp_path, 2)
    build(pair, tmp_path / "bundle", tmp_path / "cache", jobs=jobs)
    assert COMPILES["calls"] >= 6 and COMPILES["most"] == jobs


def test_without_the_bound_the_pool_runs_everything_at_once(standin_sdk, tmp_path, monkeypatch):
    """The control: the stand-in's pool is as unbounded as NxD's (cores + 4 threads)."""
    import contextlib

    from eagle3_build.backends.neuron import backend

    monkeypatch.setattr(backend, "bounded_compiles", lambda jobs: contextlib.nullcontext())
    build(neuron_pair(tmp_path, 2), tmp_path / "bundle", tmp_path / "cache", jobs=1)
    assert COMPILES["most"] > 2


def test_a_build_that_does_not_fit_the_hosts_memory_is_refused_before_it_starts(standin_sdk, tmp_path, monkeypatch):
    from eagle3_build.backends.neuron import bundle

    monkeypatch.setattr(bundle, "available_memory_gb", lambda: 10.0)
    pair = neuron_pair(tmp_path, 2, options={})  # (neuronx-cc's default job memory)
    with pytest.raises(UserError, match=r"needs about 19\.0 GB of memory at --jobs 1 \(ModelBuilder target: .*\) and "
                                        r"this host has 10\.0 GB available; build on a host with at least 19 GB free, "
                                        r"or set backend_options\.job_memory_gb"):
        build(pair, tmp_path / "bundle", tmp_path / "cache")
    assert not (tmp_path / "bundle").exists() and COMPILES["calls"] == 0
    assert not list((tmp_path / "cache" / "tmp").glob("*"))
    monkeypatch.setattr(bundle, "available_memory_gb", lambda: 40.0)
    with pytest.raises(UserError, match=r"needs about 51\.0 GB of memory at --jobs 3 .* 40\.0 GB available; run with "
                                        r"--jobs 2 \(peak ~35\.0 GB\)"):
        build(pair, tmp_path / "bundle", tmp_path / "cache", jobs=3)
    small = pair.model_copy(update={"backend_options": {"job_memory_gb": 4}})
    monkeypatch.setattr(bundle, "available_memory_gb", lambda: 10.0)
    m, events = build(small, tmp_path / "bundle", tmp_path / "cache")  # 3 + 4: fits
    assert [e["jobs"] for e in events if e.get("stage") == "graphs"] == [1]  # 10 GB: one 4 GB job beside 3 GB


def test_a_newer_sdk_is_built_for_with_a_warning_recorded(monkeypatch, tmp_path):
    from neuron_standin import release_versions

    newer = release_versions("2.31.1") | {"torch-neuronx": "2.9.0.2.16.40000"}
    install(monkeypatch, tmp_path / "sdk", versions=newer)
    monkeypatch.setenv("NEURON_RT_NUM_CORES", "8")
    m, events = build(neuron_pair(tmp_path, 2), tmp_path / "bundle", tmp_path / "cache")
    (warning,) = [e["message"] for e in events if e["event"] == "warning"]
    assert "torch-neuronx 2.9.0.2.16.40000" in warning and warning in m.notes
    assert m.toolchain["neuron_sdk_release"] == "unknown" and m.toolchain["torch_neuronx"] == "2.9.0.2.16.40000"


# ------------------------------------------------------------------ memory of the key modules

def scaled_8b(tp: int):
    """The Llama-3.1-8B recipe's models with the 8B's shapes scaled down (hidden 1024, 8 layers, the real
    vocab 128256 and draft vocab 32000), from configs only: 0.8 GB of bf16 weights, 0.4 GB a rank at TP 2."""
    from eagle3_build import plan
    from eagle3_build.backends.neuron.bundle import spmd_models
    from eagle3_build.pair import build_models
    from eagle3_build.recipe import load_recipe

    known = REPO / "eagle3_build" / "known_configs"
    scale = {"hidden_size": 1024, "intermediate_size": 3584, "num_attention_heads": 8, "num_key_value_heads": 8}
    configs = {"target": json.loads((known / "meta-llama--Llama-3.1-8B-Instruct.json").read_text()),
               "draft": json.loads((known / "yuhuili--EAGLE3-LLaMA3.1-Instruct-8B.json").read_text())}
    configs["target"]["config"] |= scale | {"num_hidden_layers": 8}
    configs["draft"]["config"] |= scale
    real = plan._config_dir
    plan._config_dir = lambda spec, role: (known, configs[role], "scaled-down 8B")
    try:
        pair = load_recipe(REPO / "recipes" / "llama31-8b-eagle3.yaml").pairs[0]
        pair = pair.model_copy(update={"parallel": pair.parallel.model_copy(update={"tp_degree": tp})})
        lp, _ = plan.config_only_pair(pair)
    finally:
        plan._config_dir = real
    return spmd_models(build_models(lp))


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


@pytest.mark.parametrize("zeros", ["untouched", "written"])
def test_key_modules_touch_no_weight_memory(monkeypatch, zeros):
    """Every key's module gets its own rank-local weight and KV Parameters (ModelBuilder must not share them
    across keys), ModelBuilder keeps every key's module until its trace ends: with written zeros that is a
    full weight copy per key (the control: what torch.zeros did), with untouched ones nothing."""
    from eagle3_build.backends.neuron import model as neuron

    if zeros == "written":
        monkeypatch.setattr(neuron, "untouched_zeros", lambda shape, dtype: torch.zeros(shape, dtype=dtype))
    models = scaled_8b(tp=2)
    mg = models["target"].graphs
    per_key = models["target"].memory()
    assert per_key.weight_bytes > 0.35e9  # one rank's weights
    before = rss_bytes()
    modules = [neuron.key_module(mg, key, comm=neuron.ShapeCollectives(2)) for key in mg.keys()]
    grown = rss_bytes() - before
    copies = len(modules) * (per_key.weight_bytes + per_key.state_bytes)
    print(f"{len(modules)} key modules, {copies / 1e9:.2f} GB of Parameters: RSS grew {grown / 1e9:.3f} GB ({zeros})")
    if zeros == "untouched":
        assert grown < 0.02 * copies, grown
    else:
        assert grown > 0.9 * copies, grown  # what the test would see on the old torch.zeros Parameters
