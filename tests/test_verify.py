"""eagle3-build verify: the intact tiny pair passes; each fault that silently collapses acceptance while
the output stays lossless (d2t misread, lm_head replaced, fc zeroed, aux layer ids shifted,
norm_before_residual flipped) makes it fail with the matching hint; a lossless break is located.

The pair is ``make_tiny_pair(..., sensitive_draft=True)``: a structured (non-random) draft that, like a
trained one, works only with its own aux layer ids and norm_before_residual. Each fault is injected
into the draft *checkpoint*, which is then compiled and verified as a user would. Builds share the
session's compile cache, so a fault that changes only weights recompiles nothing.
"""
import io
import json
import shutil
import time
import types
from pathlib import Path

import pytest
import torch
from conftest import cli_inproc, run_cli
from safetensors.torch import load_file, save_file

GATE = 1.15  # intact: 1.34 on the first 8 built-in prompts (deterministic); faults: 1.00-1.05
RECIPE = """\
pairs:
  - name: {name}
    target: {target}
    draft: {draft}
    dtype: float32
    speculation: {{num_speculative_tokens: 3}}
    serving: {{max_num_seqs: 1, max_model_len: 256}}
    buckets: {{prefill: [64], batch: [1]}}
    backend: export
    verify: {{min_acceptance_length: {gate}, num_prompts: {n}, max_tokens: 32}}
"""


# ------------------------------------------------------------------------------------------ faults

def _d2t_missing(sd, cfg):
    del sd["d2t"], sd["t2d"]


def _d2t_identity(sd, cfg):  # "misread": offsets lost, t2d dropped so the pair check cannot object
    sd["d2t"] = torch.zeros_like(sd["d2t"])
    del sd["t2d"]


def _lm_head_random(sd, cfg):
    w = sd["lm_head.weight"]
    sd["lm_head.weight"] = torch.randn(w.shape, generator=torch.Generator().manual_seed(7)) * w.std()


def _lm_head_target(sd, cfg, target_dir):  # vLLM#27732: the draft's lm_head overwritten by the target's
    t = load_file(target_dir / "model.safetensors")["lm_head.weight"]
    sd["lm_head.weight"] = t[torch.arange(sd["d2t"].numel()) + sd["d2t"]].clone()


def _fc_zero(sd, cfg):
    sd["fc.weight"] = torch.zeros_like(sd["fc.weight"])


def _aux_shift(sd, cfg):  # the default ids (2, 4, 5), written one layer later
    cfg["eagle_aux_hidden_state_layer_ids"] = [3, 5, 6]


def _nbr_flip(sd, cfg):
    cfg["norm_before_residual"] = False


FAULTS = {"intact": None, "d2t_missing": _d2t_missing, "d2t_identity": _d2t_identity,
          "lm_head_random": _lm_head_random, "lm_head_target": _lm_head_target, "fc_zero": _fc_zero,
          "aux_shift": _aux_shift, "nbr_flip": _nbr_flip}


class Pairs:
    """One sensitive tiny pair; a bundle per fault, built (and verified) at most once per module."""

    def __init__(self, root):
        from eagle3_build.testing.tiny import make_tiny_pair

        self.root = root
        make_tiny_pair(root / "pair", sensitive_draft=True)
        self.target = root / "pair" / "target"
        self.bundles, self.reports = {}, {}

    def write(self, fault: str, num_prompts: int | None = None):
        d = self.root / (fault if num_prompts is None else f"{fault}-{num_prompts}")
        draft = d / "draft"
        shutil.rmtree(draft, ignore_errors=True)  # (re)written from the intact draft
        shutil.copytree(self.root / "pair" / "draft", draft)
        fn = FAULTS[fault]
        if fn is not None:
            sd = load_file(draft / "model.safetensors")
            cfg = json.loads((draft / "config.json").read_text())
            fn(sd, cfg, self.target) if fault == "lm_head_target" else fn(sd, cfg)
            save_file(sd, str(draft / "model.safetensors"), metadata={"format": "pt"})
            (draft / "config.json").write_text(json.dumps(cfg, indent=2))
        recipe = d / "recipe.yaml"
        # a broken draft fails the gate on the recipe default of 4 prompts; the intact one is checked on 8
        recipe.write_text(RECIPE.format(name=f"tiny-{fault}", target=self.target, draft=draft, gate=GATE,
                                        n=num_prompts or (8 if fault == "intact" else 4)))
        return recipe

    def bundle(self, fault: str):
        if fault not in self.bundles:
            from eagle3_build.build import build_bundle
            from eagle3_build.recipe import load_recipe

            recipe = self.write(fault)
            out = self.root / fault / "bundle"
            t0 = time.perf_counter()
            build_bundle(load_recipe(recipe).pairs[0], out)
            print(f"\n{fault}: built in {time.perf_counter() - t0:.1f}s")
            self.bundles[fault] = out
        return self.bundles[fault]

    def report(self, fault: str):
        if fault not in self.reports:
            from eagle3_build.verify import verify_bundle

            self.reports[fault] = verify_bundle(self.bundle(fault))
            print(f"\n{fault}: {self.reports[fault].format()}")
        return self.reports[fault]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return Pairs(tmp_path_factory.mktemp("verify"))


