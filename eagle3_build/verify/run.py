"""verify_bundle: the bundle run through the runtime's Engine on a prompt set, against the reference."""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from pydantic import ValidationError

from eagle3_runtime.bundle import Bundle, BundleError
from eagle3_runtime.engine import Engine, SpecStats
from eagle3_runtime.manifest import MANIFEST, Manifest
from eagle3_runtime.speculation import SpecShape
from eagle3_runtime.reader import read_manifest

from ..errors import VerifyError
from ..files import atomic_write
from ..recipe import VerifySettings
from . import drift
from .compare import NEAR_TIE_REL, PromptResult, check_continuation, coarser, compare
from .diagnose import diagnose_draft
from .prompts import admit_prompts, encode_prompts, select_prompts
from .reference import Reference, load_reference, reference_greedy, target_location
from .report import MenuResult, VerifyReport


def verify_bundle(
    bundle_dir: str | Path,
    *,
    prompts: Sequence[str] | str | Path | None = None,
    num_prompts: int | None = None,
    max_tokens: int | None = None,
    min_acceptance_length: float | None = None,
    target_source: str | Path | None = None,
    reference_dtype: str | None = None,
    chat: bool | None = None,
    diagnose: bool | None = None,
    progress: Callable[[str], None] | None = None,
    just_built: bool = False,
    stamp_draft: bool = False,
) -> VerifyReport:
    """Verify a bundle (see the package docstring). ``None`` settings come from the recipe's ``verify``
    section recorded in the manifest (``VerifySettings``: its defaults where the recipe gave none);
    ``prompts`` is a list, a prompt file (``load_prompts``) or None for ``BUILTIN_PROMPTS``; the first
    ``num_prompts`` are used. ``chat`` (None: the recipe's ``verify.chat``) wraps each prompt as one
    user message in the bundle's chat template. ``diagnose``: None runs the diagnosis when the gate fails, True always, False never.
    ``progress(msg)`` gets one line per stage. ``just_built``: this process wrote the bundle a moment
    ago (compile), so its files are not hashed again. ``stamp_draft``: record this target and the acceptance
    measured with it in the draft's config.json (drift.py); without it, a draft stamped earlier is compared
    with this target (``report.drift``). Raises ``VerifyError`` for bad input."""
    t0 = time.perf_counter()
    say = progress or (lambda msg: None)
    root = Path(bundle_dir)
    manifest = read_bundle_manifest(root)
    reason = skip_reason(manifest)
    if reason:
        raise VerifyError(f"{root}: cannot verify here: {reason}")
    (num_prompts, max_tokens, chat, min_acceptance_length), ref_dtype = resolve_settings(
        recorded_settings(manifest), manifest.dtype, num_prompts, max_tokens, chat, min_acceptance_length,
        reference_dtype)

    texts = select_prompts(prompts, num_prompts)
    encoded = encode_prompts(texts, root, chat=chat)
    admit_prompts(manifest, texts, encoded)
    location = target_location(manifest, target_source)

    say("loading the bundle")
    try:
        bundle = Bundle(root, verify=not just_built)
    except BundleError as e:
        raise VerifyError(str(e)) from e
    engine = Engine(bundle)

    say("loading the reference target")
    model, ref_desc = load_reference(manifest, dtype=ref_dtype, location=location)
    tie_dtype = coarser(manifest.dtype, ref_dtype)

    results, refs, acc = _check_prompts(engine, model, manifest, texts, encoded, max_tokens, tie_dtype, say)
    menu = _check_menu(bundle, model, manifest, texts, encoded, refs, max_tokens, tie_dtype, say)
    profiles = [(manifest.speculation[manifest.batch_buckets[0]], acc)] + [(s, r.acceptance) for s, r in menu]
    try:
        record_acceptance(root, [(s, st) for s, st in profiles if st.num_drafts], len(texts))
    except OSError as e:  # (a read-only bundle: the runtime then assumes a prior profile)
        say(f"acceptance profile not recorded in the manifest ({e.strerror or e})")
    report = VerifyReport(bundle=str(root), reference=ref_desc, dtype=manifest.dtype, reference_dtype=ref_dtype,
                          num_speculative_tokens=manifest.num_speculative_tokens, max_tokens=max_tokens,
                          speculation="; ".join(f"batch {b}: {s.describe()}" for b, s in manifest.speculation.items()),
                          min_acceptance_length=min_acceptance_length, prompts=results, acceptance=acc,
                          menu=[r for _, r in menu])
    report.drift = check_drift(manifest, model, ref_desc, profiles, drift.settings_of(len(texts), max_tokens, chat),
                               stamp_draft and report.lossless_ok)
    if diagnose or (diagnose is None and not report.gate_ok):
        say("diagnosing the draft")
        try:
            report.diagnoses = diagnose_draft(bundle, model, [(ids, ref.ids) for ids, ref in zip(encoded, refs)],
                                              acc.per_position[0] if acc.num_drafts else None)
        except Exception as e:  # noqa: BLE001 - best effort: never hide the verdict behind a diagnosis crash
            report.diagnosis_error = f"{type(e).__name__}: {e}"
    report.seconds = time.perf_counter() - t0
    return report


