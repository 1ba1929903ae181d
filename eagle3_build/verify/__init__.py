"""eagle3-build verify: is a bundle lossless, and does its draft earn its keep?

``verify_bundle(BUNDLE)`` runs the bundle through the runtime's ``Engine`` (the path users serve) on a
deterministic prompt set and checks three things:

(a) **lossless**: the speculative greedy output equals transformers' greedy ``generate()`` of the
    target alone (loaded from the source recorded in the manifest, or ``target_source``) token for
    token. On a mismatch it reports the first differing position, the reference's top-2 logit margin
    there and the reference's logit gap between its token and the bundle's. The mismatch is a
    *numerical near-tie* - and passes - only when that gap is within ``near_tie_tolerance``:
    ``NEAR_TIE_REL[dtype] * max(1, max |logit|)`` for the less precise of the bundle's and the
    reference's dtype. float32 1e-4: two float32 implementations differ by ~1e-6 of the logit scale.
    bfloat16 5e-2: measured on SmolLM2-135M (8 prompts, ~300 positions), our bf16 target and
    transformers' bf16 differ by up to 3.7% of the largest logit and never disagree on the argmax;
    transformers bf16 vs float32 differ by up to 7% and disagree on 9 positions, all with gaps under
    0.6%. float16 1e-2 (8x finer mantissa than bfloat16). The comparison of that prompt stops there
    (the two continuations legitimately diverge). Same-dtype runs rarely flip at all, so when more
    than half of the prompts part at "near-ties" with the reference in the bundle's own dtype, the
    check fails anyway (a small systematic error such as a rope or norm-eps slip looks like that).
    The reference runs in the bundle's dtype (``reference_dtype`` overrides): only a float32
    reference of a float32 bundle is exact to the last bit; a bfloat16 bundle against a float32
    reference parts at the first near-tie of most prompts, which the tolerance absorbs.
(b) **acceptance**: vLLM's acceptance block (mean acceptance length, rate, per position) over the
    prompt set.
(c) **gate**: fails when the mean acceptance length is below ``min_acceptance_length`` (the recipe's
    ``verify.min_acceptance_length`` unless overridden), listing the usual causes and - when a cheap
    diagnosis finds one - the likely one. The diagnosis reads the bundle's draft weights and runs the
    draft eagerly on the target's hidden states (transformers, the reference sequences): d2t that is
    the identity over a reduced vocab, an fc that is all zero, a draft lm_head equal to the target's,
    aux layer ids or norm_before_residual whose neighbouring value would make the draft far better,
    proposals that are rarely among the target's top 10 (lm_head / d2t), or a bundle whose draft
    graphs do worse than the same weights run eagerly (a build bug).

The runtime never imports this module (it needs transformers); ``eagle3-build verify`` and
``compile`` do.
"""
from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3_runtime.engine import SpecStats

from ..errors import UserError

__all__ = [
    "BUILTIN_PROMPTS",
    "CAUSES",
    "NEAR_TIE_REL",
    "Diagnosis",
    "PromptResult",
    "VerifyError",
    "VerifyReport",
    "load_prompts",
    "near_tie_tolerance",
    "render_report",
    "run_verify",
    "skip_reason",
    "verify_bundle",
]


class VerifyError(UserError):
    """Bad input to verify (bundle, prompts, target source): exit 2, no traceback."""


# A fixed, varied prompt set: prose, instructions, questions, code, lists, numbers. The first few are
# the most varied, since a recipe usually verifies on 4. Short enough for a 64-token prefill bucket.
BUILTIN_PROMPTS: tuple[str, ...] = (
    "The quick brown fox",
    "Explain in two sentences why the sky is blue.",
    "def fibonacci(n):\n    ",
    "1, 2, 3, 4, 5,",
    "Once upon a time, in a land far away, there lived a",
    "Write a short poem about the sea.",
    "What is the capital of France?",
    "The weather this morning was",
    "Here is a list of three fruits:",
    "import numpy as np\n\nx =",
    "Translate to French: Good morning, how are you?",
    "Compilers turn programs into",
    "The meeting is scheduled for",
    "Give me three tips for learning a new language.",
    "She opened the door and",
    "for i in range(10):\n    print(",
    "Summarize the plot of Romeo and Juliet.",
    "The best way to cook rice is",
    "Q: What is 12 times 7?\nA:",
    "A recipe for pancakes:",
    "In the year 2050, cities will",
    "Why do cats purr?",
    "The history of the printing press",
    "SELECT name, age FROM users WHERE",
    "Dear team, I am writing to",
    "How does a rainbow form?",
    "The three primary colors are",
    "My favourite book is",
    "List the planets of the solar system.",
    "Speculative decoding lets a small draft model",
    "The train left the station at",
    "Describe a cat to someone who has never seen one.",
)