# ------------------------------------------------------------------------------------------- tests

def test_intact_pair_passes(pairs):
    r = pairs.report("intact")
    assert r.passed, r.format()
    assert r.lossless_ok and all(p.exact for p in r.prompts) and len(r.prompts) == 8
    assert r.tokens_compared == sum(len(p.reference_ids) for p in r.prompts) > 100
    acc = r.acceptance
    assert acc.mean_acceptance_length >= GATE + 0.1  # clear of the gate, not just over it
    assert len(acc.per_position) == 3 and acc.per_position[0] > 0.3
    assert r.min_acceptance_length == GATE and r.reference_dtype == "float32"
    assert "target" in r.reference and not r.failures()
    # the acceptance profile went into the manifest's build record (outside the digest: the bundle still reads)
    from eagle3_runtime.reader import read_manifest

    m = read_manifest(pairs.bundle("intact"))
    (shape, rec), = m.build["acceptance"].items()
    assert shape == m.speculation[1].describe() and rec["rounds"] == acc.num_drafts and rec["prompts"] == 8
    assert rec["reach"] == [round(x, 4) for x in acc.per_position]


def test_missing_d2t_is_refused_at_compile(pairs):
    """A reduced draft vocab without d2t never reaches verify: the pair check refuses it."""
    from eagle3_build.errors import PairError

    with pytest.raises(PairError, match="no d2t map"):
        pairs.bundle("d2t_missing")


@pytest.mark.parametrize("fault,cause,words", [
    ("d2t_identity", "d2t", "d2t is all zeros"),
    ("lm_head_random", "lm_head", "lm_head replaced"),
    ("fc_zero", "fc", "fc weight is all zero"),
    ("aux_shift", "aux_ids", "with ids [2, 4, 5]"),
    pytest.param("lm_head_target", "lm_head", "replaced by the target's", marks=pytest.mark.slow),
    pytest.param("nbr_flip", "norm_before_residual", "norm_before_residual=True", marks=pytest.mark.slow),
])
def test_fault_fails_with_matching_hint(pairs, fault, cause, words):
    from eagle3_build.verify import CAUSES

    r = pairs.report(fault)
    assert not r.passed and not r.gate_ok
    assert r.lossless_ok, "a broken draft costs speed, never correctness"
    assert r.acceptance.mean_acceptance_length < GATE
    assert [d.cause for d in r.diagnoses] == [cause], [d.message for d in r.diagnoses]
    text = "\n".join(r.failures())
    assert f"< min_acceptance_length {GATE}" in text
    assert "likely cause: " in text and words in text
    assert all(c in text for c in CAUSES.values())  # the usual causes are always listed


def _rewrite_target_weights(bundle, fn):
    """Change the bundle's target weights and re-seal the manifest (sha256, size, digest), as a build
    that converted a weight wrongly would have written it."""
    from eagle3_runtime.manifest import MANIFEST, Manifest, sha256_file

    path = bundle / "weights" / "target" / "rank0.safetensors"
    sd = load_file(path)
    fn(sd)
    save_file(sd, str(path), metadata={"format": "pt"})
    m = Manifest.model_validate_json((bundle / MANIFEST).read_text())
    for f in m.models["target"].weight_files:
        if f.path == "weights/target/rank0.safetensors":
            f.sha256, f.size = sha256_file(path), path.stat().st_size
    if hasattr(m, "compute_digest") and getattr(m, "digest", ""):
        m.digest = m.compute_digest()
    (bundle / MANIFEST).write_text(m.model_dump_json(indent=2))