def _check_prompts(engine: Engine, model, manifest: Manifest, texts, encoded, max_tokens: int, tie_dtype: str,
                   say) -> tuple[list[PromptResult], list[Reference], SpecStats]:
    """Each prompt: the reference's greedy continuation, the bundle's speculative one compared with it token
    for token (near-ties checked), plain decoding run too where they differ; the acceptance counted."""
    acc = SpecStats(manifest.num_speculative_tokens)
    results: list[PromptResult] = []
    refs: list[Reference] = []
    for i, (text, ids) in enumerate(zip(texts, encoded)):
        n = min(max_tokens, manifest.max_model_len - len(ids))
        say(f"prompt {i + 1}/{len(texts)}")
        ref = reference_greedy(model, ids, n, manifest.eos_token_ids)
        refs.append(ref)
        gen = engine.generate(ids, n, speculative=True)
        acc.add(gen.stats)
        r = compare(text, ids, ref, list(gen.token_ids), tie_dtype)
        r.acceptance_length = gen.stats.mean_acceptance_length
        if r.near_tie:
            check_continuation(model, r, tie_dtype)
        if not r.ok:
            plain = engine.generate(ids, n, speculative=False)
            r.plain_matches_reference = list(plain.token_ids) == ref.ids
        results.append(r)
    return results, refs, acc


def _check_menu(bundle: Bundle, model, manifest: Manifest, texts, encoded, refs: list[Reference], max_tokens: int,
                tie_dtype: str, say) -> list[tuple[SpecShape, MenuResult]]:
    """The first batch bucket's menu: each shape's own graphs checked the same way, its acceptance counted."""
    menu = []
    for shape in manifest.shapes(manifest.batch_buckets[0])[1:]:
        say(f"menu shape {shape.tag}")
        stats, ok, shape_engine = SpecStats(manifest.num_speculative_tokens), 0, Engine(bundle, speculation=shape.tag)
        for text, ids, ref in zip(texts, encoded, refs):
            gen = shape_engine.generate(ids, min(max_tokens, manifest.max_model_len - len(ids)))
            stats.add(gen.stats)
            r = compare(text, ids, ref, list(gen.token_ids), tie_dtype)
            if r.near_tie:
                check_continuation(model, r, tie_dtype)
            ok += r.ok
        menu.append((shape, MenuResult(shape.describe(), shape.tag, ok, len(texts), stats)))
    return menu


def check_drift(manifest: Manifest, model, reference: str, profiles: list[tuple[SpecShape, SpecStats]],
                settings: dict, stamp: bool) -> str | None:
    """Stamp the draft with this target (`stamp`), else compare it with the stamp the draft carries."""
    path = drift.draft_config(manifest)
    if path is None:
        if stamp:
            raise VerifyError("--stamp-draft: the draft the bundle was built from is not on this machine "
                              f"({(manifest.recipe.get('draft') or {}).get('path')})")
        return None
    recorded = json.loads(path.read_text()).get(drift.STAMP)
    if not stamp and not recorded:
        return None
    fp = drift.fingerprint(model.state_dict().items())
    acceptance = {s.tag: round(st.mean_acceptance_length, 4) for s, st in profiles if st.num_drafts}
    if stamp:
        drift.stamp_draft(path, fp, reference, acceptance, settings)
        return f"drift: stamped {path} with this target ({len(fp)} layer groups) and its acceptance {acceptance}"
    return drift.drift_line(recorded, fp, acceptance, settings)


