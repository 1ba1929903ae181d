"""Neuron SPMD bundles through the stand-in SDK (tests/neuron_standin.py), which enforces NxD's contract
and simulates SPMD: one ModelBuilder per model, one process for every rank, KV caches as device state.

Issue 18's failures of the design this replaced, one test each against that design (kept in
tests/neuron_old_design.py), then the new design through the same checks."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from neuron_standin import StandInModelBuilder, StandInNeuronx, install, standin_sdk  # noqa: F401 (fixture)
from safetensors.torch import load_file


def hf_greedy(target_dir, ids: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    if model.config.model_type == "gpt_oss":
        model.set_experts_implementation("eager")  # the default grouped_mm kernel fails on CPU
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=0)
    return out[0, len(ids):].tolist()

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [[0, 333, 223, 83, 87, 75, 493, 279], [0, 45, 12, 99, 7], [0, 250, 251, 252, 253, 254, 255]]
MAX_TOKENS = [20, 6, 13]  # different lengths: rows finish early and the last row moves down


STANDIN_OPTIONS = {"job_memory_gb": 1}  # the stand-in compiler's jobs take megabytes, not neuronx-cc's 16 GB default


def neuron_pair(tmp_path, tp, arch="llama", options=None, **pair_kw):
    """A tiny pair for backend neuron (`options`: its backend_options; STANDIN_OPTIONS when not given)."""
    from eagle3_build.recipe import load_recipe
    from eagle3_build.testing.tiny import make_tiny_pair

    pair = load_recipe(make_tiny_pair(tmp_path / "pair", tp_degree=tp, arch=arch, **pair_kw)).pairs[0]
    shape = pair.speculation.shapes[1]
    return pair.model_copy(update={
        "backend": "neuron", "backend_options": STANDIN_OPTIONS if options is None else options,
        "serving": pair.serving.model_copy(update={"max_num_seqs": 2}),
        "buckets": pair.buckets.model_copy(update={"batch": [1, 2]}),
        "speculation": pair.speculation.model_copy(update={"shapes": {1: shape, 2: shape}})})


def serve_batch(bundle, prompts=PROMPTS, max_tokens=MAX_TOKENS, speculation="always") -> tuple[list[list[int]], int]:
    """Continuous batching: every request queued at once, two rows at a time."""
    from eagle3_runtime.engine import Engine, Request

    engine = Engine(bundle, speculation=speculation)
    moves = []
    real_move = bundle.copy_kv_row
    bundle.copy_kv_row = lambda src, dst: (moves.append((src, dst)), real_move(src, dst))
    outs = [[] for _ in prompts]
    for i, (ids, n) in enumerate(zip(prompts, max_tokens)):
        engine.submit(Request(list(ids), n, on_event=lambda e, i=i: outs[i].extend(e.token_ids)))
    with torch.inference_mode():
        while engine.has_work():
            engine.step()
    return outs, len(moves)


@pytest.mark.parametrize("tp,arch", [pytest.param(1, "llama", marks=pytest.mark.slow),  # TP 2 and 4: CI
                                     (2, "llama"), (4, "llama"), (2, "gpt-oss")])
def test_spmd_bundle_decodes_like_transformers(standin_sdk, tmp_path, tp, arch):
    from eagle3_build.build import build_bundle
    from eagle3_build.compile.cache import CompileCache
    from eagle3_runtime.bundle import Bundle

    pair = neuron_pair(tmp_path, tp, arch)
    out = tmp_path / "bundle"
    m = build_bundle(pair, out, cache=CompileCache(tmp_path / "cache"))

    # one ModelBuilder per model, keys = its roles + kv_move, one example tuple per bucket, int32 indices
    builders = StandInModelBuilder.instances
    K = pair.speculation.num_speculative_tokens
    assert [sorted(b.model_collection) for b in builders] == [
        ["kv_move", "target_decode", "target_prefill", "target_verify"],
        ["draft_catchup", *(["draft_chain"] if K > 1 else []), "draft_prefill", "kv_move"]]  # (a chain: unrolled)
    for b in builders:
        assert b.tp_degree == tp and b.logical_nc_config == 2
        for key, c in b.model_collection.items():
            assert isinstance(c["compiler_args"], str) and "--lnc 2" in c["compiler_args"]
            assert (c["priority"] == 0) == (key in ("target_verify", "draft_catchup"))  # each reads every weight
            for ex in c["examples"]:
                assert all(x.dtype in (torch.int32, torch.float32) for x in ex)
    assert len(builders[0].model_collection["target_prefill"]["examples"]) == len(pair.buckets.prefill)
    assert len(builders[0].model_collection["target_verify"]["examples"]) == 2
    # the manifest: one NxD model file per model, NxD's per-rank checkpoints with the rank weight
    for name in ("target", "draft"):
        graphs = [g for g in m.graphs if g.model == name]
        assert {g.file.path for g in graphs} == {f"graphs/{name}.pt"}
        assert all(g.backend["format"] == "nxd-model" and g.backend["neff"] == f"graphs/{g.name}.neff"
                   for g in graphs)
        assert [f.path for f in m.models[name].weight_files] == [
            f"weights/{name}/tp{r}_sharded_checkpoint.safetensors" for r in range(tp)]
        for r, f in enumerate(m.models[name].weight_files):
            sd = load_file(out / f.path)
            assert sd["rank_util.rank"].tolist() == [r] and sd["rank_util.rank"].dtype == torch.int32
            assert set(sd) == set(m.models[name].tensors)
        assert (out / f"graphs/{name}.pt").stat().st_size < 2e6  # graphs only: no weights inside
    assert all(i.dtype == "int32" for g in m.graphs for i in g.inputs[1:] if i.name not in ("aux", "hidden"))
    assert m.toolchain["neuronx_distributed"] == "0.19.28492"  # the wheel's version (its module says 0.19.0)
    shown = run_cli("eagle3-build", "inspect", str(out)).stdout
    assert "neuronx-cc target_prefill:" in shown and "tp0_sharded_checkpoint" in shown
    for name in m.models:  # the backend's lines: one NxD model per model, its keys and KV moves
        keys = ", ".join(sorted({g.role for g in m.graphs if g.model == name}))
        assert f"nxd model graphs/{name}.pt" in shown and f"keys {keys}, kv_move" in shown
    assert m.toolchain["neuron_sdk_release"] == "2.31.1"  # (the stand-in lays out the newest release by default)

    # one process drives every rank; continuous batching moves KV rows on the device
    outs, moves = serve_batch(Bundle(out))
    assert moves > 0
    for ids, n, got in zip(PROMPTS, MAX_TOKENS, outs):
        assert got == hf_greedy(tmp_path / "pair" / "target", ids, n)


def test_torchrun_is_refused_with_the_command(standin_sdk, tmp_path):
    """Failure 4 for the new design: a neuron bundle never runs under torchrun (one process owns the cores)."""
    from eagle3_build.build import build_bundle
    from eagle3_build.compile.cache import CompileCache

    out = tmp_path / "bundle"
    build_bundle(neuron_pair(tmp_path, 2), out, cache=CompileCache(tmp_path / "cache"))
    r = run_cli("eagle3-run", str(out), "--prompt", "hi", "--max-tokens", "4",
                env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"})
    assert r.returncode == 2, r.stderr
    msg = " ".join(r.stderr.split())
    assert "do not start it under torchrun" in msg and "NEURON_RT_VISIBLE_CORES=0-1 eagle3-serve" in msg
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------------ issue 18's failures, old design vs new

def old_design_graph(tmp_path, tp):
    """One graph (target_decode b1) as the replaced design exported it."""
    from eagle3_build.backends.export import ExportBackend
    from eagle3_build.backends.per_graph import trace_graphs
    from eagle3_build.pair import build_models, load_pair
    from eagle3_build.compile.cache import CompileCache
    from eagle3_build.compile.tracing import tracing_process_group
    from eagle3_build.graphs import GraphSpec

    pair = neuron_pair(tmp_path, tp).model_copy(update={"backend": "export"})
    bm = build_models(load_pair(pair))
    with tracing_process_group(tp):
        (tg,) = list(trace_graphs(bm, ExportBackend(), CompileCache(tmp_path / "cache"), None, [GraphSpec("target_decode", 1, pair.speculation.shapes[1])]))
    return tg.job.ep


@pytest.mark.parametrize("check, tp, needle", [
    ("aliases", 1, "is also an example input"),   # 1: the KV cache aliased as an example input
    ("weights", 1, "weight tensors"),             # 2: every graph holds the rank's weights
    ("collectives", 2, "c10d_functional"),        # 3: functional collectives (group dropped by torch-xla)
])
def test_standin_catches_the_old_design(monkeypatch, tmp_path, check, tp, needle):
    from neuron_old_design import compile_old

    install(monkeypatch, tmp_path / "sdk", StandInNeuronx(strict={check}))
    ep = old_design_graph(tmp_path, tp)
    from eagle3_build.compile.tracing import tracing_process_group

    with tracing_process_group(tp), pytest.raises(ValueError, match=needle):
        compile_old(ep, tmp_path / "work")


def test_standin_catches_one_process_per_rank(tmp_path):
    """Failure 4: the old runtime loaded a rank per torchrun process; the Neuron runtime gives every visible
    core to the first process, so the second rank's load fails."""
    script = tmp_path / "rank.py"
    script.write_text(
        "import sys, time, torch; sys.path.insert(0, sys.argv[1])\n"
        "import neuron_standin as s\n"
        "m = torch.jit.script(torch.nn.Linear(2, 2))\n"
        "s.StandInNeuronx.replace_weights(m, {})  # the old per-rank loader: NEFF onto the cores\n"
        "print('loaded', flush=True); time.sleep(float(sys.argv[2]))\n")
    env = {"NEURON_STANDIN_DEVICE_DIR": str(tmp_path / "cores"), "PATH": "/usr/bin:/bin"}
    first = subprocess.Popen([sys.executable, str(script), str(REPO / "tests"), "30"], stdout=subprocess.PIPE, text=True,
                             env=env, cwd=REPO)
    try:
        assert first.stdout.readline().strip() == "loaded"
        second = subprocess.run([sys.executable, str(script), str(REPO / "tests"), "0"], capture_output=True,
                                text=True, env=env, cwd=REPO, timeout=60)
        assert second.returncode != 0 and "in use by another process" in second.stderr
    finally:
        first.kill()
        first.wait()


