"""eagle3-build verify: is a bundle lossless, and does its draft earn its keep?

``verify_bundle(BUNDLE)`` runs the bundle through the runtime's ``Engine`` (the path users serve) on a
deterministic prompt set and checks three things:

(a) **lossless** (``compare``): the speculative greedy output equals transformers' greedy ``generate()``
    of the target alone (``reference``) token for token. A difference passes only as a numerical
    near-tie: the reference's logit gap between its token and the bundle's is within
    ``near_tie_tolerance`` of the less precise dtype, and every later token of the bundle's own
    continuation, checked with the reference teacher-forced on it, is too. When both sides run float32
    and more than half of the prompts part at near-ties, the check fails anyway (systematic error).
(b) **acceptance**: vLLM's acceptance block (mean acceptance length, rate, per position).
(c) **gate**: fails when the mean acceptance length is below ``min_acceptance_length``, with the usual
    causes and, when ``diagnose_draft`` finds one, the likely one.

Modules: ``prompts`` (built-in set, files, admission), ``reference``, ``compare``, ``diagnose``,
``report`` (VerifyReport, render_report), ``run`` (verify_bundle). ``run_verify`` lives here so that
it calls this package's ``verify_bundle`` (what tests replace). How the tolerances were measured:
docs/verify.md. The runtime never imports this package (it needs transformers).
"""
from __future__ import annotations

from pathlib import Path

from eagle3_runtime.tp import set_threads

from ..errors import UserError, VerifyError
from .compare import NEAR_TIE_REL, PromptResult, near_tie_tolerance
from .diagnose import CAUSES, Diagnosis, diagnose_draft
from .prompts import BUILTIN_PROMPTS, load_prompts
from .reference import load_reference
from .report import VerifyReport, render_report
from .run import read_bundle_manifest, recorded_settings, skip_reason, verify_bundle

__all__ = [
    "BUILTIN_PROMPTS",
    "CAUSES",
    "NEAR_TIE_REL",
    "Diagnosis",
    "PromptResult",
    "VerifyError",
    "VerifyReport",
    "diagnose_draft",
    "load_prompts",
    "load_reference",
    "near_tie_tolerance",
    "render_report",
    "run_verify",
    "skip_reason",
    "verify_bundle",
]


def run_verify(bundle_dir: str | Path, console, pair=None, **overrides) -> bool:
    """What ``compile`` calls after building a bundle: verify it with the pair's ``verify`` settings
    (``pair`` a PairRecipe, else the manifest's recipe; ``overrides`` go to ``verify_bundle``), print
    the block on ``console``, and return True when it passed or was skipped (verify.num_prompts 0, a
    TP or Neuron bundle this host cannot run in one process), False when it failed (or could not run)."""
    manifest = read_bundle_manifest(Path(bundle_dir))
    settings = pair.verify if pair is not None else recorded_settings(manifest)
    if settings.num_prompts == 0:
        console.print("verify: skipped (verify.num_prompts is 0)")
        return True
    reason = skip_reason(manifest)
    if reason:
        console.print(f"verify: skipped — {reason}", highlight=False, soft_wrap=True)
        return True
    kw = {"num_prompts": settings.num_prompts, "max_tokens": settings.max_tokens,
          "min_acceptance_length": settings.min_acceptance_length, **overrides}
    set_threads()  # as eagle3-run would serve it (an in-process compile leaves torch at 1 thread)
    try:
        report = verify_bundle(bundle_dir, **kw)
    except UserError as e:
        console.print(f"[bold red]verify:[/] {e}", highlight=False, soft_wrap=True)
        return False
    render_report(report, console)
    return report.passed
