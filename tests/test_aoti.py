"""Backend aoti: AOTInductor packages (native code), weights bound from the bundle at load, one package
per graph for every rank, TP collectives compiled in and run under gloo (torchrun). Greedy output ==
the export bundle == transformers' greedy generate of the target."""
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_cli
from test_tp import torchrun

from eagle3_build.backends.aoti import buildable
from eagle3_build.backends.cpu.inductor_internals import lean_wrapper_available
from eagle3_runtime.manifest import BLOCKED_BF16, BLOCKED_FORMATS, FUSED_FORMATS, ONEDNN_FORMATS
from eagle3_runtime.packing import BF16, NO_PACK, pack_available

PROMPT = "Once upon a time, in a land far away"
MAX_TOKENS = 32


AOTI_RECIPE = {"buckets": {"prefill": [64]}}  # with K 1: 5 graphs per bundle (no draft_step: CI time)
# aoti bundles at TP 1 / 2: a packing format named, where this host can build it (oneDNN's float32 path is the
# draft's bfloat16 one below, and test_a_new_prefill_bucket_rekeys_its_own_graphs_only's; Inductor's template with
# its own register blocking: test_a_bundle_built_for_avx2_runs_where_only_avx2_does's)
PACKING = {1: "mkl_sgemm", 2: "blocked"}
# ... and at TP 2 the draft's projections in bfloat16 (draft_bfloat16: true): oneDNN's GEMM where it runs (AVX-512),
# Inductor's template over a bfloat16 blocked copy elsewhere
DRAFT_BF16 = {2: True}


def draft_bf16_form() -> str | None:
    """The bfloat16 GEMM draft_bfloat16: true names on this host (None: none here)."""
    from eagle3_build.backends.aoti import AotiBackend

    return next(iter(AotiBackend({}).bf16_formats()), None)


def packing(tp: int) -> str:
    """PACKING[tp]; Inductor's template with a register blocking named (this ISA's last: 8x8 on AVX2, 16x16 on
    AVX-512) where it has one, to build the blocking a copy's block_n names rather than Inductor's choice."""
    from eagle3_build.backends.cpu import gemm, inductor_internals as inductor

    fmt = PACKING[tp]
    return gemm.blocked_format(fmt, inductor.register_blockings()[-1]) if fmt == "blocked" and buildable(fmt) else fmt


@pytest.fixture(scope="module")
def world(tiny):
    return {"tiny": tiny, "ref": {}}


def build(world, backend: str, tp: int):
    """The session's tiny pair (speculators, K 1) with one prefill bucket at TP `tp`, built by
    `eagle3-build compile --backend BACKEND --jobs 2` (aoti: packing as `packing` names it)."""
    recipe = AOTI_RECIPE
    if backend == "aoti" and buildable(PACKING[tp]):
        opts = {"pack_weights": packing(tp)} | ({"draft_bfloat16": True} if DRAFT_BF16.get(tp) and draft_bf16_form()
                                               else {})
        recipe = {**recipe, "backend": "aoti", "backend_options": opts}
    return world["tiny"].bundle(k=1, backend=backend, tp=tp, recipe=recipe, jobs=2, cli=True)


def reference(world, ids: list[int]) -> list[int]:
    key = tuple(ids)
    if key not in world["ref"]:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(world["tiny"].pair().parent / "target", dtype=torch.float32)
        out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
        world["ref"][key] = out[0, len(ids):].tolist()
    return world["ref"][key]


