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

from .backends.registry import backend_for
from .backends.base import BACKEND, BAD_BUNDLE, DEVICE, OK, SCHEMA, Check, world_size
from .errors import Eagle3Error
from .manifest import SCHEMA_VERSION, BundleError, Manifest, SchemaError
from .trust import Pins


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
    the host checks of the bundle's backend."""
    from .bundle import check_memory, verify_files
    from .reader import read_manifest

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
    try:
        backend = backend_for(m)
        check_memory(Path(root), m)
    except BundleError as e:
        v.checks.append(Check("backend", False, str(e), BACKEND if "cannot be served" in str(e) else BAD_BUNDLE))
        return v
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
        v.checks += backend.host_checks(m, environ)
    v.checks += backend.manifest_checks(m, Path(root))
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
