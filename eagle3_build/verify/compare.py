"""The lossless check: the bundle's greedy tokens against the reference's, and when a difference is a
numerical near-tie (docs/verify.md, "The lossless check": how the tolerances were chosen)."""
from __future__ import annotations

from dataclasses import dataclass

from .reference import Reference, teacher_forced_logits

# two logits closer than NEAR_TIE_REL[dtype] * max(1, max |logit|) are a numerical tie at that dtype:
# float32 implementations differ by ~1e-6 of the logit scale; bfloat16 ones by a few percent; float16
# has an 8x finer mantissa than bfloat16
NEAR_TIE_REL: dict[str, float] = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}
_PRECISION_ORDER = ("float32", "float16", "bfloat16")  # increasingly coarse


def near_tie_tolerance(dtype: str, logit_scale: float) -> float:
    """How far apart two logits may be and still be a numerical tie at `dtype` (`logit_scale`: the
    largest |logit| of the row)."""
    return NEAR_TIE_REL.get(dtype, NEAR_TIE_REL["bfloat16"]) * max(1.0, abs(float(logit_scale)))


def coarser(a: str, b: str) -> str:
    """The less precise of two dtypes: the one whose tolerance applies when they are compared."""
    rank = {d: i for i, d in enumerate(_PRECISION_ORDER)}
    return a if rank.get(a, 2) >= rank.get(b, 2) else b


@dataclass
class PromptResult:
    """One prompt: the reference's and the bundle's greedy tokens and where they part."""

    prompt: str
    prompt_ids: list[int]
    reference_ids: list[int]
    bundle_ids: list[int]
    compared: int  # tokens checked: up to a real difference, all of them past a near-tie
    first_mismatch: int | None = None  # index into the generated tokens
    position: int | None = None  # absolute position (prompt length + first_mismatch)
    reference_token: int | None = None
    bundle_token: int | None = None
    top2_margin: float | None = None  # reference: top-1 minus top-2 logit at the first mismatch
    gap: float | None = None  # reference: logit of its token minus logit of the bundle's token
    tolerance: float | None = None
    near_tie: bool = False
    # past a near-tie the bundle's own continuation is checked against the reference teacher-forced:
    near_tie_flips: int = 0  # tokens where the bundle took a runner-up within the tolerance (the first included)
    later_mismatch: int | None = None  # a generated token after the near-tie beyond the tolerance
    later_gap: float | None = None
    later_tolerance: float | None = None
    plain_matches_reference: bool | None = None  # the bundle's --no-spec output, checked on a mismatch
    acceptance_length: float = 1.0

    @property
    def exact(self) -> bool:
        return self.first_mismatch is None

    @property
    def ok(self) -> bool:
        return self.exact or (self.near_tie and self.later_mismatch is None)


def compare(text: str, prompt_ids: list[int], ref: Reference, got: list[int], dtype: str) -> PromptResult:
    """Where the bundle's tokens `got` first part from the reference's, and whether that is a near-tie at `dtype`."""
    want = ref.ids
    i = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), None)
    if i is None and len(want) != len(got):
        i = min(len(want), len(got))  # one stopped (EOS) where the other did not
    r = PromptResult(prompt=text, prompt_ids=list(prompt_ids), reference_ids=list(want), bundle_ids=list(got),
                     compared=len(want) if i is None else i)
    if i is None:
        return r
    r.first_mismatch, r.position = i, len(prompt_ids) + i
    r.reference_token = want[i] if i < len(want) else None
    r.bundle_token = got[i] if i < len(got) else None
    if i < ref.logits.shape[0]:
        row = ref.logits[i]
        top = row.topk(2)
        r.top2_margin = float(top.values[0] - top.values[1])
        r.tolerance = near_tie_tolerance(dtype, float(row.abs().max()))
        if r.bundle_token is not None and r.reference_token is not None and 0 <= r.bundle_token < row.numel():
            r.gap = float(row[r.reference_token] - row[r.bundle_token])
            r.near_tie = r.gap <= r.tolerance
    return r  # gap None: one side stopped (EOS) where the other went on - nothing to weigh, a real mismatch


def check_continuation(model, r: PromptResult, dtype: str) -> None:
    """Past a near-tie the two continuations differ; check the bundle's own one token by token with the
    reference teacher-forced on it: every token must be the reference's argmax or within the tolerance."""
    i, n = r.first_mismatch, len(r.prompt_ids)
    r.near_tie_flips, r.compared = 1, len(r.bundle_ids)
    if len(r.bundle_ids) <= i + 1:
        return
    logits = teacher_forced_logits(model, r.prompt_ids + r.bundle_ids)[n - 1:]  # row j chose generated token j
    for j in range(i + 1, len(r.bundle_ids)):
        row, b = logits[j], r.bundle_ids[j]
        best = int(row.argmax())
        if best == b:
            continue
        gap, tol = float(row[best] - row[b]), near_tie_tolerance(dtype, float(row.abs().max()))
        if gap > tol:
            r.later_mismatch, r.later_gap, r.later_tolerance, r.compared = j, gap, tol, j
            return
        r.near_tie_flips += 1