def generate(bundle: Path, tp: int = 1, env: dict | None = None) -> dict:
    args = [str(bundle), "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), "--json"]
    r = run_cli("eagle3-run", *args, env=env) if tp == 1 else torchrun(tp, "-m", "eagle3_runtime.cli", *args, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # the default run covers aoti through the TP-2 test below (same code path, plus collectives)
def test_aoti_tp1_decodes_like_export_and_transformers(world):
    aoti = build(world, "aoti", 1).path
    m = json.loads((aoti / "manifest.json").read_text())
    assert m["backend"] == "aoti" and len(m["graphs"]) == 5
    assert m["toolchain"]["aoti_target"].startswith("cpu:")
    for g in m["graphs"]:  # native code in every package, no weights inside
        with zipfile.ZipFile(aoti / g["file"]["path"]) as z:
            names = z.namelist()
        assert any(n.endswith(".so") for n in names), names
        assert g["file"]["size"] < 20e6
    assert_packed_projections(m)
    got = generate(aoti)
    assert got["token_ids"] == reference(world, got["prompt_token_ids"])
    assert got["spec_decoding"]["num_accepted_tokens"] > 0
    exp = generate(build(world, "export", 1).path)
    assert exp["token_ids"] == got["token_ids"]


def test_aoti_tp2_under_torchrun(world):
    """Two ranks, each binding its own weights to the same native packages; the all-reduces inside
    the compiled code run under gloo. Greedy output == transformers."""
    aoti = build(world, "aoti", 2).path
    m = json.loads((aoti / "manifest.json").read_text())
    assert m["backend"] == "aoti" and m["tp_degree"] == 2 and len(m["models"]["target"]["weight_files"]) == 2
    assert m["toolchain"]["aoti_target"].startswith("cpu:")
    for g in m["graphs"]:  # native code in every package, no weights inside
        with zipfile.ZipFile(aoti / g["file"]["path"]) as z:
            assert any(n.endswith(".so") for n in z.namelist())
        assert g["file"]["size"] < 20e6
    assert_packed_projections(m)
    for g in m["graphs"]:  # no compiled kernel reads an all-reduce's buffer before its wait
        assert reads_before_wait(aoti / g["file"]["path"]) == [], g["name"]
        if lean_wrapper_available():  # AOTI's opt-in per-input check functions are not written
            wrapper = wrapper_source(aoti / g["file"]["path"])
            assert "check_input_0(" not in wrapper and "__check_inputs_outputs(" in wrapper, g["name"]
    got = generate(aoti, tp=2)
    assert got["token_ids"] == reference(world, got["prompt_token_ids"])
    assert got["spec_decoding"]["num_accepted_tokens"] > 0
    if buildable(PACKING[2]):
        r = run_cli("eagle3-build", "inspect", str(aoti))
        assert r.returncode == 0 and f"GEMM per token row count: 1 row {packing(2)}" in r.stdout, r.stdout[-2000:]
        if draft_bf16_form():  # the draft's GEMMs in bfloat16: listed, and the output stays exact (above)
            assert f"; draft: 1 row {draft_bf16_form()}" in r.stdout.replace("\n", " "), r.stdout[-2000:]
        if draft_bf16_form() == BF16:  # built for oneDNN-packed draft weights, run where none can be made: plain ones
            assert generate(aoti, tp=2, env={NO_PACK: "1"})["token_ids"] == got["token_ids"]


def wrapper_source(package: Path) -> str:
    """The generated C++ wrapper of an AOTI package."""
    with zipfile.ZipFile(package) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".wrapper.cpp")]
        return z.read(name).decode()


def reads_before_wait(package: Path) -> list[str]:
    """Lines of the package's generated C++ wrapper that use an in-place all-reduce's buffer between the
    collective and its wait_tensor (a race under gloo: Inductor's locality reorder once produced one)."""
    import re

    lines = wrapper_source(package).splitlines()
    bad = []
    for i, line in enumerate(lines):
        m = re.search(r"_c10d_functional_all_reduce_\((buf\d+),", line)
        if not m:
            continue
        buf = m.group(1)
        for later in lines[i + 1:]:
            if f"wait_tensor({buf}," in later:
                break
            if re.search(rf"\b{buf}\b", later) and f"{buf}.reset()" not in later:
                bad.append(later.strip())
                break
    return bad


def test_aoti_bundle_from_a_remote_needs_a_pin_and_loads_with_one(world, tmp_path, monkeypatch):
    """A native-code bundle fetched from a remote: refused unpinned; with its digest pinned (or
    --trust-remote-code) every file, each package's own signature included, verifies."""
    aoti = build(world, "aoti", 2).path
    digest = json.loads((aoti / "manifest.json").read_text())["digest"]
    monkeypatch.setenv("EAGLE3_RUNTIME_CACHE", str(tmp_path / "runtime-cache"))
    shutil.copytree(aoti, tmp_path / "remote" / "main")
    remote = f"file://{tmp_path / 'remote'}@main"
    r = run_cli("eagle3-build", "pull", remote)
    assert r.returncode == 2 and "native code (aoti)" in r.stderr and digest in r.stderr
    for args in ((f"{remote}#sha256={digest}",), (remote, "--trust-remote-code")):
        r = run_cli("eagle3-build", "pull", *args)
        assert r.returncode == 0 and digest in r.stderr, r.stderr
    r = run_cli("eagle3-build", "check", str(aoti), "--files", "--ranks", "2")
    assert r.returncode == 0, r.stderr


