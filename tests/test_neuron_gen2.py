"""The NEFF generation of backend neuron (Neuron SDK 2.32 +) through its stand-ins: the `neuronx-cc` CLI
(tests/neuronx_cc_standin.py) and `nrtpy` (tests/nrtpy_standin.py), on the Neuron SDK's Python stack (torch 2.9 +
torch-xla 2.9, PJRT_DEVICE=CPU: .venv-neuron-stack). Bundles are built once per module (TP 1 and 2, a chain and a
dynamic tree) and shared."""
import json
import os
import shlex
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
torch_xla = pytest.importorskip("torch_xla")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from conftest import run_cli  # noqa: E402
from neuron_standin import lay_out_sdk  # noqa: E402
from neuronx_cc_standin import install_neuronx_cc  # noqa: E402
from test_neuron_spmd import PROMPTS, hf_greedy, neuron_pair  # noqa: E402

import nrtpy_standin  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
GEN2 = {"neuronx-cc": "2.27.5334.0", "libneuronxla": "3.0.5356.0"}
TREE = (3, 2, 7)  # a dynamic tree (depth, topk, nodes), as tools/neuron_hlo.py TREES


@pytest.fixture(scope="module")
def gen2_host(tmp_path_factory):
    """This process as an SDK 2.32 host: neuronx-cc, libneuronxla 3 and nrtpy installed (no torch-neuronx)."""
    mp = pytest.MonkeyPatch()
    tmp = tmp_path_factory.mktemp("sdk232")
    site = lay_out_sdk(tmp / "site-packages", GEN2, modules=False)
    mp.syspath_prepend(str(site))
    nrtpy_standin.install_nrtpy(mp, site)
    install_neuronx_cc(tmp / "bin")
    mp.setenv("PATH", f"{tmp / 'bin'}{os.pathsep}{os.environ['PATH']}")
    yield tmp
    mp.undo()


def build(tmp: Path, tp: int, tree: bool):
    from eagle3_build.build import build_bundle
    from eagle3_build.compile.cache import CompileCache

    pair = neuron_pair(tmp, tp)
    if tree:
        from eagle3_build.recipe import Speculation
        from eagle3_runtime.speculation import dynamic_tree

        pair = pair.model_copy(update={"speculation": Speculation(
            num_speculative_tokens=TREE[0], shapes={b: dynamic_tree(*TREE) for b in pair.buckets.batch})})
    out = tmp / "bundle"
    return out, build_bundle(pair, out, cache=CompileCache(tmp / "cache"))


@pytest.fixture(scope="module")
def bundles(gen2_host, tmp_path_factory):
    cache = {}

    def get(tp: int, tree: bool = False):
        if (tp, tree) not in cache:
            cache[tp, tree] = build(tmp_path_factory.mktemp(f"tp{tp}{'tree' if tree else 'chain'}"), tp, tree)
        return cache[tp, tree]

    return get


