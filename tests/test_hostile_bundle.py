"""Bundles as an attacker would hand them over: pickled graph constants, operators that are not operators,
paths leaving the bundle, manifests that are valid JSON but nonsense, missing digests, pins and signatures.

Every attack edits the files *and* recomputes the manifest's sha256s and digest (as anyone can), so
self-consistency proves nothing and only the checks under test stand in the way."""
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest
from conftest import cli_inproc as run_cli  # error paths: main() in-process (real processes: test_spine, test_pipeline)
from test_server import ServerProc

from eagle3_runtime.bundle import Bundle, BundleError
from eagle3_runtime.compat import check_bundle
from eagle3_runtime.graph_contract import kv_cache_length
from eagle3_runtime.manifest import sha256_file
from eagle3_runtime.safe_pt2 import UnsafeArchive, check_archive


@pytest.fixture(scope="module")
def good(built_bundle) -> Path:
    return built_bundle().path  # the session's tiny pair (speculators, K 3); tests break copies of it


def digest_of(raw: dict) -> str:
    """The manifest digest computed from raw JSON, as an attacker's own script would (no validation)."""
    body = {k: v for k, v in raw.items() if k not in ("created_at", "build", "digest")}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def rehash(bundle: Path, mutate=None) -> dict:
    """Apply `mutate` to the manifest, then recompute every file entry and the digest."""
    raw = json.loads((bundle / "manifest.json").read_text())
    if mutate:
        mutate(raw)
    entries = [g["file"] for g in raw["graphs"]] + raw["files"] + \
        [f for mm in raw["models"].values() for f in mm["weight_files"]]
    for e in entries:
        p = bundle / e["path"]
        e["sha256"], e["size"] = sha256_file(p), p.stat().st_size
    raw["digest"] = digest_of(raw)
    (bundle / "manifest.json").write_text(json.dumps(raw))
    return raw


def write_raw(bundle: Path, raw: dict) -> None:
    raw["digest"] = digest_of(raw)
    (bundle / "manifest.json").write_text(json.dumps(raw))


def copy(good: Path, tmp_path: Path, name: str = "b") -> Path:
    dst = tmp_path / name
    shutil.copytree(good, dst)
    return dst


def rewrite_pt2(path: Path, edit) -> None:
    """Rewrite a .pt2 archive entry by entry; edit(name, data) -> data (or None to drop)."""
    with zipfile.ZipFile(path) as z:
        items = [(i.filename, z.read(i)) for i in z.infolist()]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, data in items:
            data = edit(name, data)
            if data is not None:
                z.writestr(name, data)
        extra = edit(None, None)
        for name, data in (extra or {}).items():
            z.writestr(name, data)
    path.write_bytes(buf.getvalue())


MARKER_CODE = "import os, sys; open(sys.argv[1], 'w').write('pwned')"


