"""A bundle on disk: manifest.json read (size-capped, schema-checked, against the user's pins), every file
it names checked to stay inside the bundle and to match its sha256, weight files' headers read as data."""
from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import ValidationError

from .manifest import (MANIFEST, SAFETENSORS_CODES, SCHEMA_VERSION, BundleError, FileEntry, Manifest, SchemaError,
                       TensorSpec, bundle_relpath, digest_of, sha256_file)
from .trust import Pins, check_pins

MAX_MANIFEST_BYTES = 16 << 20  # a seed system's manifest is well under 1 MiB


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
    """The manifest: its digest checked on the JSON as read, then the user's pins (digest, signature),
    then validated as data (every size capped before any per-element work)."""
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
    if not isinstance(raw, dict):
        raise BundleError(f"{path}: not a manifest (a JSON object); the bundle is corrupt, rebuild it")
    version = raw.get("schema_version")
    if version != SCHEMA_VERSION:
        raise SchemaError(f"{path}: manifest schema version {version!r}, this runtime reads version "
                          f"{SCHEMA_VERSION}; rebuild the bundle with a matching eagle3-build or use a "
                          "matching runtime")
    digest = raw.get("digest")
    if not digest or not isinstance(digest, str):
        raise BundleError(f"{path}: the manifest has no digest; every bundle eagle3-build writes has one — "
                          "rebuild it")
    if digest_of(raw) != digest:
        raise BundleError(f"{root}: {MANIFEST} was modified after the build (its content no longer matches the "
                          f"bundle digest {digest[:12]}…); rebuild or re-download the bundle")
    check_pins(root, digest, pins)
    try:
        m = Manifest.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise BundleError(f"{path}: invalid manifest{' at ' + loc if loc else ''}: {first['msg']}; "
                          "rebuild the bundle") from e
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


MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


def check_weight_header(path: Path, tensors: dict[str, TensorSpec], what: str) -> None:
    """A rank's safetensors file holds exactly the manifest's tensors, with their shapes and dtypes
    (read from the header alone: nothing is mapped)."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 2 <= n <= MAX_HEADER_BYTES:
                raise ValueError(f"header length {n}")
            header = json.loads(f.read(n))
        have = {k: (v["dtype"], list(v["shape"])) for k, v in header.items() if k != "__metadata__"}
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
        raise BundleError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e}); rebuild the "
                          "bundle") from e
    want = {k: (SAFETENSORS_CODES[t.dtype], t.shape) for k, t in tensors.items()}
    if have != want:
        bad = sorted(set(have) ^ set(want)) or sorted(k for k in want if have[k] != want[k])
        k = bad[0]
        raise BundleError(f"{path}: tensor {k!r} is {have.get(k, 'missing')} in the file, {want.get(k, 'not listed')} "
                          f"in the manifest ({what}.tensors); the manifest does not describe these weights — "
                          "rebuild the bundle")