def test_standin_catches_a_rank_read_from_an_input(standin_sdk, tmp_path, monkeypatch):
    """Failure 5: SPMD sends the same inputs to every rank, so a rank taken from an input is rank 0
    everywhere; the simulated TP 2 run then decodes wrong, while the rank weight decodes right."""
    from eagle3_build.backends.neuron import model as neuron
    from eagle3_build.build import build_bundle
    from eagle3_build.compile.cache import CompileCache
    from eagle3_build.models.llama import KVCache
    from eagle3_runtime.bundle import Bundle

    real_run = neuron.NeuronKey.run

    def rank_from_input(self, inputs):  # a rank *input* holds rank 0's value on every rank
        if self.role == neuron.KV_MOVE:
            return real_run(self, inputs)
        cache = KVCache(self.kv, functional=True)
        zero = torch.zeros(1, dtype=torch.int32, device=self.kv.device)
        outs = tuple(self._role_module(cache, zero, *inputs[:self.n_role_inputs]))
        fill = tuple(zero for _ in range(self.n_out - len(outs)))
        return (*outs, *fill, cache.kv)

    monkeypatch.setattr(neuron.NeuronKey, "run", rank_from_input)
    pair = neuron_pair(tmp_path, 2)
    build_bundle(pair, tmp_path / "wrong", cache=CompileCache(tmp_path / "cache"))
    wrong, _ = serve_batch(Bundle(tmp_path / "wrong"), PROMPTS[:1], MAX_TOKENS[:1])
    assert wrong[0] != hf_greedy(tmp_path / "pair" / "target", PROMPTS[0], MAX_TOKENS[0])