def test_lossless_mismatch_is_located(pairs, tmp_path):
    from eagle3_build.verify import verify_bundle

    b = tmp_path / "bundle"
    shutil.copytree(pairs.bundle("intact"), b)

    def perturb(sd):
        w = sd["lm_head.weight"]
        sd["lm_head.weight"] = w + 0.3 * torch.randn(w.shape, generator=torch.Generator().manual_seed(1))

    _rewrite_target_weights(b, perturb)
    r = verify_bundle(b, num_prompts=4, max_tokens=24, min_acceptance_length=1.0)
    assert not r.lossless_ok and not r.passed
    bad = [p for p in r.prompts if not p.ok]
    assert bad
    for p in bad:
        i = p.first_mismatch
        assert p.reference_ids[:i] == p.bundle_ids[:i] and p.reference_token != p.bundle_token
        assert p.position == len(p.prompt_ids) + i
        assert p.gap > p.tolerance and p.top2_margin <= p.gap and not p.near_tie
        assert p.plain_matches_reference is False  # the target itself differs, not the speculative loop
    text = "\n".join(r.failures())
    assert f"at generated token {bad[0].first_mismatch} (position {bad[0].position})" in text
    assert "top-2 margin" in text and "target graphs or weights" in text


def test_near_tie_tolerance():
    """A flip between two logits closer than the dtype's tolerance passes; a clear one does not."""
    from eagle3_build.verify import VerifyReport, near_tie_tolerance
    from eagle3_build.verify.compare import check_continuation, compare
    from eagle3_build.verify.reference import Reference
    from eagle3_runtime.engine import SpecStats

    logits = torch.zeros(3, 8)
    logits[:, 1] = 10.0
    logits[1, 5] = 10.0 - 5e-4  # a float32 near-tie at step 1 (tolerance 1e-4 * 10 = 1e-3)
    ref = Reference([1, 1, 1], logits)
    tie = compare("p", [0], ref, [1, 5, 2], "float32")
    assert tie.first_mismatch == 1 and tie.near_tie and tie.ok and tie.position == 2
    assert tie.top2_margin == pytest.approx(5e-4, rel=1e-3) and tie.tolerance == pytest.approx(1e-3)
    clear = compare("p", [0], ref, [1, 1, 4], "float32")
    assert clear.first_mismatch == 2 and not clear.ok and clear.gap == pytest.approx(10.0)
    short = compare("p", [0], ref, [1, 1], "float32")  # stopped early: a real mismatch
    assert short.first_mismatch == 2 and not short.ok and short.gap is None
    assert near_tie_tolerance("bfloat16", -20.0) == pytest.approx(1.0)
    assert near_tie_tolerance("float32", 0.1) == pytest.approx(1e-4)
    # past a near-tie the bundle's own continuation is checked with the reference teacher-forced
    class Teacher:  # a stand-in reference model for prompt [0] + generated [1, 5, x]
        def __init__(self, rows):
            self.rows = rows

        def __call__(self, ids):
            return types.SimpleNamespace(logits=torch.cat([self.rows, torch.zeros(1, 8)])[None])  # row k -> token k+1

    rows = torch.zeros(3, 8)
    rows[:, 1] = 10.0
    rows[2, 3] = 10.0 - 5e-4  # token 3 is a near-tie at step 2 too
    tie3 = compare("p", [0], ref, [1, 5, 3], "float32")
    check_continuation(Teacher(rows), tie3, "float32")
    assert tie3.ok and tie3.near_tie_flips == 2 and tie3.compared == 3 and tie3.later_mismatch is None
    tie4 = compare("p", [0], ref, [1, 5, 4], "float32")
    check_continuation(Teacher(rows), tie4, "float32")
    assert not tie4.ok and tie4.later_mismatch == 2 and tie4.later_gap == pytest.approx(10.0) and tie4.compared == 2
    # more than half the prompts parting at near-ties is systematic when both sides run float32
    report = VerifyReport(bundle="b", reference="r", dtype="float32", reference_dtype="float32",
                          num_speculative_tokens=3, max_tokens=3, min_acceptance_length=None,
                          prompts=[tie, tie, tie, compare("p", [0], ref, [1, 1, 1], "float32")],
                          acceptance=SpecStats(3))
    assert not report.lossless_ok and "near-ties" in report.failures()[0]
    report.prompts.append(short)
    assert "the reference generated 3 tokens, the bundle 2" in report.failures()[0]
    report.prompts[-1] = tie4
    assert "past it the bundle picks, at generated token 2" in report.failures()[0]
    json.dumps(report.to_dict(), allow_nan=False)
    report.prompts.pop()
    report.dtype = report.reference_dtype = "bfloat16"  # bf16 logits tie at one ulp often: no count
    assert report.lossless_ok and report.passed