@pytest.mark.parametrize("tp,tree", [(1, False), (2, False), (1, True), (2, True)])
def test_bundle_has_a_neff_per_graph_with_its_command_and_hlo(bundles, tp, tree):
    import hlo_check
    from eagle3_build.backends.neuron.hlo_proto import signature

    out, m = bundles(tp, tree)
    assert m.toolchain["neuron_generation"] == "neff" and m.toolchain["neuronx_cc"] == GEN2["neuronx-cc"]
    assert m.toolchain["nrtpy"] == nrtpy_standin.VERSION
    files = {f.path for f in m.files}
    for g in m.graphs:
        b = g.backend
        assert b["format"] == "neff" and g.file.path == b["neff"] == f"graphs/{g.name}.neff"
        assert b["hlo"] == f"graphs/{g.name}.hlo" and b["hlo"] in files
        cmd = b["compiler_command"]
        assert cmd[:9] == ["neuronx-cc", "compile", f"{g.name}.hlo", "--framework", "XLA", "--target", "trn2",
                           "--output", f"{g.name}.neff"]
        flags = cmd[9:]  # NxDI's per-role flags, as generation 1 passes them: -O1 context encoding, -O2 the rest
        assert ("-O1" if g.role.endswith("prefill") else "-O2") in flags and flags[:6] == [
            "--lnc", "2", "--model-type", "transformer", "--auto-cast", "none"]
        assert " ".join(flags).endswith("--native-int64 disabled --implicit-integer-downcast all")
        with zipfile.ZipFile(out / b["neff"]) as z:  # the NEFF was made from this HLO, by this command
            meta = json.loads(z.read("neff.json"))
            assert z.read("graph.hlo") == (out / b["hlo"]).read_bytes() and meta["argv"] == cmd
        sig = signature((out / b["hlo"]).read_bytes())
        assert [p["name"] for p in b["neff_inputs"]] == [f"input{i}" for i in range(len(sig.parameters))]
        assert [[p["dtype"], p["shape"]] for p in b["neff_inputs"]] == [[p.dtype, p.shape] for p in sig.parameters]
        state_in = next(i for i, p in enumerate(b["neff_inputs"]) if p["binds"] == "state")
        assert sig.aliases == [(len(sig.results) - 1, state_in)]
        named = {p["input"] for p in b["neff_inputs"] if p["binds"] == "input"}
        assert named <= {s.name for s in g.inputs[1:]}
        outs = [o["output"] for o in b["neff_outputs"] if o["binds"] == "output"]
        assert outs == [s.name for s in g.outputs]  # (graph_contract.ROLES' outputs, in order)
        assert ("all-reduce" in meta["collectives"]) == (tp > 1)
        assert set(b["state_ops"]) == ({"kv_move", "kv_compact"} if tree and g.model == "target" else {"kv_move"})
    # the HLO each NEFF was made from passes the HLO checks (int32 inputs, collectives' groups, KV aliased)
    import torch_xla.core.xla_builder as xb

    for g in m.graphs:
        text = xb.get_computation_hlo(xb.computation_from_module_proto("g", (out / g.backend["hlo"]).read_bytes()))
        found = hlo_check.check(text, tp=tp, expect_collectives=tp > 1)
        issues = [i for i in found["issues"] if "constant" not in i]  # (the tiny model's weights are small)
        assert not issues and len(found["input_output_alias"]) == 1, (g.name, issues)


def test_plan_and_inspect_name_the_generation_and_commands(bundles, gen2_host, tmp_path):
    out, m = bundles(1)
    shown = " ".join(run_cli("eagle3-build", "inspect", str(out)).stdout.split())  # (the console wraps lines)
    assert "neuron generation neff" in shown
    g = m.graphs[0]
    assert f"{g.backend['neff']} from {g.backend['hlo']}: {shlex.join(g.backend['compiler_command'])}" in shown
    from eagle3_build.testing.tiny import make_tiny_pair

    recipe = make_tiny_pair(tmp_path / "pair")
    site = str(gen2_host / "site-packages")  # (the SDK's metadata, for the CLI's own process)
    planned = " ".join(run_cli("eagle3-build", "plan", str(recipe), "--backend", "neuron",
                               env={"PYTHONPATH": site}).stdout.split())
    assert "Neuron SDK generation neff" in planned
    assert "neuronx-cc compile target_prefill_" in planned and "--framework XLA --target trn2" in planned


def test_tp1_bundle_decodes_like_transformers_through_nrtpy(bundles, gen2_host):
    """Real execution: every NEFF's HLO runs on CPU in the nrtpy stand-in."""
    from eagle3_runtime.bundle import Bundle
    from test_neuron_spmd import serve_batch

    out, m = bundles(1)
    bundle = Bundle(out)
    assert type(bundle.backend).__name__ == "NeuronNeffBackend"
    got, moves = serve_batch(bundle, PROMPTS[:2], [12, 6])
    assert moves >= 0
    pair_dir = out.parent / "pair" / "target"
    for ids, n, toks in zip(PROMPTS[:2], [12, 6], got):
        assert toks == hf_greedy(pair_dir, ids, n)
    nrtpy_standin.reset()