def test_standin_refuses_what_nxd_refuses(standin_sdk, tmp_path):
    """The contract checks the new design passes, each shown to fire."""
    from neuron_standin import BaseModelInstance

    class Stateful(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4))
            self.kv = torch.nn.Parameter(torch.zeros(4), requires_grad=False)

        def forward(self, x):
            return x * self.w, self.kv + x.reshape(-1, 4)[0]

    class PerBucket(BaseModelInstance):  # NxDI's DecoderModelInstance: a fresh alias dict per get()
        def __init__(self, module_cls, aliases_of):
            super().__init__(module_cls, None)
            self.aliases_of = aliases_of

        def get(self, bucket_rank, **kwargs):
            return self.module, self.aliases_of(self.module)

    def build(module_cls, aliases_of, examples, instance=PerBucket):
        b = StandInModelBuilder(None, 1, None, compiler_workdir=str(tmp_path / "work"))
        b.add("k", instance(module_cls, aliases_of), examples, "-O2")
        return b.trace(initialize_model_weights=False)

    x = (torch.zeros(4),)
    build(Stateful, lambda m: {m.kv: 1}, [x])  # the happy path
    build(Stateful, lambda m: {m.kv: 1}, [x, (torch.zeros(1, 4),)])  # two buckets, a dict per bucket
    with pytest.raises(ValueError, match="not a Parameter"):
        build(Stateful, lambda m: {torch.zeros(4): 1}, [x])
    with pytest.raises(ValueError, match="same input shapes"):
        build(Stateful, lambda m: {m.kv: 1}, [x, (torch.ones(4),)])

    def once(module_cls, aliases_of):  # one dict, made at load, returned for every bucket (issue 60's bug)
        class Once(BaseModelInstance):
            def load_module(self):
                self.module = self.module_cls()
                self.input_output_aliases = [aliases_of(self.module)]
        return Once(module_cls, None)

    build(Stateful, lambda m: {m.kv: 1}, [x], once)  # one bucket: nothing to go stale
    with pytest.raises(ValueError, match="not a Parameter of the traced module.*earlier bucket"):
        build(Stateful, lambda m: {m.kv: 1}, [x, (torch.zeros(1, 4),)], once)

    class InPlace(Stateful):
        def forward(self, x):
            self.kv.add_(x)
            return x * self.w, self.kv + 0

    with pytest.raises(ValueError, match="mutated in place"):
        build(InPlace, lambda m: {m.kv: 1}, [x])

    class VarArgs(Stateful):
        def forward(self, *xs):
            return xs[0] * self.w, self.kv + xs[0]

    with pytest.raises(NotImplementedError, match=r"\*args"):
        build(VarArgs, lambda m: {m.kv: 1}, [x])
    traced = build(Stateful, lambda m: {m.kv: 1}, [x])
    with pytest.raises(ValueError, match="not initialized"):
        traced(*x)
    with pytest.raises(KeyError, match="missing"):
        traced.nxd_model.initialize([{}], torch.tensor([0], dtype=torch.int32))
    traced.nxd_model.initialize([{"w": torch.ones(4)}], torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match="not found in input_shape_map"):
        traced(torch.zeros(5))