class Payload:
    """Unpickling this runs a command that writes a marker file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (subprocess.call, ([sys.executable, "-c", MARKER_CODE, self.marker],))


def pickled_constant_attack(bundle: Path, marker: Path) -> Path:
    import torch

    victim = bundle / "graphs" / "target_decode_b1.pt2"
    payload = io.BytesIO()
    torch.save(Payload(marker), payload)

    def edit(name, data):
        if name is None:
            return None
        if name.endswith("model_constants_config.json"):
            cfg = json.loads(data)
            for meta in cfg["config"].values():
                meta["use_pickle"] = True
            return json.dumps(cfg).encode()
        if name.endswith("data/constants/tensor_0"):
            return payload.getvalue()
        return data

    rewrite_pt2(victim, edit)
    rehash(bundle)
    return victim


def test_pickled_constant_runs_code_in_torch_but_is_refused_everywhere(good, tmp_path, monkeypatch):
    bundle = copy(good, tmp_path)
    marker = tmp_path / "marker"
    victim = pickled_constant_attack(bundle, marker)
    # positive control: plain torch.export.load really runs the payload
    ctl = subprocess.run([sys.executable, "-c", f"import torch; torch.export.load({str(victim)!r})"],
                         capture_output=True, text=True, timeout=120)
    assert marker.exists(), ctl.stderr[-2000:]
    marker.unlink()

    r = run_cli("eagle3-build", "check", str(bundle), "--files")
    assert r.returncode == 2 and "pickled" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("eagle3-run", str(bundle), "--prompt", "hi", "--max-tokens", "4")
    assert r.returncode == 2 and "pickled" in r.stderr and "Traceback" not in r.stderr
    # the attacker controls the remote: the tampered tree is what `pull` fetches
    monkeypatch.setenv("EAGLE3_RUNTIME_CACHE", str(tmp_path / "runtime-cache"))
    shutil.copytree(bundle, tmp_path / "remote" / "main")
    remote = f"file://{tmp_path / 'remote'}@main"
    r = run_cli("eagle3-build", "pull", remote)
    assert r.returncode == 2 and "pickled" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("eagle3-run", remote, "--prompt", "hi", "--max-tokens", "4")
    assert r.returncode == 2 and "pickled" in r.stderr
    assert not marker.exists()


def _archive(good: Path) -> bytes:
    return (good / "graphs" / "target_decode_b1.pt2").read_bytes()


def _edited(data: bytes, edit) -> bytes:
    tmp = io.BytesIO(data)
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"edit-{os.getpid()}.pt2"
    path.write_bytes(tmp.getvalue())
    try:
        rewrite_pt2(path, edit)
        return path.read_bytes()
    finally:
        path.unlink()


def _model_json(edit_program):
    def edit(name, data):
        if name is not None and name.endswith("models/model.json"):
            program = json.loads(data)
            edit_program(program)
            return json.dumps(program).encode()
        return data if name is not None else None
    return edit


def _set_first_target(target):
    def f(program):
        program["graph_module"]["graph"]["nodes"][0]["target"] = target
    return f


@pytest.mark.parametrize("case, edit, needle", [
    ("os.system as an operator", _model_json(_set_first_target("torch.os.system")), "not an ATen"),
    ("builtins through torch", _model_json(_set_first_target("torch.ops.aten.__builtins__.eval")), "not an ATen"),
    ("file access op", _model_json(_set_first_target("torch.ops.aten.from_file.default")), "not an ATen"),
    ("guard code", _model_json(lambda p: p.__setitem__("guards_code", ["__import__('os').system('x')"])),
     "guard code"),
    ("symbolic shape (sympify)", _model_json(lambda p: p["graph_module"]["graph"]["nodes"][0]["inputs"].append(
        {"name": "x", "arg": {"as_sym_int": {"as_expr": {"expr_str": "__import__('os')"}}}})), "symbolic"),
    ("extra entry", lambda n, d: {"graph/data/evil.pkl": b"x"} if n is None else d, "unexpected archive entry"),
    ("legacy pickled weights", lambda n, d: {"graph/data/weights/model.pt": b"x"} if n is None else d,
     "unexpected archive entry"),
    ("pickled sample inputs", lambda n, d: None if n is None else (b"\x80\x04N." if n.endswith("sample_inputs/model.pt")
                                                                  else d), "sample inputs"),
])
def test_archive_refuses_anything_but_a_static_operator_graph(good, case, edit, needle):
    check_archive(_archive(good), "ok.pt2")  # the builder's own archive passes
    with pytest.raises(UnsafeArchive, match=needle):
        check_archive(_edited(_archive(good), edit), f"{case}.pt2")


def test_digest_is_always_required(good, tmp_path):
    for value in ("", None):
        b = copy(good, tmp_path, f"d{value!r}")
        raw = json.loads((b / "manifest.json").read_text())
        raw["max_model_len"] = 64
        raw["eos_token_ids"] = [1]
        if value is None:
            raw.pop("digest")
        else:
            raw["digest"] = value
        (b / "manifest.json").write_text(json.dumps(raw))
        v = check_bundle(b)
        assert v.code == 2 and "no digest" in v.reasons()[0]
        with pytest.raises(BundleError, match="no digest"):
            Bundle(b)
    r = run_cli("eagle3-run", str(b), "--prompt", "hi", "--max-tokens", "4")
    assert r.returncode == 2 and "no digest" in r.stderr and "Traceback" not in r.stderr


def _entry_to(path_value, where):
    def mutate(raw):
        if where == "file":
            raw["files"][0]["path"] = path_value
        elif where == "graph":
            raw["graphs"][0]["file"]["path"] = path_value
        else:
            raw["models"]["target"]["weight_files"][0]["path"] = path_value
    return mutate


@pytest.mark.parametrize("path_value, where", [
    ("../../../../../etc/passwd", "file"), ("/etc/passwd", "file"), ("/etc/hostname", "graph"),
    ("../../outside/rank0.safetensors", "weights"), ("tokenizer/./x", "file"), ("tokenizer\\x", "file"),
])
def test_manifest_paths_stay_inside_the_bundle(good, tmp_path, path_value, where):
    b = copy(good, tmp_path)
    raw = json.loads((b / "manifest.json").read_text())
    _entry_to(path_value, where)(raw)
    write_raw(b, raw)
    v = check_bundle(b, files=True)
    assert v.code == 2 and "not a plain relative path inside the bundle" in v.reasons()[0]
    assert repr(path_value) in v.reasons()[0] or path_value in v.reasons()[0]


def test_symlink_leaving_the_bundle_is_refused(good, tmp_path):
    b = copy(good, tmp_path)
    outside = tmp_path / "secret.txt"
    outside.write_text("secret")
    victim = b / "tokenizer" / "chat_template.jinja"
    victim.unlink()
    victim.symlink_to(outside)
    rehash(b)  # the attacker even matches the outside file's sha256
    v = check_bundle(b, files=True)
    assert v.code == 2 and "leaves the bundle" in v.reasons()[0] and "chat_template.jinja" in v.reasons()[0]
    assert sha256_file(outside)[:12] not in v.reasons()[0]
    r = run_cli("eagle3-run", str(b), "--prompt", "hi", "--max-tokens", "4")
    assert r.returncode == 2 and "leaves the bundle" in r.stderr


def huge_context(raw: dict) -> None:
    """max_model_len ~2^24 and 64 sequence slots, with KV caches that size (consistent: only host memory refuses
    them: 4 layers x 2 x 64 x 2 heads x 2^24 x 16 x 4 bytes = 512 GiB)."""
    raw["max_model_len"] = (1 << 24) - 128
    raw["max_num_seqs"] = 64
    for s in raw["state"]:
        s["shape"][2] = 64
        s["shape"][4] = kv_cache_length(raw["max_model_len"], 3)


@pytest.mark.parametrize("case, mutate, needle", [
    ("absurd dimension", lambda r: r["state"][0].__setitem__("shape", [1 << 50, 2]), "state.0.shape"),
    ("huge state under the dim cap", lambda r: huge_context(r), "GiB"),
    ("unknown dtype", lambda r: r["state"][0].__setitem__("dtype", "float8_e9m9"), "dtype"),
    ("no graphs", lambda r: r.__setitem__("graphs", []), "missing"),
    ("no prefill buckets", lambda r: r.__setitem__("prefill_buckets", []), "prefill_buckets"),
    ("tp 0", lambda r: r.__setitem__("tp_degree", 0), "tp_degree"),
    ("eos outside vocab", lambda r: r.__setitem__("eos_token_ids", [10 ** 9]), "eos_token_ids"),
    ("unknown role", lambda r: r["graphs"][0].__setitem__("role", "exec_shell"), "role"),
    ("weight nobody holds", lambda r: r["graphs"][0]["weights"].append("target/nope"), "nope"),
    ("packed copy of a weight the graph lacks", lambda r: r["graphs"][0]["packed"].append(
        {"weight": "draft/fc.weight", "rows": 4, "format": "mkl_sgemm"}), "packed weight"),
    ("unknown packing", lambda r: r["graphs"][0]["packed"].append(
        {"weight": r["graphs"][0]["weights"][0], "rows": 4, "format": "pickle"}), "format"),
])
def test_manifest_is_validated_as_data(good, tmp_path, case, mutate, needle):
    b = copy(good, tmp_path)
    raw = json.loads((b / "manifest.json").read_text())
    mutate(raw)
    write_raw(b, raw)
    v = check_bundle(b)
    assert not v.ok and v.code == 2 and needle in v.reasons()[0], v.reasons()
    with pytest.raises(BundleError, match=needle):
        Bundle(b)  # (read_manifest refuses every case but the host's memory, which the load checks)


def test_manifest_cases_through_the_cli(good, tmp_path):
    b = copy(good, tmp_path)
    raw = json.loads((b / "manifest.json").read_text())
    raw["tp_degree"] = 0
    write_raw(b, raw)
    for cmd in (("eagle3-build", "check", str(b)), ("eagle3-run", str(b), "--prompt", "hi")):
        r = run_cli(*cmd)
        assert r.returncode == 2 and "tp_degree" in r.stderr and "Traceback" not in r.stderr
        assert len([ln for ln in r.stderr.splitlines() if ln.strip()]) <= 2  # check adds its verdict line


def test_run_refuses_a_prompt_that_is_not_utf8(good):
    code = "import sys; from eagle3_runtime.cli import main; sys.exit(main())"
    r = subprocess.run([sys.executable, "-c", code, str(good), "--prompt", b"caf\xe9 \xff"], capture_output=True,
                       timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 2 and "not valid UTF-8" in err and "Traceback" not in err


def test_expect_digest_and_signatures_round_trip(good, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_RUNTIME_CACHE", str(tmp_path / "runtime-cache"))
    digest = json.loads((good / "manifest.json").read_text())["digest"]
    key = tmp_path / "keys" / "release"
    key.parent.mkdir()
    assert run_cli("eagle3-build", "keygen", str(key)).returncode == 0
    assert oct(Path(f"{key}.key").stat().st_mode & 0o777) == "0o600"
    r = run_cli("eagle3-build", "keygen", str(key))
    assert r.returncode == 2 and "already exists" in r.stderr
    b = copy(good, tmp_path)
    remote = f"file://{tmp_path / 'remote'}@release"
    r = run_cli("eagle3-build", "push", str(b), remote, "--sign", f"{key}.key", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["signed"] and (tmp_path / "remote" / "release" / "manifest.sig").is_file()

    pub = f"{key}.pub"
    r = run_cli("eagle3-build", "pull", remote, "--verify-signature", pub, "--expect-digest", f"sha256:{digest}")
    assert r.returncode == 0 and digest in r.stderr, r.stderr
    r = run_cli("eagle3-build", "pull", f"{remote}#sha256={digest}")
    assert r.returncode == 0, r.stderr
    r = run_cli("eagle3-build", "pull", f"{remote}#sha256={'0' * 64}")
    assert r.returncode == 2 and "not the bundle you pinned" in r.stderr
    r = run_cli("eagle3-build", "check", remote, "--verify-signature", pub)
    assert r.returncode == 0, r.stderr

    other = tmp_path / "keys" / "other"
    run_cli("eagle3-build", "keygen", str(other))
    r = run_cli("eagle3-build", "check", remote, "--verify-signature", f"{other}.pub")
    assert r.returncode == 2 and "not a valid signature" in r.stderr

    s = ServerProc(remote, "--verify-signature", pub, "--expect-digest", f"sha256:{digest}", log_dir=tmp_path)
    try:
        resp = httpx.post(s.url + "/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 8,
                                                           "temperature": 0}, timeout=120)
        assert resp.status_code == 200 and len(resp.json()["choices"][0]["token_ids"]) == 8
    finally:
        s.stop()

    # tampered after signing: manifest edited and its digest recomputed -> the signature no longer matches
    tree = tmp_path / "remote" / "release"
    rehash(tree, lambda raw: raw.__setitem__("max_model_len", 200))
    for cmd in (("eagle3-build", "pull", remote, "--verify-signature", pub),
                ("eagle3-run", remote, "--prompt", "hi", "--verify-signature", pub)):
        r = run_cli(*cmd)
        assert r.returncode == 2 and "signs another bundle" in r.stderr and "Traceback" not in r.stderr
    serve = subprocess.run([sys.executable, "-m", "eagle3_runtime.server", remote, "--verify-signature", pub,
                            "--port", "1"], capture_output=True, text=True, timeout=120)
    assert serve.returncode == 2 and "signs another bundle" in serve.stderr


def test_native_code_from_a_remote_needs_a_pin(good, tmp_path, monkeypatch):
    """An aoti bundle from a remote is refused unless pinned, before any graph file is read; pinned, its
    files must still be what an aoti bundle's are (here: export archives relabelled, refused). A real aoti
    bundle pulled with a pin: tests/test_aoti.py."""
    monkeypatch.setenv("EAGLE3_RUNTIME_CACHE", str(tmp_path / "runtime-cache"))
    tree = tmp_path / "remote" / "main"
    shutil.copytree(good, tree)
    raw = rehash(tree, as_aoti)
    remote = f"file://{tmp_path / 'remote'}@main"
    r = run_cli("eagle3-build", "pull", remote)
    assert r.returncode == 2 and "native code (aoti)" in r.stderr and raw["digest"] in r.stderr
    for pin in (("--expect-digest", f"sha256:{raw['digest']}"), ("--trust-remote-code",)):
        r = run_cli("eagle3-build", "pull", remote, *pin)
        assert r.returncode == 2 and "must be an AOTInductor package" in r.stderr and "Traceback" not in r.stderr


def as_aoti(raw: dict) -> None:
    """The manifest of an export bundle relabelled as aoti (backend and every graph's file format)."""
    raw["backend"] = "aoti"
    for g in raw["graphs"]:
        g["backend"]["format"] = "aotinductor"


# ------------------------------------------------------------------ manifests that agree with themselves, not with
# their files: each edited and re-digested, as anyone can. `check` (as data) or `check --files` / load (against
# what each graph file and weight file says it holds) refuses every one in one line; none reaches a graph call.

def _state(**kw):
    def tamper(b, raw):
        for s in raw["state"]:
            if "rows" in kw:
                s["shape"][2] = kw["rows"]
            if "dtype" in kw:
                s["dtype"] = kw["dtype"]
            if "shape" in kw:
                s["shape"] = kw["shape"]
    return tamper


def _weights(model: str, edit, every: bool = True):
    def tamper(b, raw):
        graphs = [g for g in raw["graphs"] if g["model"] == model]
        for g in graphs if every else graphs[:1]:
            edit(g["weights"])
    return tamper


def _swap(a, b_):
    def edit(ws):
        ws[a], ws[b_] = ws[b_], ws[a]
    return edit


def _packed(entry, aoti: bool = True):
    def tamper(b, raw):
        if aoti:
            as_aoti(raw)
        g = next(g for g in raw["graphs"] if g["name"] == "target_decode_b1")
        g["packed"].append(entry(g))
    return tamper


def _swap_files(a: str, b_: str):
    def tamper(b, raw):
        pa, pb = b / "graphs" / a, b / "graphs" / b_
        da, db = pa.read_bytes(), pb.read_bytes()
        pa.write_bytes(db)
        pb.write_bytes(da)
    return tamper


def _index_as_float(b, raw):
    g = next(g for g in raw["graphs"] if g["name"] == "target_decode_b1")
    next(s for s in g["inputs"] if s["name"] == "tokens")["dtype"] = "float32"


def _two_slots(b, raw):  # consistent as data (rows = max_num_seqs), not with the compiled graphs
    raw["max_num_seqs"] = 2
    _state(rows=2)(b, raw)


TAMPERS = [  # (case, tamper(bundle, raw manifest), what the one line names, refused as data alone)
    ("backend export -> aoti", lambda b, r: r.__setitem__("backend", "aoti"), "'torch.export' graph", True),
    ("backend and file formats -> aoti", lambda b, r: as_aoti(r), "must be an AOTInductor package", False),
    ("KV state dtype", _state(dtype="bfloat16"), "state target_kv", True),
    ("KV slot count", _state(rows=2), "state target_kv", True),
    ("KV slot count with max_num_seqs", _two_slots, "KV cache target_kv", False),
    ("zero-sized huge KV state", _state(shape=[0, 1 << 40, 1, 1, 1, 1]), "state target_kv", True),
    ("max_model_len past the KV cache", lambda b, r: r.__setitem__("max_model_len", 400), "state target_kv", True),
    ("packed 1-D weight", _packed(lambda g: {"weight": "target/norm.weight", "rows": 1, "format": "mkl_sgemm"}),
     "2-D float32", True),
    ("packed for 2^24 rows", _packed(lambda g: {"weight": g["weights"][1], "rows": 1 << 24, "format": "mkl_sgemm"}),
     "token rows", True),
    ("packed on an export graph", _packed(lambda g: {"weight": g["weights"][1], "rows": 1, "format": "mkl_sgemm"},
                                          aoti=False), "packed weights on a export graph", True),
    ("fused copy in MKL's format", _packed(lambda g: {"weight": g["weights"][1], "fused": [g["weights"][2]], "rows": 1,
                                                      "format": "mkl_sgemm"}), "takes one weight per copy", True),
    ("fused copy of a weight the graph lacks", _packed(lambda g: {"weight": g["weights"][1], "fused": ["draft/fc.weight"],
                                                                  "rows": 1, "format": "onednn"}), "packed weight", True),
    ("fused copy of a 1-D weight", _packed(lambda g: {"weight": g["weights"][1], "fused": ["target/norm.weight"],
                                                      "rows": 1, "format": "onednn"}), "2-D float32", True),
    ("blocked copy without its block_n", _packed(lambda g: {"weight": g["weights"][1], "rows": 1, "format": "blocked"}),
     "block_n goes with the blocked format", True),
    ("block_n on a oneDNN copy", _packed(lambda g: {"weight": g["weights"][1], "rows": 1, "format": "onednn",
                                                    "block_n": 48}), "block_n goes with the blocked format", True),
    ("blocked copy of block_n 2^20", _packed(lambda g: {"weight": g["weights"][1], "rows": 1, "format": "blocked",
                                                        "block_n": 1 << 20}), "block_n", True),
    ("weights reordered in one graph", _weights("target", _swap(0, 1), every=False), "differ from the other", True),
    ("weights reordered in every graph", _weights("target", _swap(0, 1)), "input 0 of the graph file", False),
    ("a weight dropped from every graph", _weights("draft", lambda ws: ws.pop()), "the graph file takes", False),
    ("graph file swapped for another role's", _swap_files("target_decode_b1.pt2", "target_verify_b1.pt2"),
     "target_verify_b1.pt2: the graph file takes", False),
    ("index input declared float32", _index_as_float, "'tokens', [1], 'float32'", True),
    ("tensor shape not the weight file's", lambda b, r: r["models"]["target"]["tensors"]["norm.weight"].__setitem__(
        "shape", [65]), "norm.weight", False),
    ("vocab_size not the logits'", lambda b, r: r.__setitem__("vocab_size", 500), "logits", True),
]


@pytest.mark.parametrize("case, tamper, needle, as_data", TAMPERS, ids=[t[0] for t in TAMPERS])
def test_check_refuses_what_load_would_choke_on(good, tmp_path, case, tamper, needle, as_data):
    b = copy(good, tmp_path)
    raw = json.loads((b / "manifest.json").read_text())
    tamper(b, raw)
    (b / "manifest.json").write_text(json.dumps(raw))
    rehash(b)
    shallow = check_bundle(b)
    assert shallow.ok != as_data, shallow.reasons()
    if as_data:
        assert shallow.code == 2 and needle in shallow.reasons()[0], shallow.reasons()
    deep = check_bundle(b, files=True)
    assert deep.code == 2 and needle in deep.reasons()[0], deep.reasons()
    with pytest.raises(BundleError, match=re.escape(needle)):
        Bundle(b)


def test_tampered_bundles_through_the_clis(good, tmp_path):
    for case in ("KV slot count with max_num_seqs", "weights reordered in every graph"):
        _, tamper, needle, _ = next(t for t in TAMPERS if t[0] == case)
        b = copy(good, tmp_path, case.replace(" ", "-"))
        raw = json.loads((b / "manifest.json").read_text())
        tamper(b, raw)
        (b / "manifest.json").write_text(json.dumps(raw))
        rehash(b)
        for cmd in (("eagle3-build", "check", str(b), "--files"), ("eagle3-run", str(b), "--prompt", "hi")):
            r = run_cli(*cmd)
            lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("ok ")]
            assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
            assert len(lines) <= 2, lines  # (check: the failed check and its verdict)


@pytest.mark.parametrize("pin", ["none", "another digest", "its own digest"])
def test_a_64k_choice_manifest_is_refused_in_under_a_second(good, tmp_path, pin):
    """64k distinct static-tree paths, each within bounds: every size is capped
    before any per-element work, and a pin is compared on the manifest as read, before validation."""
    from eagle3_runtime.trust import Pins

    b = copy(good, tmp_path)
    raw = json.loads((b / "manifest.json").read_text())
    raw["speculation"]["1"]["choices"] = [[x, y, z, w] for x in range(16) for y in range(16) for z in range(16)
                                          for w in range(16)]
    write_raw(b, raw)
    pins = {"none": Pins(), "another digest": Pins(digest="0" * 64), "its own digest": Pins(digest=raw["digest"])}[pin]
    t0 = time.perf_counter()
    v = check_bundle(b, pins=pins)
    assert time.perf_counter() - t0 < 1.0
    needle = "not the bundle you pinned" if pin == "another digest" else "at most 127"
    assert v.code == 2 and needle in v.reasons()[0], v.reasons()