NEAR_TIE_REL: dict[str, float] = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}
_PRECISION_ORDER = ("float32", "float16", "bfloat16")  # increasingly coarse

# the usual causes of collapsed acceptance (REFERENCE §2, last paragraph)
CAUSES: dict[str, str] = {
    "d2t": "d2t missing or misread (draft ids read as the first Vd target ids, or offsets taken as ids)",
    "lm_head": "draft lm_head replaced (by the target's lm_head, or left random)",
    "fc": "fc skipped or zeroed (the draft never sees the target's hidden states)",
    "aux_ids": "aux layer ids shifted (SpecForge ids are output-of-layer k = input of layer k+1; "
               "speculators/vLLM ids are input-of-layer)",
    "norm_before_residual": "wrong norm_before_residual (speculators drafts default to true, "
                            "EAGLE/SpecForge to false)",
}
_TOP_K = 10


def near_tie_tolerance(dtype: str, logit_scale: float) -> float:
    """How far apart two logits may be and still be a numerical tie at `dtype` (`logit_scale`: the
    largest |logit| of the row)."""
    return NEAR_TIE_REL.get(dtype, NEAR_TIE_REL["bfloat16"]) * max(1.0, abs(float(logit_scale)))


def _coarser(a: str, b: str) -> str:
    rank = {d: i for i, d in enumerate(_PRECISION_ORDER)}
    return a if rank.get(a, 2) >= rank.get(b, 2) else b


# ------------------------------------------------------------------------------------------ results


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


@dataclass
class Diagnosis:
    """A likely cause of low acceptance, with what was measured."""

    cause: str  # a key of CAUSES, or "graphs" / "draft"
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass
class VerifyReport:
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

    @property
    def too_many_near_ties(self) -> bool:
        """Two float32 implementations part at a near-tie rarely: more than half the prompts is systematic.
        (bfloat16 logits tie at one unit in the last place often: 9 of 20 SmolLM2 prompts part within 32
        tokens, so no count applies there; every token past a tie is still checked, teacher-forced.)"""
        ties = sum(p.near_tie for p in self.prompts)
        return self.dtype == self.reference_dtype == "float32" and ties > 1 and ties > len(self.prompts) / 2

    @property
    def lossless_ok(self) -> bool:
        return all(p.ok for p in self.prompts) and not self.too_many_near_ties

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
            msg = (f"lossless: prompt {i} ({_short(p.prompt)!r}) differs from the target's greedy output at "
                   f"generated token {p.first_mismatch} (position {p.position}): ")
            if p.near_tie and p.later_mismatch is not None:
                msg += (f"a near-tie (gap {p.gap:.3g} <= {p.tolerance:.3g}), but past it the bundle picks, at generated "
                        f"token {p.later_mismatch} (position {len(p.prompt_ids) + p.later_mismatch}), a token the "
                        f"reference (teacher-forced on the bundle's text) ranks {p.later_gap:.4g} below its best, "
                        f"more than the near-tie tolerance {p.later_tolerance:.3g}")
            elif p.gap is None:
                msg += (f"the reference generated {len(p.reference_ids)} tokens, the bundle {len(p.bundle_ids)} "
                        "(one stopped at an end-of-sequence token the other did not produce; are the bundle's "
                        "eos_token_ids the target's?)")
            else:
                msg += (f"reference {p.reference_token}, bundle {p.bundle_token}; the reference prefers its token by "
                        f"{p.gap:.4g} (top-2 margin {p.top2_margin:.4g}), more than the "
                        f"{self.reference_dtype}/{self.dtype} near-tie tolerance {p.tolerance:.3g}")
            if p.plain_matches_reference is True:
                msg += "; the bundle's plain (--no-spec) decode matches the reference, so the speculative loop " \
                       "(verify / accept / catch-up) is at fault"
            elif p.plain_matches_reference is False:
                msg += "; the bundle's plain (--no-spec) decode differs too, so the target graphs or weights " \
                       "differ from the reference model"
            out.append(msg)
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
                out.append("acceptance: no speculative round ran (is max_tokens at least 2?), so the gate "
                           f"min_acceptance_length {self.min_acceptance_length} cannot be met")
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
            "bundle": self.bundle, "passed": self.passed, "lossless_ok": self.lossless_ok,
            "gate_ok": self.gate_ok, "reference": self.reference, "dtype": self.dtype,
            "reference_dtype": self.reference_dtype, "num_speculative_tokens": self.num_speculative_tokens,
            "max_tokens": self.max_tokens, "min_acceptance_length": self.min_acceptance_length,
            "num_prompts": len(self.prompts), "tokens_compared": self.tokens_compared,
            "spec_decoding": self.acceptance.to_dict(),
            "prompts": [dict(asdict(p), exact=p.exact, ok=p.ok) for p in self.prompts],
            "diagnoses": [asdict(d) for d in self.diagnoses], "diagnosis_error": self.diagnosis_error,
            "failures": self.failures(), "seconds": round(self.seconds, 2),
        }

    def format(self) -> str:
        """Plain-text block (logs, CI)."""
        n = len(self.prompts)
        exact = sum(p.exact for p in self.prompts)
        ties = sum(p.near_tie for p in self.prompts)
        lines = [(f"verify {self.bundle}: reference {self.reference} ({self.reference_dtype}), {n} prompts x "
                  f"{self.max_tokens} tokens, K {self.num_speculative_tokens}"),
                 f"lossless: {exact}/{n} prompts token-for-token identical"
                 + (f", {ties} parted at a numerical near-tie (continuation checked teacher-forced)" if ties else "")
                 + f" ({self.tokens_compared} tokens compared) - {'ok' if self.lossless_ok else 'FAILED'}",
                 self.acceptance.format()]
        if self.min_acceptance_length is None:
            lines.append("gate: none (set verify.min_acceptance_length in the recipe)")
        else:
            lines.append(f"gate: mean acceptance length {self.acceptance.mean_acceptance_length:.2f}, needs >= "
                         f"{self.min_acceptance_length:g} - {'ok' if self.gate_ok else 'FAILED'}")
        lines += self.failures()
        lines.append(f"verify: {'PASSED' if self.passed else 'FAILED'} ({self.seconds:.1f}s)")
        return "\n".join(lines)