def test_plan_knows_the_built_models_and_refuses_ambiguous_routes(standin_sdk, tmp_path):
    from eagle3_build.build import build_bundle
    from eagle3_build.compile.cache import CompileCache
    from eagle3_build.errors import UserError
    from eagle3_build.plan import plan_pair

    pair, cache = neuron_pair(tmp_path, 1), CompileCache(tmp_path / "cache")
    assert {b["cache"] for b in plan_pair(pair, cache).details["builders"]} == {"miss"}
    build_bundle(pair, tmp_path / "bundle", cache=cache)
    plan = plan_pair(pair, cache)
    assert {b["cache"] for b in plan.details["builders"]} == {"hit"}
    sizes = [f.size for f in __import__("eagle3_runtime.reader").reader.read_manifest(tmp_path / "bundle")
             .models["target"].weight_files]
    assert abs(plan.details["builders"][0]["shard_files"][0]["bytes"] - sizes[0]) < 16 << 10  # (file header aside)
    # a prefill bucket of K + 1 tokens has the draft catch-up's input shapes at batch 1: NxD could not route it
    K = pair.speculation.num_speculative_tokens
    clash = pair.model_copy(update={"buckets": pair.buckets.model_copy(update={"prefill": [K + 1, 64]})})
    with pytest.raises(UserError, match="same shapes.*routes a call by input shapes"):
        build_bundle(clash, tmp_path / "clash", cache=cache)
    assert not (tmp_path / "clash").exists()
    # context buckets: the same inputs as the whole-cache graphs, so not on Neuron yet (one error, nothing built)
    ctx = pair.model_copy(update={"buckets": pair.buckets.model_copy(update={"context": [32]})})
    with pytest.raises(UserError, match="buckets.context is not available yet"):
        build_bundle(ctx, tmp_path / "ctx", cache=cache)
    assert not (tmp_path / "ctx").exists()


