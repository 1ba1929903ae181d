"""Bundles by reference: a local directory, `hf://org/repo[@rev]` or `file:///dir[@rev]`.

A remote bundle is fetched into a local cache and every file is checked against the manifest
(present, sha256, manifest digest) before anything loads; a partial or altered download is refused.
Both remote kinds have `snapshot() -> local directory`; pushing is the builder's (eagle3_build/publish.py:
one commit, manifest.json last, for hf://; a staged tree swapped in whole, for file://).

  hf://org/repo@rev   huggingface_hub (its cache, auth and offline mode); rev: branch, tag or commit
  file:///dir@rev     a directory remote: <dir>/<rev>/ holds the tree (rev defaults to "main");
                      used for shared filesystems and to test the whole path without a network
"""
from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

from .manifest import MANIFEST, BundleError
from .trust import SIGNATURE, Pins

DEFAULT_REV = "main"
FILE_REV = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")  # a directory name under a file:// remote


class RemoteError(BundleError):
    """A reference that cannot be fetched or does not verify; the message names the fix."""


def is_remote(ref: str | os.PathLike) -> bool:
    return isinstance(ref, str) and (ref.startswith("hf://") or ref.startswith("file://"))


def parse(ref: str) -> tuple[str, str, str]:
    """-> (scheme, location, rev)"""
    scheme, _, rest = ref.partition("://")
    if scheme not in ("hf", "file") or not rest:
        raise RemoteError(f"{ref!r}: expected hf://org/repo[@rev] or file:///path[@rev]")
    loc, rev = rest.rsplit("@", 1) if "@" in rest else (rest, DEFAULT_REV)
    if not loc or not rev or (scheme == "file" and not FILE_REV.fullmatch(rev)):
        raise RemoteError(f"{ref!r}: invalid reference (expected hf://org/repo[@rev] or file:///path[@rev])")
    if scheme == "hf" and loc.count("/") != 1:
        raise RemoteError(f"{ref!r}: expected hf://org/repo[@rev]")
    return scheme, loc, rev


def cache_root() -> Path:
    env = os.environ.get("EAGLE3_RUNTIME_CACHE")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")).expanduser() / "eagle3-runtime"


# ------------------------------------------------------------------ remotes

class FileRemote:
    def __init__(self, location: str, rev: str):
        self.root, self.rev = Path(location), rev
        self.uri = f"file://{location}@{rev}"

    def snapshot(self) -> Path:
        src = self.root / self.rev
        if not (src / MANIFEST).is_file():
            raise RemoteError(f"{self.uri}: no bundle there ({src / MANIFEST} missing); push one with "
                              "`eagle3-build push BUNDLE file://...`")
        dest = cache_root() / "file" / _slug(str(self.root.resolve())) / self.rev
        stage = dest.with_name(f".{dest.name}.fetch-{uuid.uuid4().hex[:8]}")
        # links stay links, so a link leaving the bundle is refused when the bundle is verified
        shutil.copytree(src, stage, symlinks=True, ignore=shutil.ignore_patterns(".commit_message"))
        dest.parent.mkdir(parents=True, exist_ok=True)
        old = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:8]}")
        if dest.exists():
            try:
                os.replace(dest, old)
            except OSError:
                pass
        try:
            os.replace(stage, dest)
        except OSError:  # another rank fetched it at the same moment: use theirs
            shutil.rmtree(stage, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
        return dest


class HubRemote:
    def __init__(self, repo_id: str, rev: str):
        self.repo_id, self.rev = repo_id, rev
        self.uri = f"hf://{repo_id}@{rev}"

    def put(self, files: list[tuple[str, Path]], message: str) -> str:
        from huggingface_hub import CommitOperationAdd, HfApi

        api = HfApi()
        api.create_repo(self.repo_id, exist_ok=True)
        if self.rev != DEFAULT_REV:
            api.create_branch(self.repo_id, branch=self.rev, exist_ok=True)
        ops = [CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(src)) for rel, src in files]
        info = api.create_commit(self.repo_id, operations=ops, commit_message=message, revision=self.rev)
        return info.oid

    def snapshot(self) -> Path:
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(self.repo_id, revision=self.rev))
        except Exception as e:  # network, auth, missing revision: one line with the fix
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RemoteError(f"{self.uri}: cannot download ({first}); check the name and revision, "
                              "`hf auth login`, or HF_HUB_OFFLINE") from e


def remote_for(ref: str) -> FileRemote | HubRemote:
    scheme, loc, rev = parse(ref)
    return FileRemote(loc, rev) if scheme == "file" else HubRemote(loc, rev)


def _slug(s: str) -> str:
    import hashlib

    return hashlib.sha256(s.encode()).hexdigest()[:16]


# ------------------------------------------------------------------ resolve + verify

def resolve_bundle(ref: str | os.PathLike, pins: Pins = Pins(), trust_remote_code: bool = False) -> Path:
    """A local bundle directory for `ref`; remote bundles are fetched and fully verified first."""
    if not is_remote(ref):
        return Path(ref)
    remote = remote_for(str(ref))
    local = remote.snapshot()
    verify_download(local, remote.uri, pins, trust_remote_code)
    return local


def verify_download(root: Path, uri: str, pins: Pins = Pins(), trust_remote_code: bool = False) -> None:
    """The manifest and the user's pins; for native-code graphs an explicit pin, before any graph file is
    read; then every file present and matching."""
    from .backends.registry import backend_for
    from .bundle import verify_files
    from .reader import bundle_file, read_manifest

    try:
        m = read_manifest(root, pins)
    except BundleError as e:
        raise RemoteError(f"{uri}: the fetched bundle does not verify: {e}") from e
    if backend_for(m).native_code and not pins.any and not trust_remote_code:
        signed = " or --verify-signature KEY.pub (the bundle is signed)" if (root / SIGNATURE).is_file() else ""
        raise RemoteError(f"{uri}: this bundle's graphs are native code ({m.backend}) and nothing pins it; pass "
                          f"--expect-digest sha256:{m.digest} once you have checked that digest with whoever "
                          f"built it{signed}, or --trust-remote-code")
    missing = [f.path for f in m.all_files() if not bundle_file(root, f.path).is_file()]
    if missing:
        raise RemoteError(f"{uri}: incomplete download, {len(missing)} file(s) missing (first: {missing[0]}); "
                          "the remote bundle is partial — push it again")
    try:
        verify_files(root, m)
    except BundleError as e:
        raise RemoteError(f"{uri}: the fetched bundle does not verify: {e}") from e