def _short(s: str, n: int = 40) -> str:
    s = s.replace("\n", "\\n")
    return s if len(s) <= n else s[:n - 1] + "…"


# ------------------------------------------------------------------------------------------ inputs


def load_prompts(path: str | Path) -> list[str]:
    """Prompts from a file: a JSON list of strings (.json), one JSON string or {"prompt": ...} per line
    (.jsonl), or one prompt per non-empty line (anything else; ``\\n`` stays literal)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise VerifyError(f"--prompts {path}: cannot read it ({e.__class__.__name__}: {e})") from e
    prompts: list[str] = []
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise VerifyError(f"--prompts {path}: invalid JSON ({e})") from e
        if not isinstance(data, list) or not all(isinstance(x, str) for x in data):
            raise VerifyError(f"--prompts {path}: a .json prompt file must hold a list of strings")
        prompts = list(data)
    elif path.suffix == ".jsonl":
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                x = json.loads(line)
            except json.JSONDecodeError as e:
                raise VerifyError(f"--prompts {path}:{i}: invalid JSON ({e})") from e
            if isinstance(x, dict):
                x = x.get("prompt")
            if not isinstance(x, str):
                raise VerifyError(f"--prompts {path}:{i}: expected a string or an object with a \"prompt\" string")
            prompts.append(x)
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise VerifyError(f"--prompts {path}: no prompts in the file")
    return prompts


def skip_reason(manifest) -> str | None:
    """Why this host cannot verify the bundle in one process (None when it can)."""
    if manifest.tp_degree != 1:
        return (f"the bundle is TP {manifest.tp_degree}; verify runs TP-1 bundles in one process (build a "
                "tp_degree 1 variant of the pair to verify the checkpoints, or run eagle3-run under torchrun)")
    if manifest.backend == "neuron":
        try:
            from eagle3_runtime.neuron import NeuronHostError, check_host

            check_host(manifest)
        except ImportError:
            return "the bundle's graphs are NEFFs and this runtime has no Neuron loader"
        except NeuronHostError as e:
            return f"the bundle's graphs are NEFFs and this host cannot run them ({e})"
    return None


def _read_manifest(bundle_dir: Path):
    from eagle3_runtime.bundle import BundleError
    from eagle3_runtime.reader import read_manifest

    if not bundle_dir.is_dir():
        raise VerifyError(f"{bundle_dir}: no such bundle directory")
    try:
        return read_manifest(bundle_dir)
    except BundleError as e:
        raise VerifyError(str(e)) from e


# --------------------------------------------------------------------------------- reference model


def _target_location(manifest, target_source: str | Path | None) -> tuple[Path, str | None, str]:
    """-> (directory, gguf file name or None, description) of the target to load with transformers."""
    if target_source is not None:
        p = Path(target_source).expanduser().resolve()
        if p.is_file() and p.suffix == ".gguf":
            return p.parent, p.name, str(p)
        if p.is_dir() and (p / "config.json").exists():
            return p, None, str(p)
        raise VerifyError(f"--target {target_source}: not a checkpoint directory with config.json nor a .gguf file")
    from ..checkpoints.sources import resolve
    from ..recipe import SourceSpec

    raw = dict(manifest.recipe.get("target") or {})
    try:
        spec = SourceSpec(**raw)
    except (TypeError, ValueError) as e:
        raise VerifyError(f"{manifest.name}: the manifest records no usable target source; pass --target PATH") from e
    resolved = (manifest.sources.get("target") or {}).get("resolved_revision")
    if spec.kind == "hf" and resolved:
        spec = spec.model_copy(update={"revision": resolved})
    if spec.kind in ("local", "gguf") and not Path(spec.path or "").exists():
        raise VerifyError(f"the bundle's target source {spec.uri} ({spec.path}) is not on this machine; pass "
                          "--target PATH (a local HF directory or .gguf of the same target)")
    try:
        src = resolve(spec, "target")
    except UserError as e:
        raise VerifyError(f"{e}; or pass --target PATH") from e
    desc = spec.uri + (f"@{resolved[:12]}" if spec.kind == "hf" and resolved else "")
    return src.directory, src.gguf_file, desc


def load_reference(manifest, target_source=None, dtype: str | None = None, location=None):
    """-> (transformers causal LM in eval mode, description). `location`: a `_target_location` result."""
    from transformers import AutoModelForCausalLM

    directory, gguf_file, desc = location or _target_location(manifest, target_source)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        dtype or manifest.dtype]
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype, **kw)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for checkpoints it cannot load
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise VerifyError(f"target {desc}: transformers cannot load it as the reference: {first}") from e
    if hasattr(model, "set_experts_implementation"):  # GPT-OSS on CPU: only the eager experts run
        with contextlib.suppress(Exception):  # a model without experts has nothing to switch
            model.set_experts_implementation("eager")
    model.eval()
    return model, f"transformers {type(model).__name__} from {desc}"


@dataclass
class _Ref:
    ids: list[int]
    logits: torch.Tensor  # [n, V] float32, the logits each reference token was chosen from


@torch.inference_mode()
def _reference_greedy(model, prompt_ids: list[int], n: int, eos_ids: list[int]) -> _Ref:
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=0, do_sample=False, num_beams=1,
                           eos_token_id=list(eos_ids) or None, pad_token_id=eos_ids[0] if eos_ids else 0,
                           output_logits=True, return_dict_in_generate=True)
    saved = model.generation_config
    model.generation_config = cfg  # no processor of the model's own defaults (repetition penalty, ...)
    try:
        x = torch.tensor([prompt_ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg)
    finally:
        model.generation_config = saved
    ids = out.sequences[0, len(prompt_ids):].tolist()
    logits = torch.cat([s.float() for s in out.logits], 0)[: len(ids)]
    return _Ref(ids, logits)


# ------------------------------------------------------------------------------------------ verify


def verify_bundle(
    bundle_dir: str | Path,
    *,
    prompts: Sequence[str] | str | Path | None = None,
    num_prompts: int | None = None,
    max_tokens: int | None = None,
    min_acceptance_length: float | None = None,
    target_source: str | Path | None = None,
    reference_dtype: str | None = None,
    chat: bool = False,
    diagnose: bool | None = None,
    progress=None,
) -> VerifyReport:
    """Verify a bundle (see the module docstring). ``None`` settings come from the manifest's recipe
    (``verify: {num_prompts, max_tokens, min_acceptance_length}``); ``prompts`` is a list, a prompt
    file (``load_prompts``) or None for ``BUILTIN_PROMPTS``; the first ``num_prompts`` are used.
    ``chat`` wraps each prompt as one user message in the bundle's chat template. ``diagnose``:
    None runs the diagnosis when the gate fails, True always, False never. ``progress(msg)`` gets
    one line per stage. Raises ``VerifyError`` for bad input."""
    from eagle3_runtime.bundle import Bundle, BundleError
    from eagle3_runtime.engine import Engine, RequestError
    from eagle3_runtime.tokenizer import BundleTokenizer

    t0 = time.perf_counter()
    say = progress or (lambda msg: None)
    root = Path(bundle_dir)
    manifest = _read_manifest(root)
    reason = skip_reason(manifest)
    if reason:
        raise VerifyError(f"{root}: cannot verify here: {reason}")
    settings = dict(manifest.recipe.get("verify") or {})
    num_prompts = settings.get("num_prompts", 4) if num_prompts is None else num_prompts
    max_tokens = settings.get("max_tokens", 32) if max_tokens is None else max_tokens
    if min_acceptance_length is None:
        min_acceptance_length = settings.get("min_acceptance_length")
    if not isinstance(num_prompts, int) or num_prompts < 1:
        raise VerifyError(f"num_prompts must be at least 1, got {num_prompts!r}")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise VerifyError(f"max_tokens must be at least 1, got {max_tokens!r}")
    if min_acceptance_length is not None and not min_acceptance_length >= 1:
        raise VerifyError(f"min_acceptance_length must be >= 1 (1 = nothing accepted), got {min_acceptance_length}")
    ref_dtype = reference_dtype or manifest.dtype
    if ref_dtype not in NEAR_TIE_REL:
        raise VerifyError(f"reference dtype {ref_dtype!r}: choose one of {', '.join(NEAR_TIE_REL)}")

    if prompts is None:
        texts = list(BUILTIN_PROMPTS)
        source = "built-in prompts"
    elif isinstance(prompts, (str, Path)):
        texts, source = load_prompts(prompts), str(prompts)
    else:
        texts, source = [str(p) for p in prompts], "given prompts"
        if not texts:
            raise VerifyError("no prompts given")
    if num_prompts > len(texts):
        raise VerifyError(f"num_prompts {num_prompts}: the {source} hold only {len(texts)}; pass a --prompts file "
                          "with more, or ask for fewer")
    texts = texts[:num_prompts]

    try:
        tok = BundleTokenizer(root)
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception types
        raise VerifyError(f"{root}: cannot read tokenizer/tokenizer.json ({e}); the bundle is incomplete") from e
    encoded = _encode(texts, tok, root, chat)
    largest = max(manifest.prefill_buckets)
    for i, ids in enumerate(encoded):  # before the (slow) bundle load
        if not 0 < len(ids) <= largest or len(ids) >= manifest.max_model_len:
            raise VerifyError(f"prompt {i} ({_short(texts[i])!r}) has {len(ids)} tokens; this bundle takes 1 to "
                              f"{min(largest, manifest.max_model_len - 1)} (largest prefill bucket {largest}, "
                              f"max_model_len {manifest.max_model_len}); shorten it")

    location = _target_location(manifest, target_source)

    say("loading the bundle")
    try:
        bundle = Bundle(root)
    except BundleError as e:
        raise VerifyError(str(e)) from e
    engine = Engine(bundle)
    for i, ids in enumerate(encoded):
        try:
            engine.check_request(len(ids), 1)
        except RequestError as e:
            raise VerifyError(f"prompt {i} ({_short(texts[i])!r}): {e}") from e

    say("loading the reference target")
    model, ref_desc = load_reference(manifest, dtype=ref_dtype, location=location)
    eos = list(manifest.eos_token_ids)
    tie_dtype = _coarser(manifest.dtype, ref_dtype)

    acc = SpecStats(manifest.num_speculative_tokens)
    results: list[PromptResult] = []
    refs: list[_Ref] = []
    for i, (text, ids) in enumerate(zip(texts, encoded)):
        n = min(max_tokens, manifest.max_model_len - len(ids))
        say(f"prompt {i + 1}/{len(texts)}")
        ref = _reference_greedy(model, ids, n, eos)
        refs.append(ref)
        gen = engine.generate(ids, n, speculative=True)
        acc.add(gen.stats)
        r = _compare(text, ids, ref, list(gen.token_ids), tie_dtype)
        r.acceptance_length = gen.stats.mean_acceptance_length
        if r.near_tie:
            _check_continuation(model, r, tie_dtype)
        if not r.ok:
            plain = engine.generate(ids, n, speculative=False)
            r.plain_matches_reference = list(plain.token_ids) == ref.ids
        results.append(r)

    report = VerifyReport(bundle=str(root), reference=ref_desc, dtype=manifest.dtype, reference_dtype=ref_dtype,
                          num_speculative_tokens=manifest.num_speculative_tokens, max_tokens=max_tokens,
                          min_acceptance_length=min_acceptance_length, prompts=results, acceptance=acc)
    if diagnose or (diagnose is None and not report.gate_ok):
        say("diagnosing the draft")
        try:
            report.diagnoses = diagnose_draft(bundle, model, [(ids, ref.ids) for ids, ref in zip(encoded, refs)],
                                              acc.per_position[0] if acc.num_drafts else None)
        except Exception as e:  # noqa: BLE001 - best effort: never hide the verdict behind a diagnosis crash
            report.diagnosis_error = f"{type(e).__name__}: {e}"
    report.seconds = time.perf_counter() - t0
    return report


def _encode(texts: list[str], tok, root: Path, chat: bool) -> list[list[int]]:
    if not chat:
        return [tok.encode(t) for t in texts]
    from eagle3_runtime.chat import ChatTemplate

    template = ChatTemplate.from_bundle(root)
    if template is None:
        raise VerifyError(f"{root}: --chat needs a chat template and the bundle's tokenizer has none")
    return [tok.encode(template.render([{"role": "user", "content": t}]), add_special_tokens=False) for t in texts]


@torch.inference_mode()
def _check_continuation(model, r: PromptResult, dtype: str) -> None:
    """Past a near-tie the two continuations differ; check the bundle's own one token by token with the
    reference teacher-forced on it: every token must be the reference's argmax or within the tolerance."""
    i, n = r.first_mismatch, len(r.prompt_ids)
    r.near_tie_flips, r.compared = 1, len(r.bundle_ids)
    if len(r.bundle_ids) <= i + 1:
        return
    ids = torch.tensor([r.prompt_ids + r.bundle_ids])
    logits = model(ids).logits[0, n - 1:].float()  # row j chose generated token j
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