def test_a_failed_model_build_is_one_compile_failure(standin_sdk, tmp_path, monkeypatch):
    from eagle3_build.build import build_bundle
    from eagle3_build.compile.cache import CompileCache
    from eagle3_build.compile.scheduler import CompileFailed

    def broken(self, **kw):
        raise RuntimeError("neuronx-cc: internal compiler error (injected)")

    monkeypatch.setattr(StandInModelBuilder, "trace", broken)
    with pytest.raises(CompileFailed) as e:
        build_bundle(neuron_pair(tmp_path, 1), tmp_path / "bundle", cache=CompileCache(tmp_path / "cache"))
    (f,) = e.value.failures
    assert f.job.name == "target (ModelBuilder)" and "internal compiler error" in f.error and f.log.is_file()
    assert not (tmp_path / "bundle").exists()
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.name.endswith(".pt")]


# ------------------------------------------------------------------ token trees: the target's kv_compact key

def tree_pair(tmp_path, tp=1):
    """The tiny llama pair with a dynamic tree (depth 3, topk 2, 7 nodes) in every batch bucket: 8 layers, whose
    noisier target takes the draft's second choice now and then (the 4-layer one, on these prompts, never)."""
    from eagle3_build.recipe import Speculation
    from eagle3_runtime.speculation import dynamic_tree

    pair = neuron_pair(tmp_path, tp, num_layers=8)
    return pair.model_copy(update={"speculation": Speculation(
        num_speculative_tokens=3, shapes={b: dynamic_tree(3, 2, 7) for b in pair.buckets.batch})})


def spmd_graphs(pair):
    from eagle3_build.backends.neuron.bundle import spmd_models
    from eagle3_build.pair import build_models, load_pair

    return {name: sm.graphs for name, sm in spmd_models(build_models(load_pair(pair))).items()}


def test_kv_compact_is_a_target_key_of_tree_bundles_only(tmp_path):
    """(b) a tree bundle's target builder has kv_compact (int32 [1 + 2T], T = depth + 1, routed apart from
    kv_move); the draft never has it; (c) a chain bundle has none; role_compiler_args takes it."""
    from eagle3_build.backends.neuron.model import compiler_args
    from eagle3_runtime.backends.neuron import kv_compact_inputs, routing_signature

    tree = spmd_graphs(tree_pair(tmp_path / "tree"))
    assert "kv_compact" in tree["target"].keys() and "kv_compact" not in tree["draft"].keys()
    assert tree["target"].compact_pairs == 4 and tree["draft"].compact_pairs is None
    (ex,) = tree["target"].examples("kv_compact")
    assert len(ex) == tree["target"].arity and ex[0].dtype == torch.int32 and list(ex[0].shape) == [9]
    assert all(x.numel() == 0 for x in ex[1:])
    (move,) = tree["target"].examples("kv_move")
    assert routing_signature(ex) != routing_signature(move)
    tree["target"].check_routing()
    chain = spmd_graphs(neuron_pair(tmp_path / "chain", 1))
    assert all("kv_compact" not in mg.keys() and mg.compact_pairs is None for mg in chain.values())
    # unused pairs repeat the last real one (a true no-op); at most T pairs
    (x, *_), = [kv_compact_inputs(1, [5, 6], [2, 3], 4, 4)]
    assert x.tolist() == [1, 5, 6, 6, 6, 2, 3, 3, 3]
    with pytest.raises(ValueError, match="at most 4 pairs"):
        kv_compact_inputs(0, [1] * 5, [2] * 5, 4, 4)
    flags = compiler_args({"role_compiler_args": {"kv_compact": "-O3"}}, "kv_compact", environ={})
    assert "-O3" in flags and "-O2" not in flags


