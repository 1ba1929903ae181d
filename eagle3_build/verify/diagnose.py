"""Why a draft's acceptance is low: cheap checks on the draft's weights (d2t, fc, lm_head), then the draft
run eagerly on the reference's hidden states, with the aux layer ids and norm_before_residual as built and
with their neighbouring values, and compared with what the engine achieved. The draft is a bundle's, or a
draft directory as a server was given it (`verify --server`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from eagle3_runtime.bundle import Bundle

from ..models.eagle3 import Eagle3Args, Eagle3Draft, draft_layout
from ..models.weights import weight_tensors
from .reference import hidden_states

# the usual ways a draft loses its acceptance in conversion or export while the output stays lossless
CAUSES: dict[str, str] = {
    "d2t": "d2t missing or misread (draft ids read as the first Vd target ids, or offsets taken as ids)",
    "lm_head": "draft lm_head replaced (by the target's lm_head, or left random)",
    "fc": "fc skipped or zeroed (the draft never sees the target's hidden states)",
    "aux_ids": "aux layer ids shifted (SpecForge ids are output-of-layer k = input of layer k+1; "
               "speculators/vLLM ids are input-of-layer)",
    "norm_before_residual": "wrong norm_before_residual (speculators drafts default to true, "
                            "EAGLE/SpecForge to false)",
}
TOP_K = 10  # a proposal outside the target's top TOP_K is not a plausible token


@dataclass
class DraftUnderTest:
    """The draft as the diagnosis reads it: its args, its weights (module names, float; the target's
    embed_tokens when it borrows it), the target vocab and lm_head, and its padded hidden width (None)."""

    args: Eagle3Args
    weights: dict[str, torch.Tensor]
    vocab: int
    target_lm: torch.Tensor | None
    padded_hidden: int | None = None
    engine: str = "bundle"  # what ran it: "bundle" (its graphs) or "server"

    @classmethod
    def of_bundle(cls, bundle: Bundle) -> "DraftUnderTest":
        entry = bundle.manifest.models["draft"]
        cfg = dict(entry.config)
        cfg["aux_layer_ids"] = tuple(cfg["aux_layer_ids"])
        fields = {f.name for f in dataclasses.fields(Eagle3Args)}
        args = Eagle3Args(**{k: v for k, v in cfg.items() if k in fields})
        hp = entry.layout.get("padded_hidden") or args.hidden_size
        w = {k[len("draft/"):]: v for k, v in bundle.weights.items() if k.startswith("draft/")}
        if "embed_tokens.weight" not in w:  # borrowed from the target (bound as target/embed_tokens.weight)
            w["embed_tokens.weight"] = bundle.weights["target/embed_tokens.weight"]
        target_lm = bundle.weights.get("target/lm_head.weight", bundle.weights.get("target/embed_tokens.weight"))
        return cls(args, floats(w), bundle.manifest.vocab_size, target_lm,
                   hp if hp != args.hidden_size else None)


def floats(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.float() if v.is_floating_point() else v for k, v in w.items()}


@dataclass
class Diagnosis:
    """A likely cause of low acceptance, with what was measured."""

    cause: str  # a key of CAUSES, or "graphs" / "draft"
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)


def _eager_draft(dut: DraftUnderTest, **overrides) -> tuple[Eagle3Draft, Eagle3Args, int]:
    """The draft as a plain torch module (TP 1), from its args and weights; also its args and the width of
    one aux chunk as its fc reads it."""
    args = dataclasses.replace(dut.args, **overrides)
    layout = draft_layout(args, 1, dut.padded_hidden, dut.padded_hidden)
    draft = Eagle3Draft(args, layout)
    missing, _ = draft.load_state_dict(dut.weights, strict=False)
    lacking = [k for k in missing if k in weight_tensors(draft)]
    if lacking:
        raise RuntimeError(f"the draft weights lack {lacking[:3]}")
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
    return draft.propose(out)[0][0, :, 0]


def diagnose_draft(draft: Bundle | DraftUnderTest, model, sequences: list[tuple[list[int], list[int]]],
                   engine_pos0: float | None) -> list[Diagnosis]:
    """Likely causes of low acceptance, the most certain first. `draft`: a bundle (its draft) or a
    DraftUnderTest; `model`: the reference; `sequences`: (prompt ids, reference continuation); `engine_pos0`:
    the engine's position-0 acceptance."""
    dut = draft if isinstance(draft, DraftUnderTest) else DraftUnderTest.of_bundle(draft)
    out = _weight_faults(dut)
    seqs = hidden_states(model, sequences)
    if not seqs:
        return out
    eager, args, chunk = _eager_draft(dut)
    first = _FirstStepRates(seqs, chunk)
    base = first.rates(eager, tuple(args.aux_layer_ids))
    evidence = {"first_step_hit_rate": round(base.hit, 3), "in_target_top10": round(base.top, 3),
                "positions": base.n, "aux_layer_ids": list(args.aux_layer_ids)}
    if engine_pos0 is not None:
        evidence["engine_position0_acceptance"] = round(engine_pos0, 3)
    if not out:
        out += _wiring_faults(dut, eager, first, base.hit, evidence)
    if engine_pos0 is not None and _graphs_lose(base.hit, engine_pos0):
        out.append(_graphs_fault(dut.engine, base.hit, engine_pos0, evidence))
    return out or [_undertrained(base, evidence)]