def _compare(text: str, prompt_ids: list[int], ref: _Ref, got: list[int], dtype: str) -> PromptResult:
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


# ---------------------------------------------------------------------------------------- diagnosis


def _draft_weights(bundle) -> dict[str, torch.Tensor]:
    out = {k[len("draft/"):]: v for k, v in bundle.weights.items() if k.startswith("draft/")}
    if "embed_tokens.weight" not in out:  # borrowed from the target (bound as target/embed_tokens.weight)
        out["embed_tokens.weight"] = bundle.weights["target/embed_tokens.weight"]
    return {k: v.float() if v.is_floating_point() else v for k, v in out.items()}


def _eager_draft(bundle, weights: dict[str, torch.Tensor], **overrides):
    """The bundle's draft as a plain torch module (TP 1), from its recorded args and weights."""
    import dataclasses

    from ..models.eagle3 import Eagle3Args, Eagle3Draft, draft_layout

    entry = bundle.manifest.models["draft"]
    cfg = dict(entry.config)
    cfg["aux_layer_ids"] = tuple(cfg["aux_layer_ids"])
    fields = {f.name for f in dataclasses.fields(Eagle3Args)}
    args = Eagle3Args(**{k: v for k, v in cfg.items() if k in fields})
    args = dataclasses.replace(args, **overrides)
    hp = entry.layout.get("padded_hidden") or args.hidden_size
    padded = hp if hp != args.hidden_size else None
    layout = draft_layout(args, 1, padded, padded)
    draft = Eagle3Draft(args, layout)
    missing, _ = draft.load_state_dict(weights, strict=False)
    persistent = {n for n, _ in draft.named_parameters()} | ({"d2t"} if args.has_d2t else set())
    lacking = [k for k in missing if k in persistent]
    if lacking:
        raise RuntimeError(f"the bundle's draft weights lack {lacking[:3]}")
    # each aux chunk as the fc reads it: the target's hidden width, zero-padded like the target emits it
    return draft.float().eval(), args, layout.padded_input_hidden or args.target_hidden_size