def test_tp2_tree_bundle_loads_one_rank_per_thread(bundles, gen2_host):
    """Each rank loads every NEFF with its rank_id on its own core; every graph and KV move called on each rank."""
    from eagle3_runtime.backends.neuron_neff import NeuronNeffBackend
    from eagle3_runtime.bundle import Bundle

    out, m = bundles(2, True)
    errors, backends = [], {}

    def rank(r):
        try:
            b = NeuronNeffBackend(out, m, r)
            backends[r] = b
            b.warm_up(repeats=1, budget_s=0.0)
            b.copy_kv_row(0, 1)
            b.compact_kv(0, [3, 4], [1, 2])
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        finally:
            nrtpy_standin.reset()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors, errors
    for r, b in backends.items():
        models = list(b.neffs.values())
        assert {x.model.rank_id for x in models} == {r} and all(x.model.world_size == 2 and x.model.cc_enabled
                                                               for x in models)
        assert all(x.model.calls >= 1 for x in models)
    assert Bundle  # (one process drives a TP-1 bundle; TP > 1 is a process per rank under torchrun)


def test_neuronx_cc_standin_refuses_a_wrong_command(bundles, tmp_path):
    out, m = bundles(1)
    hlo = out / m.graphs[0].backend["hlo"]
    ok = ["neuronx-cc", "compile", str(hlo), "--framework", "XLA", "--target", "trn2", "--output", str(tmp_path / "g.neff")]

    def cc(argv, **env):
        return subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, **env))

    assert cc(ok + ["--native-int64=disabled"]).returncode == 0
    (tmp_path / "bad.hlo").write_bytes(b"not a module")
    for argv, env, why in [
            (ok + ["--no-such-flag"], {}, "unrecognized arguments"),
            (ok[:3] + ["--framework", "TORCH"] + ok[5:], {}, "invalid choice"),
            (ok[:6] + ["trn9"] + ok[7:], {}, "invalid choice"),
            (ok[:2] + [str(tmp_path / "bad.hlo")] + ok[3:], {}, "not an HloModuleProto"),
            (ok[:2] + [str(tmp_path / "missing.hlo")] + ok[3:], {}, "does not exist"),
            (ok + ["--native-int64=disabled"], {"NEURONX_CC_STANDIN_VERSION": "2.26.6360.0"}, "unrecognized"),
            (["neuronx-cc", "compile", str(hlo), "--framework", "XLA", "--target", "trn2"], {}, "--output")]:
        done = cc(argv, **env)
        assert done.returncode != 0 and why in done.stderr, (argv, done.stderr)