def _weight_faults(dut: DraftUnderTest) -> list[Diagnosis]:
    """What the draft's weights show by themselves: d2t, fc, lm_head."""
    w = dut.weights
    out = _d2t_faults(w, dut.vocab, int(dut.args.draft_vocab_size or dut.vocab), dut.engine)
    fc_rms = float(w["fc.weight"].pow(2).mean().sqrt())
    if fc_rms < 1e-8:
        out.append(Diagnosis("fc", f"the draft's fc weight is all zero (rms {fc_rms:.1e}): " + CAUSES["fc"],
                             {"fc_rms": fc_rms}))
    lm, target_lm = w["lm_head.weight"], dut.target_lm
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
    return out


def _d2t_faults(w: dict[str, torch.Tensor], vocab: int, dvocab: int, engine: str) -> list[Diagnosis]:
    if dvocab >= vocab:
        return []
    if "d2t" not in w:
        return [Diagnosis("d2t", f"the draft vocab is reduced ({dvocab} of {vocab} target tokens) but the "
                                 f"{engine}'s draft has no d2t: draft ids are read as the first target ids — "
                                 + CAUSES["d2t"], {"draft_vocab_size": dvocab})]
    d2t = w["d2t"].long()
    if not bool(d2t.any()):
        return [Diagnosis("d2t", f"d2t is all zeros (the identity) while the draft vocab is reduced ({dvocab} of "
                                 f"{vocab}): draft ids are read as the first {dvocab} target ids — d2t missing or "
                                 "misread when the draft was exported", {"draft_vocab_size": dvocab})]
    if d2t.numel() > 1 and not bool(((torch.arange(d2t.numel()) + d2t).diff() > 0).all()):
        return [Diagnosis("d2t", "d2t does not map the draft vocab onto increasing target ids (a frequency-built "
                                 "draft vocab is sorted ascending): d2t looks misread", {})]
    return []


@dataclass
class _Rates:
    hit: float  # share of first proposals equal to the reference's next-but-one token
    top: float  # share of first proposals in the reference's top TOP_K
    n: int  # positions


class _FirstStepRates:
    """The draft run eagerly on the reference's hidden states: how often its first proposal is right."""

    def __init__(self, seqs, chunk: int):
        self.seqs, self.chunk = [s for s in seqs if s.tokens.numel() >= 3], chunk
        self.n_layers = len(seqs[0].hidden) - 1

    def rates(self, draft, aux_ids: tuple[int, ...]) -> _Rates:
        hit = topk = n = 0
        for s in self.seqs:
            aux = torch.cat([_pad(s.hidden[a], self.chunk) for a in aux_ids], -1)
            prop = _first_step(draft, aux, s.tokens)  # prop[i] guesses tokens[i + 2]
            sl = slice(max(s.n_prompt - 1, 0), s.tokens.numel() - 2)
            want, got = s.tokens[2:][sl], prop[sl]
            hit += int((got == want).sum())
            top = s.logits[1:][sl].topk(min(TOP_K, s.logits.shape[-1]), dim=-1).indices
            topk += int((top == got[:, None]).any(-1).sum())
            n += want.numel()
        return _Rates(hit / n if n else 0.0, topk / n if n else 0.0, n)


