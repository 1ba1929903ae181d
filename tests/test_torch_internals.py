"""Every reach into torch's private internals sits in one module per side, behind a probe: on a torch release
the project does not test (simulated with EAGLE3_TORCH_TESTED naming another), each hook is off with one
warning naming it and the version, the build still works on the public path and records what it used."""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]
PRIVATE = re.compile(r"torch\._inductor|torch\._C|_micro_gemm|mkldnn_ir")
UNTESTED = {"EAGLE3_TORCH_TESTED": "0.0.1"}


def test_torch_privates_live_in_one_module_per_side():
    hits = {}
    for pkg in ("eagle3_build", "eagle3_runtime"):
        hits[pkg] = sorted({str(p.relative_to(ROOT)) for p in (ROOT / pkg).rglob("*.py") if PRIVATE.search(p.read_text())})
    assert hits == {"eagle3_build": ["eagle3_build/backends/cpu/inductor_internals.py"],
                    "eagle3_runtime": ["eagle3_runtime/torch_internals.py"]}, hits


def test_an_untested_torch_turns_every_hook_off_loudly(monkeypatch):
    from eagle3_build.backends.cpu import inductor_internals as builder
    from eagle3_runtime import torch_internals as runtime

    monkeypatch.setenv("EAGLE3_TORCH_TESTED", UNTESTED["EAGLE3_TORCH_TESTED"])
    runtime.HOOKS.forget()
    builder.tuned_kernel.cache_clear()
    try:
        for side, hooks in (("builder", builder.HOOKS), ("runtime", runtime.HOOKS)):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                report = hooks.report()
                hooks.report()  # (once per process: no second warning)
            release = runtime.torch_release()
            assert report["hooks"] and all(v.startswith(f"off: torch {release} is not a release this hook is "
                                                        "tested on (0.0.1") for v in report["hooks"].values()), report
            said = [str(w.message) for w in caught if issubclass(w.category, runtime.TorchInternalsWarning)]
            assert sorted(said) == sorted(f"{side} hook {n!r} off: {report['hooks'][n][5:]}; {hooks.hooks[n].fallback}"
                                          for n in report["hooks"]), said
        # the public path: no packed form Inductor lowers for us, Inductor's own micro-kernel, and the public loader
        assert builder.register_blockings() == [] and builder.tuned_kernel() is None
        assert not builder.extern_lowering_available() and not builder.blocked_available()
        assert not runtime.mkl_available() and not runtime.onednn_reorder_available()
    finally:
        monkeypatch.undo()
        runtime.HOOKS.forget()
        builder.tuned_kernel.cache_clear()
    assert builder.HOOKS.on("blocked_format") == (runtime.torch_release() in builder.TESTED)


def test_a_failed_probe_turns_its_hook_off_and_names_why(monkeypatch):
    from eagle3_runtime import torch_internals as runtime

    monkeypatch.setenv("EAGLE3_TORCH_TESTED", runtime.torch_release())
    monkeypatch.delattr(torch._C._aoti.AOTIModelPackageLoader, "boxed_run", raising=False)
    runtime.HOOKS.forget()
    try:
        with pytest.warns(runtime.TorchInternalsWarning, match=r"runtime hook 'aoti_package_loader' off: its probe "
                          r"failed on torch .*AOTIModelPackageLoader has no boxed_run; aoti graphs load through"):
            assert not runtime.HOOKS.on("aoti_package_loader")
    finally:
        monkeypatch.undo()
        runtime.HOOKS.forget()


def test_a_build_on_an_untested_torch_works_on_the_public_path(tiny, tmp_path):
    """An aoti build with every hook off: warned once per hook per process, graphs without packed weights
    (plain projections: F.linear / weight-stationary), Inductor's kernels as shipped; the build record says
    which hooks were off; the bundle decodes like transformers, served with the runtime's hooks off too."""
    recipe = tiny.recipe(k=1, backend="aoti", recipe={"buckets": {"prefill": [64]}})
    out = tmp_path / "bundle"
    r = run_cli("eagle3-build", "compile", str(recipe), "--out", str(out), "--no-verify",
                env={**UNTESTED, "EAGLE3_BUILD_CACHE": str(tmp_path / "cache")}, timeout=1500)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    for hook in ("blocked_format", "packed_extern_lowering", "micro_kernel_edit", "lean_wrapper"):
        assert re.search(rf"builder hook '{hook}' off: torch \S+ is not a release", r.stderr), r.stderr[-3000:]
    m = json.loads((out / "manifest.json").read_text())
    assert all(not g["packed"] for g in m["graphs"])
    gemm = m["build"]["gemm"]
    assert set(gemm["formats"]) == {"plain"} and all(v.startswith("off: ") for v in gemm["torch_hooks"].values())
    assert set(m["toolchain"]["aoti_torch_hooks_off"].split(", ")) == set(gemm["torch_hooks"])
    got = run_cli("eagle3-run", str(out), "--prompt", "Once upon a time", "--max-tokens", "24", "--json",
                  env=UNTESTED)
    assert got.returncode == 0, got.stderr[-3000:]
    assert "runtime hook 'aoti_package_loader' off" in got.stderr
    res = json.loads(got.stdout.strip().splitlines()[-1])
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny.pair().parent / "target", dtype=torch.float32)
    ids = res["prompt_token_ids"]
    want = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    assert res["token_ids"] == want