def test_kv_compact_moves_slots_functionally(standin_sdk, tmp_path):
    """The key's module: row r's slots src -> dst with every source read first; the other rows untouched."""
    from eagle3_build.backends.neuron.model import KV_COMPACT, DeviceModel, NeuronKey
    from eagle3_runtime.backends.neuron import kv_compact_inputs

    mg = spmd_graphs(tree_pair(tmp_path))["target"]
    shared = DeviceModel(mg)
    with torch.no_grad():
        shared.kv.copy_(torch.randn(shared.kv.shape))
    before = shared.kv.detach().clone()
    key = NeuronKey(KV_COMPACT, shared, 1, mg.n_out)
    *fill, new = key.run(kv_compact_inputs(1, [12, 13], [11, 12], mg.compact_pairs, mg.arity))  # a chained move
    assert len(fill) == mg.n_out and torch.equal(shared.kv, before)  # functional: the state is not mutated
    want = before.clone()
    want[:, :, 1, :, [11, 12]] = before[:, :, 1, :, [12, 13]]
    assert torch.equal(new, want)


def test_tree_bundle_decodes_like_transformers(standin_sdk, tmp_path):
    """(a) a dynamic-tree neuron bundle decodes 3 prompts with continuous batching exactly as transformers'
    greedy, compacting the target KV on the device; (d) with the target's kv_compact key gone from its
    manifest it is refused at load, in one BundleError naming the fix."""
    import json

    from eagle3_build.build import build_bundle
    from eagle3_build.compile.cache import CompileCache
    from eagle3_runtime.bundle import Bundle, BundleError
    from eagle3_runtime.manifest import Manifest

    out = tmp_path / "bundle"
    m = build_bundle(tree_pair(tmp_path), out, cache=CompileCache(tmp_path / "cache"))
    target, draft = StandInModelBuilder.instances
    assert "kv_compact" in target.model_collection and "kv_compact" not in draft.model_collection
    assert "--lnc 2" in target.model_collection["kv_compact"]["compiler_args"]
    assert {g.backend.get("kv_compact_pairs") for g in m.graphs if g.model == "target"} == {4}
    assert not any("kv_compact_pairs" in g.backend for g in m.graphs if g.model == "draft")
    assert "graphs/target_kv_compact.neff" in {f.path for f in m.files}
    assert all(i.dtype == "int32" for g in m.graphs for i in g.inputs[1:] if i.name not in ("aux", "hidden"))

    bundle = Bundle(out)
    compactions = []
    real = bundle.loaded.nxd["target"].compact
    bundle.loaded.nxd["target"].compact = lambda row, src, dst: (compactions.append((row, src, dst)), real(row, src, dst))
    outs, moves = serve_batch(bundle)
    assert moves > 0 and compactions  # rows moved, and accepted tree paths moved their KV slots
    for ids, n, got in zip(PROMPTS, MAX_TOKENS, outs):
        assert got == hf_greedy(tmp_path / "pair" / "target", ids, n)

    path = out / "manifest.json"
    raw = json.loads(path.read_text())
    for g in raw["graphs"]:
        g["backend"].pop("kv_compact_pairs", None)
    raw["digest"] = Manifest.model_validate(raw).compute_digest()
    path.write_text(json.dumps(raw))
    with pytest.raises(BundleError) as e:
        Bundle(out)
    msg = str(e.value)
    assert "token trees" in msg and "no kv_compact key" in msg and "rebuild the bundle" in msg, msg
    from typer.testing import CliRunner

    from eagle3_build.cli import app

    r = CliRunner().invoke(app, ["check", str(out)])
    flat = " ".join(r.output.split())
    assert r.exit_code == 2 and "FAIL nxd calls" in flat and "no kv_compact key" in flat, r.output
    assert "Traceback" not in r.output


