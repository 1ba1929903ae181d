"""A bundle on disk: manifest.json read (size-capped, schema-checked, against the user's pins) and every
file it names checked to stay inside the bundle and to match its sha256."""
from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import ValidationError

from .manifest import MANIFEST, SCHEMA_VERSION, BundleError, FileEntry, Manifest, SchemaError, bundle_relpath, sha256_file
from .trust import Pins, check_pins



MAX_MANIFEST_BYTES = 64 << 20


def allowed_roots(root: Path) -> list[Path]:
    """Where a bundle's files may really live: inside the bundle, or, for a huggingface_hub snapshot
    (<cache>/models--org--repo/snapshots/<commit>/, whose files are links to ../../blobs/), that repo's blobs."""
    real = Path(os.path.realpath(root))
    out = [real]
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        out.append(Path(os.path.realpath(root.parent.parent / "blobs")))
    return out


def bundle_file(root: Path, rel: str) -> Path:
    """`root/rel`, refused unless `rel` is a plain relative path that resolves (links followed) inside the bundle."""
    try:
        bundle_relpath(rel)
    except ValueError as e:
        raise BundleError(f"{root}: manifest entry {rel!r} points outside the bundle; refusing it") from e
    path = Path(root) / rel
    real = Path(os.path.realpath(path))
    if not any(real.is_relative_to(a) for a in allowed_roots(Path(root))):
        raise BundleError(f"{root}: {rel} is a link that leaves the bundle (to {real}); refusing it")
    return path


def read_manifest(root: Path, pins: Pins = Pins()) -> Manifest:
    """The manifest, validated as data, its digest checked, and the user's pins (digest, signature) checked."""
    root = Path(root)
    path = bundle_file(root, MANIFEST)
    if not path.is_file():
        raise BundleError(f"{root}: no {MANIFEST}; not a bundle (build one with `eagle3-build compile RECIPE`)")
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise BundleError(f"{path}: {path.stat().st_size} bytes, more than any manifest ({MAX_MANIFEST_BYTES}); "
                          "not a bundle")
    try:
        raw = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:
        raise BundleError(f"{path}: not valid JSON ({type(e).__name__}); the bundle is corrupt, rebuild it") from e
    version = raw.get("schema_version") if isinstance(raw, dict) else None
    if version != SCHEMA_VERSION:
        raise SchemaError(f"{path}: manifest schema version {version!r}, this runtime reads version "
                          f"{SCHEMA_VERSION}; rebuild the bundle with a matching eagle3-build or use a "
                          "matching runtime")
    try:
        m = Manifest.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise BundleError(f"{path}: invalid manifest{' at ' + loc if loc else ''}: {first['msg']}; "
                          "rebuild the bundle") from e
    if not m.digest:
        raise BundleError(f"{path}: the manifest has no digest; every bundle eagle3-build writes has one — "
                          "rebuild it")
    if m.compute_digest() != m.digest:
        raise BundleError(f"{root}: {MANIFEST} was modified after the build (its content no longer matches the "
                          f"bundle digest {m.digest[:12]}…); rebuild or re-download the bundle")
    check_pins(root, m.digest, pins)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if m.backend != "neuron" and m.state_bytes() > memory:  # (Neuron: the caches live on the device)
        raise BundleError(f"{path}: the KV caches need {m.state_bytes() / 2**30:.1f} GiB, more than this host's "
                          f"{memory / 2**30:.1f} GiB; rebuild with a smaller max_model_len / max_num_seqs")
    return m


def check_file(root: Path, entry: FileEntry) -> Path:
    """Present, confined, with the recorded size and sha256."""
    path = bundle_file(root, entry.path)
    if not path.is_file():
        raise BundleError(f"{root}: {entry.path} is missing; the bundle is incomplete — rebuild or re-download it")
    if path.stat().st_size != entry.size or sha256_file(path) != entry.sha256:
        raise BundleError(f"{root}: {entry.path} is corrupt (does not match the sha256 and size in the manifest); "
                          "rebuild or re-download the bundle")
    return path


def verify_files(root: Path, manifest: Manifest, rank: int | None = None) -> None:
    """Every file (of one rank's weights only, when `rank` is given) against the manifest; export graphs are
    also checked to hold nothing but a static operator graph (safe_pt2.py)."""
    from .safe_pt2 import UnsafeArchive, check_archive

    others = set()
    if rank is not None:
        others = {f.path for m in manifest.models.values() for r, f in enumerate(m.weight_files) if r != rank}
    graphs = {g.file.path for g in manifest.graphs} if manifest.backend == "export" else set()
    for entry in manifest.all_files():
        if entry.path in others:
            continue
        path = check_file(root, entry)
        if entry.path in graphs:
            try:
                check_archive(path.read_bytes(), f"{root}/{entry.path}")
            except UnsafeArchive as e:
                raise BundleError(f"{e}; refusing to load it") from e
