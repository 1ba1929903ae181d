"""Publish a verified bundle and fetch it back: `eagle3-build push BUNDLE REMOTE`, `pull REMOTE`.

REMOTE is hf://org/repo[@branch] (huggingface_hub: one commit, manifest.json last, the bundle digest
in the commit message) or file:///dir[@branch] (the same code path against a directory). Only a
bundle whose files all match its manifest is pushed; a pull verifies every file before it counts.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from eagle3_runtime.bundle import BundleError, read_manifest, verify_files
from eagle3_runtime.manifest import MANIFEST
from eagle3_runtime.remote import RemoteError, remote_for, resolve_bundle

from .errors import UserError


def push(bundle: Path, ref: str) -> dict:
    try:
        m = read_manifest(bundle)
        verify_files(bundle, m)
    except BundleError as e:
        raise UserError(f"refusing to push: {e}") from None
    files = sorted({f.path for f in m.all_files()})
    entries = [(rel, bundle / rel) for rel in files] + [(MANIFEST, bundle / MANIFEST)]  # manifest last
    message = f"eagle3 bundle {m.name} (digest {m.digest})"
    try:
        remote = remote_for(ref)
        commit = remote.put(entries, message)
    except RemoteError as e:
        raise UserError(str(e)) from None
    return {"remote": remote.uri, "commit": commit, "digest": m.digest, "files": len(entries),
            "bytes": sum(p.stat().st_size for _, p in entries)}


def pull(ref: str, out: Path | None = None) -> tuple[Path, str]:
    """Fetch + verify; with `out`, also copy the verified bundle there (atomically)."""
    try:
        local = resolve_bundle(ref)
    except RemoteError as e:
        raise UserError(str(e)) from None
    digest = read_manifest(local).digest
    if out is None:
        return local, digest
    out = Path(out)
    tmp = out.with_name(f".{out.name}.pull-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(local, tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out, digest