@torch.inference_mode()
def _first_step(draft, aux: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The draft's first proposal at every position of one sequence (what draft_prefill / catch-up
    return): aux [T, 3H] of positions 0..T-2 paired with tokens 1..T-1 -> proposals [T-1] for the
    tokens at 2..T."""
    T = tokens.numel()
    x = draft.combine(aux[None, : T - 1])
    kv = torch.zeros(draft.kv_shape(1, T), dtype=torch.float32)
    rows = torch.zeros(1, T - 1, dtype=torch.int64)
    pos = torch.arange(T - 1)[None]
    out = draft(x, tokens[None, 1:], pos, kv, rows, prefill=True, rank=torch.zeros(1, dtype=torch.int64))
    return draft.propose(out)[0]


@dataclass
class _Seq:
    tokens: torch.Tensor  # prompt + reference continuation
    n_prompt: int
    hidden: list[torch.Tensor]  # hidden_states[k] = input of layer k, float32 [T, H]
    logits: torch.Tensor  # [T, V]


def diagnose_draft(bundle, model, sequences: list[tuple[list[int], list[int]]],
                   engine_pos0: float | None) -> list[Diagnosis]:
    """Cheap checks on the bundle's draft (see the module docstring); the most certain first."""
    m = bundle.manifest
    w = _draft_weights(bundle)
    out: list[Diagnosis] = []
    vocab = m.vocab_size
    dcfg = m.models["draft"].config
    dvocab = int(dcfg.get("draft_vocab_size") or vocab)

    # ---- static: the weights themselves
    if dvocab < vocab:
        if "d2t" not in w:
            out.append(Diagnosis("d2t", f"the draft vocab is reduced ({dvocab} of {vocab} target tokens) but the "
                                        "bundle has no d2t: draft ids are read as the first target ids — "
                                        + CAUSES["d2t"], {"draft_vocab_size": dvocab}))
        else:
            d2t = w["d2t"].long()
            if not bool(d2t.any()):
                out.append(Diagnosis("d2t", f"d2t is all zeros (the identity) while the draft vocab is reduced "
                                            f"({dvocab} of {vocab}): draft ids are read as the first {dvocab} target "
                                            "ids — d2t missing or misread when the draft was exported",
                                     {"draft_vocab_size": dvocab}))
            elif d2t.numel() > 1 and not bool(((torch.arange(d2t.numel()) + d2t).diff() > 0).all()):
                out.append(Diagnosis("d2t", "d2t does not map the draft vocab onto increasing target ids (a "
                                            "frequency-built draft vocab is sorted ascending): d2t looks misread",
                                     {}))
    fc = w["fc.weight"]
    fc_rms = float(fc.pow(2).mean().sqrt())
    if fc_rms < 1e-8:
        out.append(Diagnosis("fc", f"the draft's fc weight is all zero (rms {fc_rms:.1e}): " + CAUSES["fc"],
                             {"fc_rms": fc_rms}))
    lm = w["lm_head.weight"]
    target_lm = bundle.weights.get("target/lm_head.weight", bundle.weights.get("target/embed_tokens.weight"))
    if float(lm.abs().max()) == 0:
        out.append(Diagnosis("lm_head", "the draft's lm_head is all zero: " + CAUSES["lm_head"], {}))
    elif target_lm is not None:
        ids = torch.arange(lm.shape[0])
        if "d2t" in w and w["d2t"].numel() == lm.shape[0]:
            ids = ids + w["d2t"].long()
        ids = ids.clamp(0, target_lm.shape[0] - 1)
        if target_lm.shape[1] == lm.shape[1] and torch.allclose(target_lm[ids].float(), lm, rtol=1e-3, atol=1e-6):
            out.append(Diagnosis("lm_head", "the draft's lm_head equals the target's lm_head rows of the draft "
                                            "vocab: the draft's own lm_head was replaced by the target's "
                                            "(vLLM#27732)", {}))
    certain = {d.cause for d in out}

    # ---- behaviour: the draft run eagerly on the target's hidden states (reference sequences)
    seqs = _hidden_states(model, sequences)
    if not seqs:
        return out
    draft, args, chunk = _eager_draft(bundle, w)
    aux_ids = tuple(args.aux_layer_ids)
    n_layers = len(seqs[0].hidden) - 1

    def rates(d, ids) -> tuple[float, float, int]:
        hit = topk = n = 0
        for s in seqs:
            T = s.tokens.numel()
            if T < 3:
                continue
            aux = torch.cat([_pad(s.hidden[a], chunk) for a in ids], -1)
            prop = _first_step(d, aux, s.tokens)  # prop[i] guesses tokens[i + 2]
            lo = max(s.n_prompt - 1, 0)
            sl = slice(lo, T - 2)
            want = s.tokens[2:][sl]
            got = prop[sl]
            hit += int((got == want).sum())
            top = s.logits[1:][sl].topk(min(_TOP_K, s.logits.shape[-1]), dim=-1).indices
            topk += int((top == got[:, None]).any(-1).sum())
            n += want.numel()
        return (hit / n if n else 0.0), (topk / n if n else 0.0), n

    base_hit, base_top, npos = rates(draft, aux_ids)
    ev_base = {"first_step_hit_rate": round(base_hit, 3), "in_target_top10": round(base_top, 3), "positions": npos,
               "aux_layer_ids": list(aux_ids)}
    if engine_pos0 is not None:
        ev_base["engine_position0_acceptance"] = round(engine_pos0, 3)

    def better(rate: float) -> bool:
        return rate >= base_hit + 0.15 and rate >= 1.5 * base_hit

    if not certain:
        best = None
        for shift in (-1, 1, -2, 2):
            ids = tuple(a + shift for a in aux_ids)
            if not all(0 <= a < n_layers for a in ids):
                continue
            r, _, _ = rates(draft, ids)
            if better(r) and (best is None or r > best[1]):
                best = (ids, r, shift)
        if best is not None:
            ids, r, shift = best
            out.append(Diagnosis(
                "aux_ids", f"aux layer ids look shifted by {-shift:+d}: the draft's first proposal matches the target "
                           f"{100 * r:.0f}% of the time with ids {list(ids)} but {100 * base_hit:.0f}% with the "
                           f"bundle's {list(aux_ids)} — " + CAUSES["aux_ids"],
                dict(ev_base, better_aux_layer_ids=list(ids), better_hit_rate=round(r, 3))))
        flipped, _, _ = _eager_draft(bundle, w, norm_before_residual=not args.norm_before_residual)
        r, _, _ = rates(flipped, aux_ids)
        if better(r):
            out.append(Diagnosis(
                "norm_before_residual",
                f"norm_before_residual looks wrong: the draft's first proposal matches the target {100 * r:.0f}% of "
                f"the time with norm_before_residual={not args.norm_before_residual} but {100 * base_hit:.0f}% with "
                f"the bundle's {args.norm_before_residual} — " + CAUSES["norm_before_residual"],
                dict(ev_base, better_hit_rate=round(r, 3))))
    # round starts skip the position after an accepted first token, so the engine's position-0 rate is a
    # (somewhat pessimistic) sample of the eager hit rate: only a collapse points at the graphs
    if engine_pos0 is not None and base_hit >= 0.3 and engine_pos0 <= base_hit / 3:
        out.append(Diagnosis(
            "graphs", f"the bundle's draft graphs do worse than the same weights run eagerly (position-0 acceptance "
                      f"{100 * engine_pos0:.0f}% vs {100 * base_hit:.0f}% first-step hits): the checkpoint is fine, "
                      "the build or the runtime is at fault — please report it", ev_base))
    if not out:
        if base_top < 0.2:
            out.append(Diagnosis(
                "lm_head", f"the draft's first proposals are rarely plausible target tokens (only {100 * base_top:.0f}% "
                           f"are in the target's top {_TOP_K}, {100 * base_hit:.0f}% match): its output head does not "
                           "fit its layer — " + CAUSES["lm_head"] + ", or " + CAUSES["d2t"]
                           + " (or the whole draft is untrained)", ev_base))
        else:
            out.append(Diagnosis(
                "draft", f"the draft proposes plausible tokens ({100 * base_top:.0f}% in the target's top {_TOP_K}) but "
                         f"matches the target's choice only {100 * base_hit:.0f}% of the time; the wiring looks right — "
                         "an undertrained draft, or one trained for another target, chat template or domain",
                ev_base))
    return out


