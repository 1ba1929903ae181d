"""Publish a verified bundle and fetch it back: `eagle3-build push BUNDLE REMOTE`, `pull REMOTE`, `sign`, `keygen`.

REMOTE is hf://org/repo[@branch] (huggingface_hub: one commit, manifest.json last, the bundle digest
in the commit message) or file:///dir[@branch] (the same code path against a directory: <dir>/<branch>/
is staged next to itself as `.BRANCH.tmp-<owner>-*` and swapped in whole, as a build replaces its bundle;
a push removes what killed pushes left there, never a live push's). Only a bundle whose files all match
its manifest is pushed; a pull verifies every file, and the user's pins (digest, signature:
eagle3_runtime/trust.py), before it counts.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

from eagle3_runtime.manifest import MANIFEST, BundleError
from eagle3_runtime.bundle import verify_files
from eagle3_runtime.reader import read_manifest
from eagle3_runtime.remote import FileRemote, remote_for, resolve_bundle
from eagle3_runtime.trust import SIGNATURE, generate_key, pins, write_signature

from .output import check_replaceable, clean_leftovers, replace_staged
from .errors import UserError
from .files import default_dir_mode


def push(bundle: Path, ref: str, sign_key: Path | None = None) -> dict:
    try:
        m = read_manifest(bundle)
        verify_files(bundle, m)
        if sign_key is not None:
            write_signature(bundle, m.digest, sign_key)
    except BundleError as e:
        raise UserError(f"refusing to push: {e}") from e
    files = sorted({f.path for f in m.all_files()})
    if (bundle / SIGNATURE).is_file():
        files.append(SIGNATURE)
    entries = [(rel, bundle / rel) for rel in files] + [(MANIFEST, bundle / MANIFEST)]  # manifest last
    message = f"eagle3 bundle {m.name} (digest sha256:{m.digest})"
    try:
        remote = remote_for(ref)
        commit = put_file(remote, entries, message) if isinstance(remote, FileRemote) else remote.put(entries, message)
    except BundleError as e:
        raise UserError(str(e)) from e
    return {"remote": remote.uri, "commit": commit, "digest": m.digest, "signed": sign_key is not None,
            "files": len(entries), "bytes": sum(p.stat().st_size for _, p in entries)}


def put_file(remote: FileRemote, files: list[tuple[str, Path]], message: str) -> str:
    """A file:// push: the tree (manifest.json last) staged next to <dir>/<branch> and swapped in whole, after
    removing what killed pushes left there (`clean_leftovers`: a dead builder's, on this host, only)."""
    started = time.time()
    remote.root.mkdir(parents=True, exist_ok=True)
    clean_leftovers(remote.root, started)

    def fill(stage: Path) -> None:
        stage.chmod(default_dir_mode())  # (not mkdtemp's 0700: the remote's other readers pull from it)
        for rel, src in files:
            (stage / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, stage / rel)
        (stage / ".commit_message").write_text(message)

    replace_staged(remote.root / remote.rev, fill)
    return remote.rev


def pull(ref: str, out: Path | None = None, expect_digest: str | None = None, public_key: Path | None = None,
         trust_remote_code: bool = False) -> tuple[Path, str]:
    """Fetch + verify (+ pins); with `out`, also copy the verified bundle there (replacing only a bundle,
    atomically)."""
    if out is not None:
        check_replaceable(Path(out))  # before any download
    try:
        ref, p = pins(ref, expect_digest, public_key)
        local = resolve_bundle(ref, p, trust_remote_code)
        digest = read_manifest(local, p).digest
    except BundleError as e:
        raise UserError(str(e)) from e
    if out is None:
        return local, digest
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    replace_staged(out, lambda tmp: shutil.copytree(local, tmp, dirs_exist_ok=True))
    return out, digest


def sign(bundle: Path, key: Path) -> tuple[str, Path]:
    """Write BUNDLE/manifest.sig for a bundle whose files all verify."""
    try:
        m = read_manifest(bundle)
        verify_files(bundle, m)
        return m.digest, write_signature(bundle, m.digest, key)
    except BundleError as e:
        raise UserError(f"refusing to sign: {e}") from e


def keygen(prefix: Path) -> tuple[Path, Path]:
    try:
        return generate_key(prefix)
    except BundleError as e:
        raise UserError(str(e)) from e

