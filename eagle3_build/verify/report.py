"""The verify report: the verdict of each check, its failure messages, and the plain-text, JSON and rich forms."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from eagle3_runtime.engine import SpecStats

from .compare import PromptResult
from .diagnose import CAUSES, Diagnosis
from .prompts import short


@dataclass
class MenuResult:
    """One menu shape of the first batch bucket (manifest.menu), run over the same prompts: still lossless?"""

    shape: str  # SpecShape.describe()
    tag: str
    ok: int  # prompts within the lossless check
    prompts: int
    acceptance: SpecStats

    @property
    def line(self) -> str:
        return (f"menu {self.shape} [{self.tag}]: {self.ok}/{self.prompts} prompts lossless, mean acceptance length "
                f"{self.acceptance.mean_acceptance_length:.2f}")


@dataclass
class VerifyReport:
    """What verify found for one bundle: per-prompt results, the acceptance counters, the verdict."""

    bundle: str
    reference: str  # where the reference model came from
    dtype: str  # the bundle's
    reference_dtype: str
    num_speculative_tokens: int
    max_tokens: int
    min_acceptance_length: float | None
    prompts: list[PromptResult]
    acceptance: SpecStats  # the runtime's counters, summed over the prompt set
    diagnoses: list[Diagnosis] = field(default_factory=list)
    diagnosis_error: str | None = None
    seconds: float = 0.0
    speculation: str = ""  # the shape of every batch bucket (SpecShape.describe())
    menu: list[MenuResult] = field(default_factory=list)
    drift: str | None = None  # the target against the one the draft was trained with (drift.py)
    acceptance_note: str | None = None  # why no acceptance was measured (a server without counters)
    subject: str = "bundle"  # what was verified: a bundle, or a server (verify --server)

    @property
    def too_many_near_ties(self) -> bool:
        """Two float32 implementations part at a near-tie rarely: more than half the prompts is systematic.
        (bfloat16 logits tie at one unit in the last place often, so no count applies there; every token
        past a tie is still checked, teacher-forced.)"""
        ties = sum(p.near_tie for p in self.prompts)
        return self.dtype == self.reference_dtype == "float32" and ties > 1 and ties > len(self.prompts) / 2

    @property
    def lossless_ok(self) -> bool:
        return all(p.ok for p in self.prompts) and not self.too_many_near_ties and \
            all(r.ok == r.prompts for r in self.menu)

    @property
    def gate_ok(self) -> bool:
        if self.min_acceptance_length is None:
            return True
        return self.acceptance.num_drafts > 0 and \
            self.acceptance.mean_acceptance_length >= self.min_acceptance_length

    @property
    def passed(self) -> bool:
        return self.lossless_ok and self.gate_ok

    @property
    def tokens_compared(self) -> int:
        return sum(p.compared for p in self.prompts)

    def failures(self) -> list[str]:
        """One message per failed check (empty when the bundle passed)."""
        out = []
        for i, p in enumerate(self.prompts):
            if p.ok:
                continue
            msg = (f"lossless: prompt {i} ({short(p.prompt)!r}) differs from the target's greedy output at "
                   f"generated token {p.first_mismatch} (position {p.position}): ")
            if p.near_tie and p.later_mismatch is not None:
                msg += (f"a near-tie (gap {p.gap:.3g} <= {p.tolerance:.3g}), but past it the {self.subject} picks, at "
                        "generated "
                        f"token {p.later_mismatch} (position {len(p.prompt_ids) + p.later_mismatch}), a token the "
                        f"reference (teacher-forced on the {self.subject}'s text) ranks {p.later_gap:.4g} below its best, "
                        f"more than the near-tie tolerance {p.later_tolerance:.3g}")
            elif p.gap is None:
                msg += (f"the reference generated {len(p.reference_ids)} tokens, the {self.subject} "
                        f"{len(p.bundle_ids)} (one stopped at an end-of-sequence token the other did not produce; are "
                        f"the {self.subject}'s eos_token_ids the target's?)")
            else:
                msg += (f"reference {p.reference_token}, {self.subject} {p.bundle_token}; the reference prefers its token by "
                        f"{p.gap:.4g} (top-2 margin {p.top2_margin:.4g}), more than the "
                        f"{self.reference_dtype}/{self.dtype} near-tie tolerance {p.tolerance:.3g}")
            if p.plain_matches_reference is True:
                msg += "; the bundle's plain (--no-spec) decode matches the reference, so the speculative loop " \
                       "(verify / accept / catch-up) is at fault"
            elif p.plain_matches_reference is False:
                msg += "; the bundle's plain (--no-spec) decode differs too, so the target graphs or weights " \
                       "differ from the reference model"
            out.append(msg)
        for r in self.menu:
            if r.ok != r.prompts:
                out.append(f"lossless: {r.shape} (a menu shape, its own verify / draft-step graphs) differs from the "
                           f"target's greedy output on {r.prompts - r.ok} of {r.prompts} prompts beyond a near-tie")
        if self.too_many_near_ties:
            ties = [p for p in self.prompts if p.near_tie]
            out.append(f"lossless: {len(ties)} of {len(self.prompts)} prompts part from the {self.reference_dtype} "
                       "reference at near-ties (first at generated tokens "
                       f"{', '.join(str(p.first_mismatch) for p in ties)}); one implementation in the same dtype "
                       "rarely flips even once, so the target graphs likely differ slightly from the reference "
                       "(rope, norm eps, a weight conversion)")
        if not self.gate_ok:
            acc = self.acceptance
            if acc.num_drafts == 0:
                why = self.acceptance_note or "no speculative round ran (is max_tokens at least 2?)"
                out.append(f"acceptance: {why}, so the gate min_acceptance_length {self.min_acceptance_length} "
                           "cannot be met")
            else:
                out.append(f"acceptance: mean acceptance length {acc.mean_acceptance_length:.2f} < "
                           f"min_acceptance_length {self.min_acceptance_length:g} "
                           f"(position 0 accepted {100 * acc.per_position[0]:.0f}% of "
                           f"{acc.num_drafts} drafts)\n" + self.hint())
        return out

    def hint(self) -> str:
        lines = []
        if self.diagnoses:
            for d in self.diagnoses:
                lines.append(f"  likely cause: {d.message}")
        elif self.diagnosis_error:
            lines.append(f"  (no diagnosis: {self.diagnosis_error})")
        lines.append("  usual causes: " + "; ".join(CAUSES.values()))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            self.subject: self.bundle, "passed": self.passed, "lossless_ok": self.lossless_ok,
            "gate_ok": self.gate_ok, "reference": self.reference, "dtype": self.dtype,
            "reference_dtype": self.reference_dtype, "num_speculative_tokens": self.num_speculative_tokens,
            "speculation": self.speculation,
            "max_tokens": self.max_tokens, "min_acceptance_length": self.min_acceptance_length,
            "num_prompts": len(self.prompts), "tokens_compared": self.tokens_compared,
            "spec_decoding": self.acceptance.to_dict(),
            "prompts": [dict(asdict(p), exact=p.exact, ok=p.ok) for p in self.prompts],
            "menu": [{"shape": r.shape, "tag": r.tag, "ok": r.ok, "prompts": r.prompts,
                      "spec_decoding": r.acceptance.to_dict()} for r in self.menu],
            "diagnoses": [asdict(d) for d in self.diagnoses], "diagnosis_error": self.diagnosis_error,
            "drift": self.drift, "acceptance_note": self.acceptance_note,
            "failures": self.failures(), "seconds": round(self.seconds, 2),
        }

    def format(self) -> str:
        """Plain-text block (logs, CI)."""
        n = len(self.prompts)
        exact = sum(p.exact for p in self.prompts)
        ties = sum(p.near_tie for p in self.prompts)
        lines = [(f"verify {self.bundle}: reference {self.reference} ({self.reference_dtype}), {n} prompts x "
                  f"{self.max_tokens} tokens, {self.speculation or f'K {self.num_speculative_tokens}'}"),
                 f"lossless: {exact}/{n} prompts token-for-token identical"
                 + (f", {ties} parted at a numerical near-tie (continuation checked teacher-forced)" if ties else "")
                 + f" ({self.tokens_compared} tokens compared) - {'ok' if self.lossless_ok else 'FAILED'}",
                 self.acceptance.format()] + [r.line for r in self.menu]
        if self.min_acceptance_length is None:
            lines.append("gate: none (set verify.min_acceptance_length in the recipe)")
        else:
            lines.append(f"gate: mean acceptance length {self.acceptance.mean_acceptance_length:.2f}, needs >= "
                         f"{self.min_acceptance_length:g} - {'ok' if self.gate_ok else 'FAILED'}")
        lines += self.failures() + ([self.drift] if self.drift else [])
        lines.append(f"verify: {'PASSED' if self.passed else 'FAILED'} ({self.seconds:.1f}s)")
        return "\n".join(lines)


def render_report(report: VerifyReport, console) -> None:
    """The acceptance block and verdict on a rich console."""
    from rich.table import Table

    acc = report.acceptance
    console.print(f"[bold]verify[/] {report.bundle}", highlight=False)
    console.print(f"reference: {report.reference} ({report.reference_dtype}); {report.subject} dtype {report.dtype}, "
                  f"{report.speculation or f'K {report.num_speculative_tokens}'}, {len(report.prompts)} prompts x "
                  f"{report.max_tokens} tokens",
                  highlight=False, soft_wrap=True)
    t = Table(title="lossless check (speculative greedy vs the target's greedy generate)", title_justify="left")
    for c in ("#", "prompt", "tokens", "result", "first diff", "margin", "τ"):
        t.add_column(c, overflow="fold")
    for i, p in enumerate(report.prompts):
        if p.exact:
            res, diff, margin = "[green]identical[/]", "", ""
        elif p.ok:
            res, diff = "[yellow]near-tie[/]", f"{p.first_mismatch} (pos {p.position})"
            margin = f"{p.gap:.3g} ≤ {p.tolerance:.3g}" + (f", {p.near_tie_flips} flips" if p.near_tie_flips > 1 else "")
        elif p.later_mismatch is not None:
            res, diff = "[red]DIFFERS[/]", f"{p.later_mismatch} (pos {len(p.prompt_ids) + p.later_mismatch})"
            margin = f"{p.later_gap:.3g} > {p.later_tolerance:.3g}"
        else:
            res, diff = "[red]DIFFERS[/]", f"{p.first_mismatch} (pos {p.position})"
            margin = "length" if p.gap is None else f"{p.gap:.3g} > {p.tolerance:.3g}"
        t.add_row(str(i), short(p.prompt, 36), str(len(p.reference_ids)), res, diff, margin,
                  f"{p.acceptance_length:.2f}")
    console.print(t)
    n, exact = len(report.prompts), sum(p.exact for p in report.prompts)
    ties = sum(p.near_tie and p.ok for p in report.prompts)
    console.print(f"lossless: {exact}/{n} prompts token-for-token identical"
                  + (f", {ties} parted at a numerical near-tie and stayed within it (checked teacher-forced)"
                     if ties else "") + f"; {report.tokens_compared} tokens compared: "
                  + ("[green]ok[/]" if report.lossless_ok else "[red]FAILED[/]"), highlight=False, soft_wrap=True)
    a = Table(title="acceptance", title_justify="left")
    for c in ("drafts", "drafted", "accepted", "rate", "mean length"):
        a.add_column(c)
    a.add_row(str(acc.num_drafts), str(acc.num_draft_tokens), str(acc.num_accepted_tokens),
              f"{100 * acc.acceptance_rate:.1f}%", f"{acc.mean_acceptance_length:.2f}")
    console.print(a)
    for i, r in enumerate(acc.per_position):
        bar = "█" * round(30 * r)
        console.print(f"  position {i}: {100 * r:5.1f}%  {bar}", highlight=False)
    console.print(acc.format(), highlight=False, soft_wrap=True)
    for r in report.menu:
        console.print(r.line, highlight=False, soft_wrap=True, markup=False)
    if report.min_acceptance_length is None:
        console.print("gate: none (set verify.min_acceptance_length in the recipe)")
    else:
        ok = "[green]ok[/]" if report.gate_ok else "[red]FAILED[/]"
        console.print(f"gate: mean acceptance length {acc.mean_acceptance_length:.2f}, needs ≥ "
                      f"{report.min_acceptance_length:g}: {ok}")
    for f in report.failures():
        console.print(f"[red]✗[/] {f}", highlight=False, soft_wrap=True)
    if report.drift:
        console.print(report.drift, highlight=False, soft_wrap=True, markup=False)
    if report.passed and report.diagnoses:
        for d in report.diagnoses:
            console.print(f"note: {d.message}", highlight=False, soft_wrap=True)
    verdict = "[bold green]PASSED[/]" if report.passed else "[bold red]FAILED[/]"
    console.print(f"verify: {verdict} ({report.tokens_compared} tokens compared, {report.seconds:.1f}s)")