def _wiring_faults(dut: DraftUnderTest, eager, first: _FirstStepRates, base_hit: float,
                   evidence: dict) -> list[Diagnosis]:
    """Aux layer ids or norm placement that the draft fits clearly better than the ones it was given."""
    args = dut.args
    aux_ids = tuple(args.aux_layer_ids)

    def better(rate: float) -> bool:
        return rate >= base_hit + 0.15 and rate >= 1.5 * base_hit

    out, best = [], None
    for shift in (-1, 1, -2, 2):
        ids = tuple(a + shift for a in aux_ids)
        if all(0 <= a < first.n_layers for a in ids):
            r = first.rates(eager, ids).hit
            if better(r) and (best is None or r > best[1]):
                best = (ids, r, shift)
    if best is not None:
        ids, r, shift = best
        out.append(Diagnosis(
            "aux_ids", f"aux layer ids look shifted by {-shift:+d}: the draft's first proposal matches the target "
                       f"{100 * r:.0f}% of the time with ids {list(ids)} but {100 * base_hit:.0f}% with the "
                       f"{dut.engine}'s {list(aux_ids)} — " + CAUSES["aux_ids"],
            dict(evidence, better_aux_layer_ids=list(ids), better_hit_rate=round(r, 3))))
    flipped, _, _ = _eager_draft(dut, norm_before_residual=not args.norm_before_residual)
    r = first.rates(flipped, aux_ids).hit
    if better(r):
        out.append(Diagnosis(
            "norm_before_residual",
            f"norm_before_residual looks wrong: the draft's first proposal matches the target {100 * r:.0f}% of "
            f"the time with norm_before_residual={not args.norm_before_residual} but {100 * base_hit:.0f}% with "
            f"the {dut.engine}'s {args.norm_before_residual} — " + CAUSES["norm_before_residual"],
            dict(evidence, better_hit_rate=round(r, 3))))
    return out


def _graphs_lose(base_hit: float, engine_pos0: float) -> bool:
    # round starts skip the position after an accepted first token, so the engine's position-0 rate is a
    # (somewhat pessimistic) sample of the eager hit rate: only a collapse points at the graphs
    return base_hit >= 0.3 and engine_pos0 <= base_hit / 3


def _graphs_fault(engine: str, base_hit: float, engine_pos0: float, evidence: dict) -> Diagnosis:
    what, fault = (("the bundle's draft graphs do", "the build or the runtime is at fault — please report it")
                   if engine == "bundle" else
                   ("the server's speculative decoding does", "the server loads or runs it differently (its "
                    "aux layer ids or norm placement), or it serves another draft than this directory"))
    return Diagnosis(
        "graphs", f"{what} worse than the same weights run eagerly (position-0 acceptance "
                  f"{100 * engine_pos0:.0f}% vs {100 * base_hit:.0f}% first-step hits): the checkpoint is fine, "
                  + fault, evidence)


def _undertrained(base: _Rates, evidence: dict) -> Diagnosis:
    """No fault found: say whether the draft's proposals are even plausible."""
    if base.top < 0.2:
        return Diagnosis(
            "lm_head", f"the draft's first proposals are rarely plausible target tokens (only {100 * base.top:.0f}% "
                       f"are in the target's top {TOP_K}, {100 * base.hit:.0f}% match): its output head does not "
                       "fit its layer — " + CAUSES["lm_head"] + ", or " + CAUSES["d2t"]
                       + " (or the whole draft is untrained)", evidence)
    return Diagnosis(
        "draft", f"the draft proposes plausible tokens ({100 * base.top:.0f}% in the target's top {TOP_K}) but "
                 f"matches the target's choice only {100 * base.hit:.0f}% of the time; the wiring looks right — "
                 "an undertrained draft, or one trained for another target, chat template or domain", evidence)


def _pad(h: torch.Tensor, width: int) -> torch.Tensor:
    return h if h.shape[-1] == width else torch.nn.functional.pad(h, (0, width - h.shape[-1]))