def assert_packed_projections(m: dict) -> None:
    """float32 on CPU with the format named (PACKING): the projections of decode-sized graphs take their
    weight packed for their row count (made at load); prefill graphs only the last position's lm_head with
    MKL's format (and blocked), every projection with oneDNN's (one copy serves every row count); oneDNN's and
    blocked also fuse q/k/v and gate/up into one copy each. A blocked format named with its register blocking
    ("blocked:8x8") lays every blocked copy out in that blocking's block_n."""
    from eagle3_build.backends.cpu import gemm

    opts = m["recipe"]["backend_options"]
    form = opts.get("pack_weights")
    if form is None:
        return
    fmt, blocking = gemm.format_parts(form)
    draft_form = draft_bf16_form() if opts.get("draft_bfloat16") is True else form
    assert {r["choice"] for r in m["build"]["gemm"]["rows"].values()} == {form}
    assert {r["choice"] for r in m["build"]["gemm"]["draft"]["rows"].values()} == {draft_form}
    for g in m["graphs"]:
        rows = {p["rows"] for p in g["packed"]}
        want = gemm.format_parts(draft_form)[0] if g["role"].startswith("draft") else fmt
        assert all(p["weight"] in g["weights"] and p["format"] == want for p in g["packed"]), g["name"]
        assert all(not p["fused"] for p in g["packed"]) or want in FUSED_FORMATS
        assert all((p["block_n"] is not None) == (p["format"] in BLOCKED_FORMATS) for p in g["packed"])
        if blocking:
            assert {p["block_n"] for p in g["packed"] if p["format"] == "blocked"} <= {blocking[1]}, g["name"]
        if g["role"].endswith("prefill") and want not in ONEDNN_FORMATS:
            assert [p["weight"].split("/")[1] for p in g["packed"]] in ([], ["lm_head.weight"]), g["name"]
            assert rows <= {1}
        elif g["role"].endswith("prefill"):
            assert rows == {1, g["bucket"]}, g["name"]
        else:
            assert g["packed"] and max(rows) <= 32, g["name"]
    by_role = {g["role"]: g for g in m["graphs"] if g["bucket"] == 1}
    assert {p["rows"] for p in by_role["target_decode"]["packed"]} == {1}
    verify = by_role["target_verify"]
    assert {p["rows"] for p in verify["packed"]} == {verify["inputs"][1]["shape"][1]}  # the verify's nodes
    layers = m["models"]["target"]["config"]["num_layers"]
    if fmt in FUSED_FORMATS:  # q+k+v and gate+up one copy each, o, down; lm_head
        assert len(verify["packed"]) == 4 * layers + 1
        groups = [tuple(n.rsplit(".", 2)[-2] for n in (p["weight"], *p["fused"])) for p in verify["packed"] if p["fused"]]
        assert sorted(set(groups)) == [("gate_proj", "up_proj"), ("q_proj", "k_proj", "v_proj")]
        assert len(groups) == 2 * layers
    else:
        assert len(verify["packed"]) == 7 * layers + 1  # q k v o gate up down per layer, lm_head


def compile_command(package: Path) -> str:
    """The g++ command lines Inductor noted in an AOTI package's kernel source."""
    with zipfile.ZipFile(package) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".kernel.cpp")]
        return "\n".join(line for line in z.read(name).decode().splitlines() if line.startswith("// g++ "))


AVX512_CODE = re.compile(r"%zmm|%[xy]mm(1[6-9]|2\d|3[01])\b|\{%k[1-7]\}")  # (registers only AVX-512 has)


def avx512_instructions(package: Path, tmp: Path) -> int:
    """Instructions of the package's native code that name a register only AVX-512 has (objdump)."""
    with zipfile.ZipFile(package) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".so")]
        so = tmp / f"{package.stem}.so"
        so.write_bytes(z.read(name))
    r = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(so)], capture_output=True, text=True, check=True)
    return sum(bool(AVX512_CODE.search(line)) for line in r.stdout.splitlines())


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512") or not shutil.which("objdump"),
                    reason="an x86 host with AVX2 and binutils' objdump")
