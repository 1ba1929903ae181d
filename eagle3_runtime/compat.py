"""Will this bundle load here? Answered from the manifest and the host, without loading anything.

Used by `eagle3-build check BUNDLE` (exit codes for deploy scripts) and, check by check, by the
runtime itself before it loads a bundle.

  exit  verdict
  0     ok: the bundle will load on this machine
  2     not a bundle / unreadable / corrupt or incomplete files (with --files)
  3     schema version this runtime cannot read (rebuild or upgrade)
  4     backend unavailable or toolchain mismatch (SDK missing, other torch / SDK version)
  5     device or parallelism mismatch (CPU ISA, no GPU, NeuronCores/lnc, tp degree vs ranks)
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import Eagle3Error
from .manifest import MANIFEST, SCHEMA_VERSION, BundleError, Manifest, SchemaError
from .trust import Pins

OK, BAD_BUNDLE, SCHEMA, BACKEND, DEVICE = 0, 2, 3, 4, 5
CPU_ISA_RANK = {"DEFAULT": 0, "VSX": 1, "ZVECTOR": 1, "SVE256": 1, "AVX2": 1, "AVX512": 2}


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    code: int = OK


@dataclass
class Verdict:
    bundle: str
    checks: list[Check] = field(default_factory=list)

    @property
    def code(self) -> int:
        return next((c.code for c in self.checks if not c.ok), OK)

    @property
    def ok(self) -> bool:
        return self.code == OK

    def reasons(self) -> list[str]:
        return [c.detail for c in self.checks if not c.ok]

    def to_dict(self) -> dict:
        return {"bundle": self.bundle, "ok": self.ok, "exit_code": self.code,
                "checks": [asdict(c) for c in self.checks]}


def check_bundle(root: Path, *, ranks: int | None = None, files: bool = False, backend_env: bool = True,
                 environ: dict | None = None, pins: Pins = Pins()) -> Verdict:
    """The runtime's own validation (reader.py: manifest as data, digest, pins; with `files` every
    file's sha256, what each graph and weight file says it holds, the tokenizer and chat template), then
    the host checks."""
    from .reader import read_manifest, verify_files

    environ = os.environ if environ is None else environ
    v = Verdict(str(root))
    try:
        m = read_manifest(Path(root), pins)
    except SchemaError as e:
        v.checks.append(Check("schema", False, str(e), SCHEMA))
        return v
    except BundleError as e:
        v.checks.append(Check("manifest", False, str(e), BAD_BUNDLE))
        return v
    pinned = " (pinned)" if pins.any else ""
    v.checks.append(Check("schema", True, f"schema {SCHEMA_VERSION}, digest sha256:{m.digest}{pinned}"))
    if files:
        try:
            verify_files(Path(root), m)
            v.checks.append(Check("files", True, f"{len(m.all_files())} files match their sha256 and say what "
                                                 "the manifest says"))
        except BundleError as e:
            v.checks.append(Check("files", False, str(e), BAD_BUNDLE))
            return v
        v.checks.append(text_check(Path(root)))
    if backend_env:
        v.checks += backend_checks(m, environ)
    if m.backend == "neuron":
        v.checks.append(neuron_call_check(m, Path(root)))
    v.checks.append(parallel_check(m, ranks, environ))
    return v


def text_check(root: Path) -> Check:
    """The tokenizer loads and the chat template renders its probe within bounds (what the runtime's
    start-up does: tokenizer.load_text)."""
    from .tokenizer import load_text

    try:
        _, template = load_text(root)
    except BundleError as e:
        return Check("tokenizer", False, str(e), BAD_BUNDLE)
    if template is None:
        return Check("tokenizer", True, "tokenizer loads; no chat template")
    template.close()
    return Check("tokenizer", True, "tokenizer loads; the chat template renders a probe conversation within its "
                                    "limits")


def neuron_call_check(m: Manifest, root: Path) -> Check:
    """The NxD call fields of every graph entry (what the loader pads and routes calls by)."""
    from .neuron import check_manifest

    try:
        check_manifest(m, str(root / MANIFEST))
    except BundleError as e:
        return Check("nxd calls", False, str(e), BAD_BUNDLE)
    return Check("nxd calls", True, f"{len(m.graphs)} graph entries name their NxD key, bucket and call layout")


def backend_checks(m: Manifest, environ: dict) -> list[Check]:
    import torch

    tc = m.toolchain
    if m.backend == "export":
        return [Check("backend", True, f"export graphs, built with torch {tc.get('torch')}, running "
                                       f"{torch.__version__}")]
    if m.backend == "aoti":
        out = []
        if tc.get("torch") != torch.__version__:
            return [Check("backend", False, f"aoti graphs were compiled against torch {tc.get('torch')}, this host "
                                            f"has {torch.__version__}; install torch=={tc.get('torch')} or rebuild "
                                            "the bundle here", BACKEND)]
        out.append(Check("backend", True, f"aoti, torch {torch.__version__}"))
        target = tc.get("aoti_target", "cpu:DEFAULT")
        kind, _, isa = target.partition(":")
        if kind == "cuda":
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            ok = n >= m.tp_degree
            out.append(Check("device", ok, f"{target}: {n} CUDA device(s) for tp {m.tp_degree}" if ok else
                             f"aoti graphs were compiled for {target}; this host has {n} CUDA device(s), the bundle "
                             f"needs {m.tp_degree}; use a GPU host or rebuild with device: cpu", DEVICE))
        else:
            host = torch.backends.cpu.get_cpu_capability()
            ok = CPU_ISA_RANK.get(host, 0) >= CPU_ISA_RANK.get(isa, 0)
            out.append(Check("device", ok, f"compiled for {isa} CPUs, host supports {host}" if ok else
                             f"aoti graphs were compiled for {isa} CPUs, this host supports {host}; rebuild the "
                             "bundle on (or for) this host", DEVICE))
        return out
    if m.backend == "neuron":
        from .neuron import NeuronHostError, check_host

        try:
            check_host(m, environ=environ)
        except NeuronHostError as e:
            msg = str(e)
            code = BACKEND if ("not installed" in msg or "compiled with" in msg) else DEVICE
            return [Check("backend", False, msg, code)]
        return [Check("backend", True, f"neuron SDK {tc.get('neuronx_cc')} matches, NeuronCores available")]
    return [Check("backend", False, f"backend {m.backend!r} cannot be served by this runtime "
                                    "(export, aoti, neuron)", BACKEND)]


def world_size(environ) -> int | None:
    """$WORLD_SIZE as torchrun sets it (None when unset); anything but a positive integer is an Eagle3Error."""
    raw = environ.get("WORLD_SIZE")
    if raw is None or raw.strip() == "":
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if not 1 <= n <= 1 << 20:
        raise Eagle3Error(f"WORLD_SIZE={raw[:40]!r} is not a number of processes; unset it, or start the runtime "
                          "with torchrun, which sets it")
    return n


def parallel_check(m: Manifest, ranks: int | None, environ: dict) -> Check:
    tp = m.tp_degree
    if ranks is None:
        try:
            ranks = world_size(environ)
        except Eagle3Error as e:
            return Check("parallel", False, str(e), BAD_BUNDLE)
    if ranks is not None and ranks != tp:
        run = "as a single process" if tp == 1 else f"with torchrun --nproc-per-node {tp}"
        return Check("parallel", False, f"bundle built for tp_degree {tp}, the deployment has {ranks} rank(s); "
                                        f"run it {run} or rebuild with parallel.tp_degree: {ranks}", DEVICE)
    hint = "one process" if tp == 1 else f"torchrun --nproc-per-node {tp}"
    return Check("parallel", True, f"tp_degree {tp}: run as {hint}")