def test_nrtpy_standin_refuses_a_wrong_call(bundles):
    out, m = bundles(1)
    g = next(g for g in m.graphs if g.role == "target_decode")
    nrtpy = nrtpy_standin
    errors = []

    def process(fn):
        def run():
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                errors.append(e)
            finally:
                nrtpy.reset()
        t = threading.Thread(target=run)
        t.start()
        t.join()

    def calls():
        nrtpy.configure(visible_cores=[5])
        model = nrtpy.NrtpyModel.load_from_neff(out / g.backend["neff"], core_id=0, rank_id=0, world_size=1)
        info = model.input_tensors_info
        good = {n: nrtpy.NrtpyTensor.from_numpy(np.zeros(i.shape, i.dtype)) for n, i in info.items()}
        state = next(p["name"] for p in g.backend["neff_inputs"] if p["binds"] == "state")
        outs = {n: nrtpy.NrtpyTensor.from_numpy(np.zeros(i.shape, i.dtype)) for n, i in model.output_tensors_info.items()}
        outs[g.backend["state_output"]] = good[state]
        model(inputs=good, outputs=outs)  # the contract kept: runs
        first = next(iter(info))
        wrong = [({k: v for k, v in good.items() if k != first}, outs, "names differ"),
                 (dict(good, bogus=good[first]), outs, "names differ"),
                 (dict(good, **{first: nrtpy.NrtpyTensor.from_numpy(np.zeros((3, 3), np.float32))}), outs, "takes"),
                 (dict(good, **{state: nrtpy.NrtpyTensor.from_numpy(np.zeros(info[state].shape, np.float64))}),
                  outs, "takes"),
                 (good, dict(outs, **{g.backend["state_output"]: nrtpy.NrtpyTensor.from_numpy(
                     np.zeros(info[state].shape, info[state].dtype))}), "aliases")]
        for ins, os_, why in wrong:
            with pytest.raises(nrtpy.NrtpyError, match=why):
                model(inputs=ins, outputs=os_)
        with pytest.raises(TypeError):
            nrtpy.NrtpyModel.load_from_neff(out / g.backend["neff"], core=0)
        with pytest.raises(nrtpy.NrtpyError, match="cc_enabled"):
            nrtpy.NrtpyModel.load_from_neff(out / g.backend["neff"], rank_id=1, world_size=2)
        with pytest.raises(nrtpy.NrtpyError, match="outside"):
            nrtpy.NrtpyModel.load_from_neff(out / g.backend["neff"], rank_id=2, world_size=2, cc_enabled=True)
        with pytest.raises(nrtpy.NrtpyError, match="already serves rank 0"):
            nrtpy.NrtpyModel.load_from_neff(out / g.backend["neff"], rank_id=1, world_size=2, cc_enabled=True)
        with pytest.raises(RuntimeError, match="already active"):
            nrtpy.configure(visible_cores=[6])
        other = []
        holder = threading.Thread(target=lambda: other.append(_claim(5)))  # another process, the same core
        holder.start()
        holder.join()
        assert "held by another process" in other[0]

    process(calls)
    assert not errors, errors
    tp2 = bundles(2)[0] / bundles(2)[1].graphs[0].backend["neff"]
    with pytest.raises(nrtpy.NrtpyError, match="collectives"):
        nrtpy.NrtpyModel.load_from_neff(tp2)
    nrtpy.reset()


def _claim(core: int) -> str:
    try:
        nrtpy_standin.configure(visible_cores=[core])
        nrtpy_standin.NrtpyTensor.from_numpy(np.zeros(1))
        return "claimed"
    except nrtpy_standin.NrtpyError as e:
        return str(e)
    finally:
        nrtpy_standin.reset()


def test_each_generation_refuses_the_other_in_one_line(bundles, gen2_host, tmp_path, monkeypatch):
    from eagle3_runtime.backends import neuron_sdk
    from eagle3_runtime.backends.neuron import check_host
    from eagle3_runtime.backends.neuron_neff import NeuronNeffBackend
    from eagle3_runtime.bundle import Bundle
    from eagle3_runtime.manifest import BundleError

    out, m = bundles(1)
    # a generation-1 bundle on this (generation-2) host: the NxD runtime names both generations and the fix
    nxd = m.model_copy(update={"toolchain": dict(m.toolchain, neuron_generation="nxd")})
    with pytest.raises(Exception, match="nxd generation .* this host has the neff generation") as e:
        check_host(nxd)
    assert "\n" not in str(e.value) and "rebuild the bundle with this host's SDK" in str(e.value)
    # ... and handed to the NEFF runtime
    with pytest.raises(BundleError, match="nxd generation") as e:
        NeuronNeffBackend(out, nxd, 0)
    assert "\n" not in str(e.value)
    # a generation-2 bundle on a generation-1 host (torch-neuronx + NxD, no nrtpy)
    monkeypatch.setattr(neuron_sdk, "distribution_version", lambda pip: None if pip == "nrtpy" else "1.0")
    with pytest.raises(BundleError, match="neff generation .* this host has the nxd generation"):
        Bundle(out)
    # no nrtpy at all (the CLI's own process): refused in one line, exit 2
    done = run_cli("eagle3-run", str(out), "--prompt", "hi", "--max-tokens", "2")
    assert done.returncode == 2 and "nrtpy, which is not installed" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