def test_a_bundle_built_for_avx2_runs_where_only_avx2_does(world, tmp_path, monkeypatch):
    """backend_options.cpu_isa: avx2 builds the graphs for AVX2 on any host that runs AVX2 code (an AVX-512 CI
    host building for a fleet of AVX2 servers): no AVX-512 instruction in any package (where this host has
    AVX-512, its own build has them), the GEMM template's blocked copies laid out for the AVX2 micro-kernel,
    output == transformers; an AVX2 host loads it and refuses the host-ISA bundle with the option as the fix.
    oneDNN's bfloat16 GEMM, which AVX2 CPUs lack, is never the draft's there."""
    from eagle3_build.backends.aoti import AotiBackend
    from eagle3_build.errors import UserError
    from eagle3_runtime.backends.aoti import AotiBackend as RuntimeAoti
    from eagle3_runtime.manifest import Manifest

    opts = {"cpu_isa": "avx2", **({"pack_weights": "blocked"} if buildable("blocked") else {})}
    built = world["tiny"].bundle(k=1, recipe={**AOTI_RECIPE, "backend": "aoti", "backend_options": opts}, jobs=2)
    m = built.manifest
    assert m["toolchain"]["aoti_target"] == "cpu:AVX2"
    for g in m["graphs"]:
        assert avx512_instructions(built.path / g["file"]["path"], tmp_path) == 0, g["name"]
    if buildable("blocked"):
        assert {p["block_n"] for g in m["graphs"] for p in g["packed"]} <= {8, 16, 24}  # (AVX2's register blocks)
    assert m["toolchain"]["aoti_march"] == "x86-64-v3" and "-march=x86-64-v3 -mtune=native" in compile_command(
        built.path / m["graphs"][0]["file"]["path"])
    if torch.backends.cpu.get_cpu_capability() == "AVX512":  # (the check can fail: the host's own build)
        own = build(world, "aoti", 2)
        package = own.path / own.manifest["graphs"][0]["file"]["path"]
        assert own.manifest["toolchain"]["aoti_target"] == "cpu:AVX512" and avx512_instructions(package, tmp_path) > 0
        # ... for the portable AVX-512 level (x86-64-v4: Intel's and AMD's), not this CPU model's -march=native
        assert own.manifest["toolchain"]["aoti_march"] == "x86-64-v4" and "-march=native" not in compile_command(package)
        assert AotiBackend({"cpu_isa": "avx2"}).key_fields("target_decode") != AotiBackend({}).key_fields("target_decode")
    got = generate(built.path)
    assert got["token_ids"] == reference(world, got["prompt_token_ids"])
    # an AVX2 host: this bundle passes the check; one built for AVX-512 is refused, naming the option
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    avx2 = Manifest.model_validate(m)
    assert all(c.ok for c in RuntimeAoti.host_checks(avx2, {}))
    wide = avx2.model_copy(update={"toolchain": {**avx2.toolchain, "aoti_target": "cpu:AVX512"}})
    (bad,) = [c for c in RuntimeAoti.host_checks(wide, {}) if not c.ok]
    assert "compiled for AVX512 CPUs, this host supports AVX2" in bad.detail and "cpu_isa: avx2" in bad.detail
    with pytest.raises(UserError, match="cpu_isa avx512: this build host runs AVX2 code"):
        AotiBackend({"cpu_isa": "avx512"})
    monkeypatch.undo()
    # oneDNN has no bfloat16 GEMM on AVX2 CPUs: not a candidate for the draft of an AVX2 build (Inductor's template
    # over a bfloat16 blocked copy is, and what draft_bfloat16: true names there), and a bundle that calls it is
    # refused at load where oneDNN cannot run it
    avx2 = AotiBackend({"cpu_isa": "avx2"})
    assert avx2.bf16_formats() == ([BLOCKED_BF16] if buildable(BLOCKED_BF16) else [])
    rec = avx2.gemm_choice("float32", [(64, 32)], [1], None, [(64, 32)], draft_bf16=True)
    assert all(BF16 not in v["ms"] for v in rec["draft"]["rows"].values())
    assert all((BLOCKED_BF16 in v["ms"]) == buildable(BLOCKED_BF16) for v in rec["draft"]["rows"].values())
    monkeypatch.setattr(AotiBackend, "bf16_formats", lambda self: [])
    with pytest.raises(UserError, match="draft_bfloat16: true: no bfloat16 GEMM is available"):
        AotiBackend({"cpu_isa": "avx2", "draft_bfloat16": True})
    monkeypatch.undo()
    two = build(world, "aoti", 2).manifest
    if any(p["format"] == BF16 for g in two["graphs"] for p in g["packed"]):
        monkeypatch.setattr("eagle3_runtime.backends.aoti.onednn_bf16_available", lambda: False)
        (bad,) = [c for c in RuntimeAoti.host_checks(Manifest.model_validate(two), {}) if not c.ok]
        assert "oneDNN's bfloat16 GEMM" in bad.detail and "draft_bfloat16: false" in bad.detail
        monkeypatch.undo()
    with pytest.raises(UserError, match="cpu_isa 'avx1024': choose host"):
        AotiBackend({"cpu_isa": "avx1024"})
    r = run_cli("eagle3-build", "compile", str(world["tiny"].recipe(k=1, recipe={
        "backend": "aoti", "backend_options": {"cpu_isa": ["avx2"]}})), "--out", str(tmp_path / "never"))
    assert r.returncode == 2 and "backend_options.cpu_isa ['avx2']: choose host" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not (tmp_path / "never").exists()


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="the bundle of the test above (an x86 host with AVX2)")
def test_graph_profile_names_each_kernel_of_a_bundle_graph(world, tmp_path):
    """`python -m benchmarks graph --profile RECIPE` on that bundle: one graph recompiled with kernel profiling gives
    the bundle graph's outputs, and its kernels (the blocked GEMMs by shape, ATen's attention) account for most of
    a call; a recipe that traces to other graphs is refused."""
    built = world["tiny"].bundle(k=1, recipe={**AOTI_RECIPE, "backend": "aoti", "backend_options": {
        "cpu_isa": "avx2", **({"pack_weights": "blocked"} if buildable("blocked") else {})}}, jobs=2)
    script = [sys.executable, "-m", "benchmarks", "graph", str(built.path), "--profile"]
    r = subprocess.run([*script, str(built.recipe), "--graphs", "target_decode_b1", "--repeats", "5",
                        "--save-result", str(tmp_path / "p.json")], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    g = json.loads((tmp_path / "p.json").read_text())["graphs"]["target_decode_b1"]
    names = [k["kernel"] for k in g["kernels"]]
    assert any(n.startswith("aten ") and "attention" in n for n in names), names
    if buildable("blocked"):
        assert any(re.fullmatch(r"gemm m1n\d+k\d+", n) for n in names), names
    assert 0 < g["kernels_ms"] <= g["profiled_wall_ms"] and g["bundle_ms"] > 0
    other = world["tiny"].recipe(k=1, recipe={**AOTI_RECIPE, "backend": "aoti", "backend_options": {
        "cpu_isa": "avx2", "pack_weights": False}})  # (other graphs: no packed weights)
    r = subprocess.run([*script, str(other), "--graphs", "target_decode_b1"], capture_output=True, text=True,
                       timeout=600, cwd=REPO)
    assert r.returncode != 0 and "traces to another graph" in r.stderr, r.stderr[-2000:]


def test_aoti_bundle_refused_on_another_torch(world, monkeypatch):
    from eagle3_runtime.bundle import Bundle, BundleError

    aoti = build(world, "aoti", 2).path
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    with pytest.raises(BundleError, match="compiled against torch"):
        Bundle(aoti, rank=0)


def test_inductor_isa_probe_is_memoised_per_host(world):
    """Inductor's CPU ISA probe (~19 s per process: compile + dlopen a test program per ISA) ran once
    for the build above and was memoised in the compile cache; a compile then skips it only when the
    memo proved every ISA the CPU flags list (otherwise Inductor probes as usual)."""
    from eagle3_build.backends.aoti import AotiBackend, host_vec_isa

    root = build(world, "aoti", 2).cache  # the cache that build ran in
    memos = list((root / "host").glob("vec-isa-*.json"))
    assert len(memos) == 1, memos
    memo = json.loads(memos[0].read_text())
    assert memo["verified"] and memo["verified"] == memo["cpuinfo"], memo
    assert host_vec_isa(root) == memo  # read back, not re-probed
    b = AotiBackend({})
    b.prepare(root)
    assert b.vec_isa_ok is True
    memos[0].write_text(json.dumps({**memo, "verified": memo["verified"][1:]}))  # the compiler lacks one ISA
    b.prepare(root)
    assert b.vec_isa_ok is None
    memos[0].write_text(json.dumps(memo))


def test_pack_weights_option(monkeypatch, tmp_path):
    """Packing is for float32 on CPU: on by default (the fastest form per row count, measured: gemm.choose),
    off with pack_weights: false (then the graph keys are those of an unpacked build), or one named
    format; anything else, or a format this torch cannot make, is refused."""
    from eagle3_build.backends import aoti as aoti_mod
    from eagle3_build.backends.cpu import gemm, inductor_internals as inductor
    from eagle3_build.backends.aoti import AotiBackend
    from eagle3_build.errors import UserError
    from eagle3_runtime.packing import pack_available

    shapes, rows = [(64, 32), (32, 64)], [1, 4, 64]
    on, off = AotiBackend({}), AotiBackend({"pack_weights": False})
    rec = on.gemm_choice("float32", shapes, rows, tmp_path)  # (memoised: later calls measure only what they add)
    # 64 rows (a prefill chunk, beyond SMALL_ROWS): F.linear against oneDNN's copy only (one copy serves every
    # row count; MKL's would be one more per chunk size)
    assert set(rec["rows"]) == ({"1", "4", "64"} if pack_available("onednn") else {"1", "4"})
    assert all(v["choice"] in ("plain", "mkl_sgemm", "onednn", "blocked") and "plain" in v["ms"] for v in rec["rows"].values())
    if buildable("blocked"):  # Inductor's template, compiled here, measured at decode-sized row counts only
        assert all(("blocked" in v["ms"]) == (int(r) <= 32) for r, v in rec["rows"].items())
    if pack_available("onednn"):
        assert set(rec["rows"]["64"]["ms"]) == {"plain", "onednn"}
    assert on.gemm_choice("bfloat16", shapes, rows, None) is None and off.gemm_choice("float32", shapes, rows, None) is None
    assert "pack_weights" not in off.key_fields("target_decode") and on.key_fields("target_decode")["pack_weights"]
    if pack_available("onednn"):
        named = AotiBackend({"pack_weights": "onednn"}).gemm_choice("float32", shapes, rows, None)
        assert {v["choice"] for v in named["rows"].values()} == {"onednn"} and named["named"] == "onednn"
        assert set(named["rows"]) == {"1", "4", "64"}
    if pack_available("mkl_sgemm"):
        assert set(AotiBackend({"pack_weights": "mkl_sgemm"}).gemm_choice("float32", shapes, rows, None)["rows"]) == {"1", "4"}
    with pytest.raises(UserError, match="pack_weights"):
        AotiBackend({"pack_weights": "yes"})
    if buildable("blocked"):  # Inductor's template with a register blocking of this ISA named, or refused
        have = inductor.register_blockings()
        last = gemm.blocked_format("blocked", have[-1])
        named = AotiBackend({"pack_weights": last}).gemm_choice("float32", shapes, rows, None)
        assert {v["choice"] for v in named["rows"].values()} == {last} and set(named["rows"]) == {"1", "4"}
        with pytest.raises(UserError, match="pack_weights blocked:5x5: Inductor has no such float32 register "
                                            "blocking for cpu:") as e:
            AotiBackend({"pack_weights": "blocked:5x5"})
        assert last in str(e.value)
        with pytest.raises(UserError, match="must be true .* or blocked:BMxBN"):
            AotiBackend({"pack_weights": "blocked:8x"})
    # the draft's projections are measured apart; bfloat16 is a candidate only for a draft stored in it (auto)
    d_shapes = [(128, 32), (32, 96)]
    for stored_bf16 in (False, True):
        rec = on.gemm_choice("float32", shapes, rows, tmp_path, draft_shapes=d_shapes, draft_bf16=stored_bf16)
        assert all(BF16 not in v["ms"] for v in rec["rows"].values())  # never the target's
        assert set(rec["draft"]["rows"]) == set(rec["rows"])
        assert all((BF16 in v["ms"]) == (stored_bf16 and pack_available(BF16)) for v in rec["draft"]["rows"].values())
        # Inductor's template over a bfloat16 blocked copy: at decode-sized row counts, where it has the kernel
        assert all((BLOCKED_BF16 in v["ms"]) == (stored_bf16 and buildable(BLOCKED_BF16) and int(r) <= 32)
                   for r, v in rec["draft"]["rows"].items())
    never = AotiBackend({"draft_bfloat16": False}).gemm_choice("float32", shapes, rows, tmp_path, d_shapes, True)
    assert all(f not in v["ms"] for v in never["draft"]["rows"].values() for f in (BF16, BLOCKED_BF16))
    if on.bf16_formats():  # oneDNN's where it runs, else the template's
        always = AotiBackend({"draft_bfloat16": True}).gemm_choice("float32", shapes, rows, tmp_path, d_shapes, False)
        named = on.bf16_formats()[0]
        assert {v["choice"] for v in always["draft"]["rows"].values()} == {named} and always["draft"]["named"] == named
    with pytest.raises(UserError, match="draft_bfloat16 'yes': must be auto"):
        AotiBackend({"draft_bfloat16": "yes"})
    with pytest.raises(UserError, match="draft_bfloat16: true needs packed weights"):
        AotiBackend({"draft_bfloat16": True, "pack_weights": False})
    monkeypatch.setattr(aoti_mod, "pack_available", lambda fmt: False)
    with pytest.raises(UserError, match="pack_weights mkl_sgemm: this torch cannot make"):
        AotiBackend({"pack_weights": "mkl_sgemm"})


def test_gemm_choice_is_measured_once_per_host_and_keeps_the_earlier_form_within_the_margin(tmp_path, monkeypatch):
    from eagle3_build.backends.cpu import gemm

    assert gemm.pick_fastest({"plain": [10.0], "mkl_sgemm": [9.9], "onednn": [12.0]}) == "plain"  # within 3%: no flip
    assert gemm.pick_fastest({"plain": [10.0], "mkl_sgemm": [9.0], "onednn": [8.0]}) == "onednn"
    # a later form must win every round: a close call the rounds split goes to the earlier form
    assert gemm.pick_fastest({"onednn": [17.1, 16.8], "blocked": [16.5, 17.0]}) == "onednn"
    assert gemm.pick_fastest({"onednn": [21.0, 21.4], "blocked": [15.0, 15.2]}) == "blocked"
    assert gemm.pick_fastest({"plain": [10.0, 10.0], "mkl_sgemm": [9.0, 12.0], "onednn": [12.0, 8.0]}) == "mkl_sgemm"
    big = [(4096, 4096)] * 60 + [(100, 4096)]  # 4 GB of float32: cut to 1 GiB, every shape kept in proportion
    cut = gemm.fit_in_memory(big)
    assert sum(o * i * 4 for o, i in cut) <= gemm.MAX_BYTES and (100, 4096) in cut and cut.count((4096, 4096)) == 15
    formats = [f for f in ("mkl_sgemm", "onednn") if pack_available(f)]
    first = gemm.choose([(64, 32)] * 4, [1, 2, 99], formats, tmp_path)
    assert set(first["rows"]) == {"1", "2"} | ({"99"} if "onednn" in formats else set())
    assert list((tmp_path / "host").glob("gemm-*.json"))
    assert set(gemm.choose([(64, 32)], [1, 99], [f for f in formats if f == "mkl_sgemm"], None)["rows"]) == {"1"}
    monkeypatch.setattr(gemm, "time_formats", lambda *a, **k: pytest.fail("measured again"))
    assert gemm.choose([(64, 32)] * 4, [99, 2, 1], formats, tmp_path) == first
    measured = []  # a new row count (a new bucket) measures that row count only; the others keep their choice
    monkeypatch.setattr(gemm, "time_formats", lambda shapes, r, forms, **k: measured.append(r) or {f: [1.0] for f in forms})
    grown = gemm.choose([(64, 32)] * 4, [1, 2, 3, 99], formats, tmp_path)
    assert measured == [3] and {r: grown["rows"][r] for r in first["rows"]} == first["rows"]
    assert gemm.choose([(64, 32)] * 4, [3], formats, tmp_path)["rows"] == {"3": grown["rows"]["3"]}
    assert gemm.format_per_rows({"rows": {"1": {"choice": "plain"}, "8": {"choice": "onednn"}}}) == {8: "onednn"}
    # Inductor's template at a row count its register blocking takes in two passes: the one-pass blocking too,
    # after it in the order (within the margin the earlier wins); one that has no such blocking measures none
    monkeypatch.setattr(gemm.inductor, "one_pass_blocking", lambda rows: (8, 8) if rows <= 8 else None)
    monkeypatch.setattr(gemm.inductor, "blocking", lambda rows, n, k, threads, dtype=None: (4, 24))
    assert gemm.blocked_variants([(64, 32)], 8) == ["blocked:8x8"] and gemm.blocked_variants([(64, 32)], 9) == []
    measured = []
    monkeypatch.setattr(gemm, "compile_candidates", lambda *a: {})  # (their timing is stood in for too)
    monkeypatch.setattr(gemm, "time_formats", lambda shapes, r, forms, **k: measured.append(forms) or
                        {f: [2.0 if f == "blocked:8x8" else 3.0] for f in forms})
    rec = gemm.choose([(64, 32)], [8], ["blocked"], None)
    assert measured == [["plain", "blocked", "blocked:8x8"]] and rec["rows"]["8"]["choice"] == "blocked:8x8"
    assert gemm.format_per_rows(rec) == {8: "blocked:8x8"} and gemm.format_parts("blocked:8x8") == ("blocked", (8, 8))
    assert gemm.format_parts("onednn") == ("onednn", None)
    # a bfloat16 draft's: each blocked format with its own one-pass blocking, in CANDIDATES order
    measured = []
    rec = gemm.choose([(64, 32)], [8], ["blocked", "blocked_bf16"], None)
    assert measured == [["plain", "blocked", "blocked_bf16", "blocked:8x8", "blocked_bf16:8x8"]]
    assert rec["rows"]["8"]["choice"] == "blocked:8x8"
    assert gemm.format_parts("blocked_bf16:8x8") == ("blocked_bf16", (8, 8))
    fast = {"plain": [3.0], "blocked": [2.0], "blocked_bf16": [1.2], "blocked_bf16:8x8": [1.1]}
    assert gemm.pick_fastest(fast) == "blocked_bf16:8x8"
    assert gemm.pick_fastest({"plain": [3.0], "blocked": [2.0], "blocked:8x8": [1.97]}) == "blocked"
    assert gemm.pick_fastest({"blocked:8x8": [1.5], "plain": [3.0], "blocked": [2.0]}) == "blocked:8x8"
    monkeypatch.setattr(gemm.inductor, "blocking",
                        lambda rows, n, k, threads, dtype=None: (8, 8) if n == 64 else (4, 16))
    assert gemm.blocked_variants([(64, 32)], 8) == []  # (Inductor's own choice already covers the rows)
    assert gemm.blocked_variants([(64, 32), (48, 32)], 4) == []  # (... and covers them in one pass, if another way)
    assert gemm.blocked_variants([(64, 32), (48, 32)], 8) == ["blocked:8x8"]
    monkeypatch.undo()  # Inductor's template failing to compile on a host: that form is left out, the rest measured
    monkeypatch.setattr(gemm, "blocked_pass", lambda *a: (_ for _ in ()).throw(RuntimeError("no compiler")))
    assert set(gemm.time_formats([(64, 32)], 2, ["plain", "blocked"], repeats=1)) == {"plain"}


def test_blocked_gemm_candidates_compile_on_worker_processes(tmp_path, monkeypatch):
    """The blocked candidates of a GEMM measurement compile on worker processes, two at a time here (their gcc is
    most of a build's measurement): each package times as the one compiled in this process does, a candidate
    Inductor cannot compile comes back as why (left out of the timing with a warning naming it), a worker that
    dies answers for the jobs it held, and one idle core compiles nothing ahead (time_formats compiles in
    process)."""
    from eagle3_build.backends.cpu import gemm
    from eagle3_build.backends.cpu import inductor_internals as inductor

    if not inductor.blocked_available():
        pytest.skip("Inductor has no vectorised float32 micro-kernel here")
    monkeypatch.setattr(gemm, "host_cores", lambda: 2)
    monkeypatch.setattr(gemm, "busy_cores", lambda seconds: 0.1)
    shapes = [(96, 64), (96, 64), (48, 64)]
    missing = next(n for n in (3, 5, 7) if n not in {b[0] for b in inductor.register_blockings()})
    jobs = [(1, "blocked"), (4, "blocked"), (4, f"blocked:{missing}x8")]
    notes = []
    got = gemm.compile_candidates(shapes, jobs, tmp_path, notes.append)
    assert set(got) == set(jobs) and all(isinstance(got[j], Path) and got[j].is_file() for j in jobs[:2])
    assert isinstance(got[jobs[2]], str) and "register blocking" in got[jobs[2]]
    assert notes[0] == "GEMM formats: compiling 3 blocked candidates on 2 processes" and "3/3" in notes[-1]
    weights = [torch.randn(o, i) for o, i in shapes]
    xs = {64: torch.randn(4, 64)}
    run = gemm.blocked_pass(weights, 4, xs, "blocked", got[(4, "blocked")])
    for y, w in zip(run(), weights):
        torch.testing.assert_close(y, xs[64] @ w.T, rtol=1e-5, atol=1e-4)
    compiled = {c: got[(4, c)] for c in ("blocked", f"blocked:{missing}x8")}
    with pytest.warns(RuntimeWarning, match=f"blocked:{missing}x8 left out"):
        ms = gemm.time_formats(shapes, 4, ["plain", "blocked", f"blocked:{missing}x8"], repeats=3, weights=weights,
                               compiled=compiled)
    assert set(ms) == {"plain", "blocked"} and ms["blocked"][0] > 0
    monkeypatch.setattr(gemm.sys, "executable", "/bin/false")  # (a worker that exits at once)
    dead = gemm.compile_candidates(shapes, jobs[:2], tmp_path)
    assert set(dead) == set(jobs[:2]) and all("worker exited" in v for v in dead.values())
    monkeypatch.setattr(gemm, "host_cores", lambda: 1)
    assert gemm.compile_candidates(shapes, jobs, tmp_path) == {}
    monkeypatch.setattr(gemm, "host_cores", lambda: 2)  # (two cores, one of them busy elsewhere: the same)
    monkeypatch.setattr(gemm, "busy_cores", lambda seconds: 0.9)
    assert gemm.compile_candidates(shapes, jobs, tmp_path) == {}


def test_a_round_of_gemm_timing_ends_when_its_ranking_is_clear(monkeypatch):
    from eagle3_build.backends.cpu import gemm

    assert gemm.ranking_clear({"plain": [14.3, 14.1, 14.5], "blocked": [8.1, 8.3, 8.2]})
    assert not gemm.ranking_clear({"onednn": [9.0, 9.1, 9.0], "blocked": [8.1, 8.3, 8.6]})  # (within CLEAR)
    assert not gemm.ranking_clear({"plain": [14.3, 7.9, 14.5], "blocked": [8.1, 8.3, 8.2]})  # (one pass overlaps)
    assert gemm.ranking_clear({"plain": [1.0]})
    for clear, asked in ((True, 2), (False, 2 * (40 - gemm.MIN_PASSES + 1))):  # (per round: once, or every pass)
        checks = []
        monkeypatch.setattr(gemm, "ranking_clear", lambda ms, c=clear: checks.append(len(ms["plain"])) or c)
        ms = gemm.time_formats([(512, 256)] * 4, 1, ["plain", gemm.F_LINEAR], repeats=40, rounds=2)
        assert set(ms) == {"plain", gemm.F_LINEAR} and all(len(v) == 2 for v in ms.values())
        assert len(checks) == asked and checks[0] == gemm.MIN_PASSES and max(checks) == (3 if clear else 40)


@pytest.mark.skipif(not pack_available("onednn"), reason="this torch has no oneDNN packing")
def test_a_new_prefill_bucket_rekeys_its_own_graphs_only(world, tmp_path):
    """A graph's key names the GEMM choice of the row counts its projections use (graph_rows), not of every
    row count of the plan: a bucket added to the recipe compiles that bucket's graphs, no other."""
    from eagle3_build.backends.aoti import AotiBackend
    from eagle3_build.compile.cache import CompileCache
    from eagle3_build.pair import build_models, load_pair
    from eagle3_build.recipe import load_recipe

    (pair,) = load_recipe(world["tiny"].pair()).pairs
    opts = {"pack_weights": "onednn"}
    keys = {}
    for prefill in ([16, 64], [16, 48, 64]):
        p = pair.model_copy(update={"backend": "aoti", "backend_options": opts,
                                    "buckets": pair.buckets.model_copy(update={"prefill": prefill})})
        keys[len(prefill)] = AotiBackend.plan_keys(build_models(load_pair(p)), AotiBackend(opts),
                                                   CompileCache(tmp_path / "cache"))
    new = set(keys[3]) - set(keys[2])
    assert new and all("48" in g for g in new)
    assert {g: keys[3][g] for g in keys[2]} == keys[2]
