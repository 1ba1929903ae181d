"""Target drift: a draft trained against one target loses acceptance on a fine-tuned one, silently.

`verify --stamp-draft` records in the draft's config.json (key STAMP) the target it ran against: a digest
per layer group of the weights (so a changed layer can be named) and the acceptance length it measured
per speculation shape, with the prompt settings. Every later `verify` of a bundle with that draft
compares both with its own target and measurement, in one line.
"""
from __future__ import annotations

import datetime
import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import torch

from ..errors import VerifyError
from ..files import atomic_write

STAMP = "eagle3_build_target"
TOLERANCE = 0.05  # relative acceptance change reported as noise, not drift


def group(name: str) -> str:
    """The layer group of a weight name: `layers.N` for decoder layers, else its first component."""
    parts = name.removeprefix("model.").split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" and len(parts) > 1 else parts[0]


def fingerprint(tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """sha256 (16 hex digits) per layer group over each weight's name, shape and float32 values: the same
    for one set of weights however it was stored (HF names with or without `model.`, any float dtype that
    float32 holds exactly)."""
    hashes: dict[str, hashlib._Hash] = {}
    for name, t in sorted((n.removeprefix("model."), t) for n, t in tensors):
        h = hashes.setdefault(group(name), hashlib.sha256())
        h.update(f"{name}{tuple(t.shape)}".encode())
        h.update(t.detach().to(torch.float32).contiguous().cpu().numpy())
    return {g: h.hexdigest()[:16] for g, h in sorted(hashes.items())}


def draft_config(manifest) -> Path | None:
    """The draft's config.json the bundle was built from, when it is on this machine."""
    path = (manifest.recipe.get("draft") or {}).get("path")
    p = Path(path) / "config.json" if path else None
    return p if p is not None and p.is_file() else None


def settings_of(prompts: int, max_tokens: int, chat: bool) -> dict:
    return {"prompts": prompts, "max_tokens": max_tokens, "chat": chat}


def stamp_draft(path: Path, fp: dict[str, str], reference: str, acceptance: dict[str, float], settings: dict) -> None:
    """Write STAMP into the draft's config.json (the rest of the file kept as it is)."""
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise VerifyError(f"--stamp-draft: cannot read {path}: {e}") from e
    cfg[STAMP] = {"reference": reference, "fingerprint": fp, "acceptance": acceptance, "settings": settings,
                  "stamped": datetime.date.today().isoformat()}
    try:
        atomic_write(path, json.dumps(cfg, indent=2) + "\n")
    except OSError as e:
        raise VerifyError(f"--stamp-draft: cannot write {path}: {e}") from e


def drift_line(stamp: dict, fp: dict[str, str], acceptance: dict[str, float], settings: dict) -> str:
    """One line: whether the target differs from the stamped one (which layer groups) and how acceptance moved."""
    old_fp = stamp.get("fingerprint") or {}
    common = [g for g in old_fp if g in fp]
    changed = [g for g in common if old_fp[g] != fp[g]]
    shared = [t for t in acceptance if t in (stamp.get("acceptance") or {})]
    if not shared:
        moved = "no shape in common to compare acceptance"
    elif stamp.get("settings") != settings:
        moved = f"acceptance not compared (stamped with {stamp.get('settings')}, this run {settings})"
    else:
        tag = shared[0]
        was, now = stamp["acceptance"][tag], acceptance[tag]
        moved = f"acceptance length {now:.2f} vs {was:.2f} with the draft's own target ({tag}, {100 * (now / was - 1):+.0f}%)"
    if not common:
        return f"drift: the stamped target shares no layer group with this one; {moved}"
    if changed:
        names = ", ".join(changed[:4]) + (", ..." if len(changed) > 4 else "")
        return (f"drift: DIFFERENT target: {len(changed)} of {len(common)} layer groups differ from the target the "
                f"draft was trained against ({names}); {moved}")
    return f"drift: none, the target the draft was trained against ({len(common)} layer groups identical); {moved}"