def test_cli_verify(pairs, monkeypatch):
    """The command maps its options onto verify_bundle, prints the block and exits 0 / 1 (the reports are
    the ones verified above; the real entry point runs in test_cli_bad_input)."""
    from typer.testing import CliRunner

    from eagle3_build import verify
    from eagle3_build.cli import app

    calls = []

    def fake(bundle, **kw):
        calls.append(kw)
        return pairs.report("fc_zero" if "fc_zero" in str(bundle) else "intact")

    pairs.report("intact"), pairs.report("fc_zero")  # real reports first: `fake` hands them back
    monkeypatch.setattr(verify, "verify_bundle", fake)
    runner = CliRunner()
    ok = runner.invoke(app, ["verify", str(pairs.bundle("intact")), "--num-prompts", "2", "--max-tokens", "16",
                             "--min-acceptance-length", "1.1", "--prompts", "p.txt", "--reference-dtype", "float32"])
    assert ok.exit_code == 0, ok.output
    assert calls[-1] | {"progress": None} == {
        "prompts": Path("p.txt"), "num_prompts": 2, "max_tokens": 16, "min_acceptance_length": 1.1,
        "target_source": None, "reference_dtype": "float32", "chat": None, "stamp_draft": False,
        "progress": None}  # None: verify.chat
    for s in ("Mean acceptance length", "Per-position acceptance rate", "position 0", "identical", "gate",
              "PASSED"):
        assert s in ok.output, ok.output
    bad = runner.invoke(app, ["verify", str(pairs.bundle("fc_zero")), "--json"])
    assert bad.exit_code == 1, bad.output
    res = json.loads(bad.stdout)
    assert res["passed"] is False and res["lossless_ok"] is True and res["gate_ok"] is False
    assert res["diagnoses"][0]["cause"] == "fc" and res["min_acceptance_length"] == GATE
    assert set(res["spec_decoding"]) >= {"mean_acceptance_length", "per_position_acceptance_rate", "acceptance_rate"}
    assert any("likely cause" in f for f in res["failures"])
    text = runner.invoke(app, ["verify", str(pairs.bundle("fc_zero"))])
    assert text.exit_code == 1 and "likely cause" in text.output and "FAILED" in text.output


def test_cli_bad_input(tmp_path):
    r = cli_inproc("eagle3-build", "verify", str(tmp_path / "nope"))
    assert r.returncode == 2 and "no such bundle directory" in r.stderr and "Traceback" not in r.stderr


def redigest(raw: dict) -> dict:
    """A manifest edited as data gets its digest recomputed (the runtime always checks it)."""
    from eagle3_runtime.manifest import Manifest

    return dict(raw, digest=Manifest.model_validate(dict(raw, digest="")).compute_digest())