def record_acceptance(root: Path, profiles: list[tuple[SpecShape, SpecStats]], prompts: int) -> None:
    """Write the acceptance profiles verify measured (each shape at the first batch bucket) into the manifest's
    build record, which the digest leaves out: "acceptance": {shape: {"reach": [P(a round accepts at least
    d + 1 drafts) per depth], "rounds", "prompts"}}, what eagle3_runtime.adaptive weighs the graph costs
    measured on the serving host with."""
    if not profiles:
        return
    path = root / MANIFEST
    raw = json.loads(path.read_text())
    recorded = raw.setdefault("build", {}).setdefault("acceptance", {})
    for shape, acc in profiles:
        recorded[shape.describe()] = {
            "reach": [round(n / acc.num_drafts, 4) for n in acc.accepted_per_position[:shape.depth]],
            "rounds": acc.num_drafts, "prompts": prompts}
    atomic_write(path, json.dumps(raw, indent=2))


def resolve_settings(settings: VerifySettings, dtype: str, num_prompts: int | None, max_tokens: int | None,
                     chat: bool | None, min_acceptance_length: float | None, reference_dtype: str | None
                     ) -> tuple[tuple[int, int, bool, float | None], str]:
    """The recipe's verify settings with the caller's overrides (None: the recipe's), checked, and the
    reference dtype (default: `dtype`, what is verified)."""
    num_prompts = settings.num_prompts if num_prompts is None else num_prompts
    max_tokens = settings.max_tokens if max_tokens is None else max_tokens
    chat = settings.chat if chat is None else chat
    if min_acceptance_length is None:
        min_acceptance_length = settings.min_acceptance_length
    if not isinstance(num_prompts, int) or num_prompts < 1:
        raise VerifyError(f"num_prompts must be at least 1, got {num_prompts!r}")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise VerifyError(f"max_tokens must be at least 1, got {max_tokens!r}")
    if min_acceptance_length is not None and not min_acceptance_length >= 1:
        raise VerifyError(f"min_acceptance_length must be >= 1 (1 = nothing accepted), got {min_acceptance_length}")
    ref_dtype = reference_dtype or dtype
    if ref_dtype not in NEAR_TIE_REL:
        raise VerifyError(f"reference dtype {ref_dtype!r}: choose one of {', '.join(NEAR_TIE_REL)}")
    return (num_prompts, max_tokens, chat, min_acceptance_length), ref_dtype


def read_bundle_manifest(bundle_dir: Path) -> Manifest:
    """The bundle's manifest (validated, digest checked), or a VerifyError saying why not."""
    if not bundle_dir.is_dir():
        raise VerifyError(f"{bundle_dir}: no such bundle directory")
    try:
        return read_manifest(bundle_dir)
    except BundleError as e:
        raise VerifyError(str(e)) from e


def recorded_settings(manifest: Manifest) -> VerifySettings:
    """The recipe's verify section as the manifest recorded it; what it lacks takes the recipe's defaults."""
    raw = manifest.recipe.get("verify") or {}
    try:
        return VerifySettings(**{k: v for k, v in dict(raw).items() if k in VerifySettings.model_fields})
    except (TypeError, ValueError, ValidationError) as e:
        raise VerifyError(f"{manifest.name}: the manifest's recipe has an unusable verify section ({raw})") from e


def skip_reason(manifest: Manifest) -> str | None:
    """Why this host cannot verify the bundle in one process (None when it can)."""
    if manifest.tp_degree != 1:
        return (f"the bundle is TP {manifest.tp_degree}; verify runs TP-1 bundles in one process (build a "
                "tp_degree 1 variant of the pair to verify the checkpoints, or run eagle3-run under torchrun)")
    from eagle3_runtime.backends.registry import backend_for

    refused = [c.detail for c in backend_for(manifest).host_checks(manifest, os.environ) if not c.ok]
    if refused:
        return f"the bundle's graphs cannot run on this host ({refused[0]})"
    return None