def test_every_key_owns_its_module_because_single_bucket_keys_drop_their_weights(standin_sdk, tmp_path):
    """ModelBuilder traces a key that has one bucket with preserve_parameters=False (the stand-in drops that
    module's Parameters as the SDK does). A pair whose keys all have one bucket (the GPT-OSS seed's shape:
    one prefill, one batch bucket) builds, and no Parameter object is shared between two keys' modules."""
    from eagle3_build.backends.neuron.backend import NeuronBackend

    pair = neuron_pair(tmp_path, 2)
    pair = pair.model_copy(update={
        "buckets": pair.buckets.model_copy(update={"prefill": [pair.buckets.prefill[0]], "batch": [1]}),
        "speculation": pair.speculation.model_copy(update={"shapes": {1: pair.speculation.shapes[1]}})})
    mg = spmd_graphs(pair)["target"]
    assert all(len(mg.examples(k)) == 1 for k in mg.keys()) and len(mg.keys()) >= 4
    NeuronBackend({}).compile_model(mg, 2, tmp_path / "out")
    builder = StandInModelBuilder.instances[-1]
    owners: dict[int, str] = {}
    for key, c in builder.model_collection.items():
        for p in c["instance"].module.parameters():
            assert owners.setdefault(id(p), key) == key, f"{key} shares a Parameter with {owners[id(p)]}"
    assert len(builder.model_collection) == len(mg.keys())


def test_a_menu_of_shapes_is_one_nxd_key_per_shape_and_each_decodes_like_transformers(standin_sdk, tmp_path):
    """A chain K 3 bundle with a menu (chain 1, a tree of depth 2, 5 nodes): each menu shape's verify / draft-step
    graphs
    are their own ModelBuilder keys (a key traces one module: another topk or width is another module), the
    tree in the menu brings the target's kv_compact key, and every shape decodes as transformers' greedy."""
    from eagle3_build.build import build_bundle
    from eagle3_build.compile.cache import CompileCache
    from eagle3_build.recipe import Speculation
    from eagle3_runtime.bundle import Bundle
    from eagle3_runtime.speculation import chain, dynamic_tree

    pair = neuron_pair(tmp_path, 2)
    menu = [chain(1), dynamic_tree(2, 2, 5)]  # (5 nodes: NxD routes by shapes, chain K 3 verifies 4)
    pair = pair.model_copy(update={"speculation": Speculation(
        num_speculative_tokens=3, shapes=pair.speculation.shapes, menu={b: menu for b in pair.buckets.batch})})
    out = tmp_path / "bundle"
    m = build_bundle(pair, out, cache=CompileCache(tmp_path / "cache"))
    target, draft = StandInModelBuilder.instances
    keys = set(target.model_collection)
    assert {"target_verify", "target_verify.chain1", "target_verify.tree2x2x5", "kv_compact"} <= keys
    assert {"draft_chain", "draft_step.tree2x2x5"} <= set(draft.model_collection)  # (the chain K 3: unrolled)
    assert len(target.model_collection["target_verify.chain1"]["examples"]) == 2  # batch buckets 1 and 2
    assert m.graph("target_verify", 2, menu[1]).backend["key"] == "target_verify.tree2x2x5"
    bundle = Bundle(out)
    want = [hf_greedy(tmp_path / "pair" / "target", ids, n) for ids, n in zip(PROMPTS, MAX_TOKENS)]
    for tag in ("chain3", "chain1", "tree2x2x5"):
        outs, _ = serve_batch(bundle, speculation=tag)
        assert outs == want, tag