def test_bad_input_is_refused(pairs, tmp_path):
    """Bad prompts, a corrupt bundle, a missing target: one VerifyError each (exit 2 in the CLI), before
    any slow work where possible."""
    from eagle3_build.verify import VerifyError, load_prompts, verify_bundle

    empty = tmp_path / "p.txt"
    empty.write_text("\n  \n")
    with pytest.raises(VerifyError, match="no prompts"):
        load_prompts(empty)
    bad = tmp_path / "p.json"
    bad.write_text('{"a": 1}')
    with pytest.raises(VerifyError, match="list of strings"):
        load_prompts(bad)
    good = tmp_path / "p.jsonl"
    good.write_text('"one"\n{"prompt": "two\\nlines"}\n')
    assert load_prompts(good) == ["one", "two\nlines"]
    with pytest.raises(VerifyError, match="hold only 2"):
        verify_bundle(pairs.bundle("intact"), prompts=good, num_prompts=3)
    long = tmp_path / "long.txt"
    long.write_text("word " * 300 + "\n")  # (past max_model_len: a prompt past the largest bucket is continued)
    with pytest.raises(VerifyError, match="tokens; this bundle takes 1 to 255"):
        verify_bundle(pairs.bundle("intact"), prompts=long, num_prompts=1)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(pairs.bundle("intact"), corrupt)
    w = corrupt / "weights" / "draft" / "rank0.safetensors"
    data = bytearray(w.read_bytes())
    data[len(data) // 2] ^= 1
    w.write_bytes(bytes(data))
    with pytest.raises(VerifyError, match="weights/draft/rank0.safetensors is corrupt"):
        verify_bundle(corrupt)
    moved = tmp_path / "moved"  # a bundle whose recorded target is not on this machine
    shutil.copytree(pairs.bundle("intact"), moved, ignore=shutil.ignore_patterns("*.safetensors", "*.pt2"))
    m = json.loads((moved / "manifest.json").read_text())
    m["recipe"]["target"]["path"] = str(tmp_path / "elsewhere")
    (moved / "manifest.json").write_text(json.dumps(redigest(m)))
    with pytest.raises(VerifyError, match="not on this machine; pass --target PATH"):
        verify_bundle(moved)
    with pytest.raises(VerifyError, match="--target .*: not a checkpoint directory"):
        verify_bundle(moved, target_source=tmp_path)


def test_run_verify_skips_what_it_cannot_run(pairs, tmp_path):
    """compile's hook: TP bundles and verify.num_prompts 0 are skipped (True), with a note."""
    from rich.console import Console

    from eagle3_build.verify import run_verify
    from eagle3_runtime.manifest import MANIFEST

    b = tmp_path / "b"
    b.mkdir()
    m = json.loads((pairs.bundle("intact") / MANIFEST).read_text())
    tp2_models = {k: dict(v, weight_files=v["weight_files"] * 2) for k, v in m["models"].items()}
    for update, words in (({"tp_degree": 2, "models": tp2_models}, "TP 2"),
                          ({"recipe": dict(m["recipe"], verify={"num_prompts": 0})}, "num_prompts is 0")):
        (b / MANIFEST).write_text(json.dumps(redigest(dict(m, **update))))
        buf = io.StringIO()
        assert run_verify(b, Console(file=buf, width=200)) is True
        assert "skipped" in buf.getvalue() and words in buf.getvalue()


def test_compile_runs_verify_unless_told_not_to(pairs, tmp_path):
    """`compile` verifies what it built: the intact pair exits 0 with the acceptance block, a broken
    draft exits 1 (the bundle is written, flagged as not to be deployed); --no-verify skips it."""
    # (test_intact_pair_passes verifies it on 8 prompts; here the hook on 2, in the real process)
    ok = run_cli("eagle3-build", "compile", str(pairs.write("intact", num_prompts=2)), "--out", str(tmp_path / "ok"))
    assert ok.returncode == 0, ok.stderr[-3000:]
    text = " ".join(ok.stderr.split())
    assert "acceptance" in text.lower() and "verify failed" not in text
    bad = pairs.write("fc_zero")
    r = cli_inproc("eagle3-build", "compile", str(bad), "--out", str(tmp_path / "bad"), "--json")
    assert r.returncode == 1
    events = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert {"event": "verify", "pair": "tiny-fc_zero", "bundle": str(tmp_path / "bad"), "passed": False} in events
    assert "verify failed" in r.stderr and "fc" in r.stderr
    r = cli_inproc("eagle3-build", "compile", str(bad), "--out", str(tmp_path / "bad"), "--no-verify")
    assert r.returncode == 0


def test_drift_names_the_changed_layer_and_the_acceptance_drop(pairs, tmp_path):
    """A draft stamped with its target (`verify --stamp-draft`); a bundle of the same draft on a target with one
    layer perturbed (a fine-tune) is reported with that layer and the acceptance drop; the same target is not."""
    from eagle3_build.build import build_bundle
    from eagle3_build.recipe import load_recipe
    from eagle3_build.verify import verify_bundle
    from eagle3_build.verify.drift import STAMP

    intact = pairs.bundle("intact")
    draft = pairs.root / "intact" / "draft"
    stamped = verify_bundle(intact, stamp_draft=True)
    assert stamped.passed and stamped.drift.startswith("drift: stamped")
    rec = json.loads((draft / "config.json").read_text())[STAMP]
    assert "layers.1" in rec["fingerprint"] and rec["settings"] == {"prompts": 8, "max_tokens": 32, "chat": False}
    (tag, was), = rec["acceptance"].items()
    assert was == pytest.approx(stamped.acceptance.mean_acceptance_length, abs=1e-4)

    same = verify_bundle(intact)
    assert same.drift.startswith("drift: none") and "(chain3, +0%)" in same.drift, same.drift
    assert same.drift in same.format() and same.to_dict()["drift"] == same.drift

    tuned = tmp_path / "tuned-target"
    shutil.copytree(pairs.target, tuned)
    sd = load_file(tuned / "model.safetensors")
    (key,) = [k for k in sd if k.endswith("layers.1.mlp.down_proj.weight")]
    sd[key] = sd[key] + 2 * sd[key].std() * torch.randn(sd[key].shape, generator=torch.Generator().manual_seed(3))
    save_file(sd, str(tuned / "model.safetensors"), metadata={"format": "pt"})
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.format(name="tiny-tuned", target=tuned, draft=draft, gate=GATE, n=8))
    build_bundle(load_recipe(recipe).pairs[0], tmp_path / "bundle")
    r = verify_bundle(tmp_path / "bundle")
    assert r.drift.startswith("drift: DIFFERENT target: 1 of ") and "(layers.1)" in r.drift, r.drift
    now = r.acceptance.mean_acceptance_length
    assert now < was and f"acceptance length {now:.2f} vs {was:.2f}" in r.drift, r.drift