def _pad(h: torch.Tensor, width: int) -> torch.Tensor:
    return h if h.shape[-1] == width else torch.nn.functional.pad(h, (0, width - h.shape[-1]))


@torch.inference_mode()
def _hidden_states(model, sequences: list[tuple[list[int], list[int]]]) -> list[_Seq]:
    out = []
    for prompt, cont in sequences:
        ids = torch.tensor([list(prompt) + list(cont)])
        o = model(ids, output_hidden_states=True)
        out.append(_Seq(ids[0], len(prompt), [h[0].float() for h in o.hidden_states], o.logits[0].float()))
    return out


# ------------------------------------------------------------------------------------- presentation


def render_report(report: VerifyReport, console) -> None:
    """The acceptance block and verdict on a rich console."""
    from rich.table import Table

    acc = report.acceptance
    console.print(f"[bold]verify[/] {report.bundle}", highlight=False)
    console.print(f"reference: {report.reference} ({report.reference_dtype}); bundle dtype {report.dtype}, "
                  f"K {report.num_speculative_tokens}, {len(report.prompts)} prompts x {report.max_tokens} tokens",
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
        t.add_row(str(i), _short(p.prompt, 36), str(len(p.reference_ids)), res, diff, margin,
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
    if report.min_acceptance_length is None:
        console.print("gate: none (set verify.min_acceptance_length in the recipe)")
    else:
        ok = "[green]ok[/]" if report.gate_ok else "[red]FAILED[/]"
        console.print(f"gate: mean acceptance length {acc.mean_acceptance_length:.2f}, needs ≥ "
                      f"{report.min_acceptance_length:g}: {ok}")
    for f in report.failures():
        console.print(f"[red]✗[/] {f}", highlight=False, soft_wrap=True)
    if report.passed and report.diagnoses:
        for d in report.diagnoses:
            console.print(f"note: {d.message}", highlight=False, soft_wrap=True)
    verdict = "[bold green]PASSED[/]" if report.passed else "[bold red]FAILED[/]"
    console.print(f"verify: {verdict} ({report.tokens_compared} tokens compared, {report.seconds:.1f}s)")


def run_verify(bundle_dir: str | Path, console, pair=None, **overrides) -> bool:
    """What ``compile`` calls after building a bundle: verify it with the pair's ``verify`` settings
    (``pair`` a PairRecipe, else the manifest's recipe; ``overrides`` go to ``verify_bundle``), print
    the block on ``console``, and return True when it passed or was skipped (verify.num_prompts 0, a
    TP or Neuron bundle this host cannot run in one process), False when it failed (or could not run)."""
    manifest = _read_manifest(Path(bundle_dir))
    settings = dict(manifest.recipe.get("verify") or {})
    if pair is not None:
        settings = pair.verify.model_dump()
    if settings.get("num_prompts", 4) == 0:
        console.print("verify: skipped (verify.num_prompts is 0)")
        return True
    reason = skip_reason(manifest)
    if reason:
        console.print(f"verify: skipped — {reason}", highlight=False, soft_wrap=True)
        return True
    kw = {"num_prompts": settings.get("num_prompts"), "max_tokens": settings.get("max_tokens"),
          "min_acceptance_length": settings.get("min_acceptance_length")}
    kw.update(overrides)
    try:
        report = verify_bundle(bundle_dir, **kw)
    except UserError as e:
        console.print(f"[bold red]verify:[/] {e}", highlight=False, soft_wrap=True)
        return False
    render_report(report, console)
    return report.passed
