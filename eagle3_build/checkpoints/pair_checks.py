"""Pair checks: refuse a target/draft pair that would load but silently collapse acceptance.

Each refusal is one line naming the problem and what to do: a missing or misread d2t, a replaced
draft lm_head, a skipped fc, shifted aux layer ids — the usual causes of collapsed acceptance.
"""
from __future__ import annotations

import torch

from ..errors import PairError
from ..models.eagle3 import Eagle3Draft, draft_layout
from ..models.gpt_oss import GptOss, GptOssArgs
from ..models.llama import Llama, llama_layout
from ..models.weights import weight_tensors
from .load import DraftCheckpoint, TargetCheckpoint


def meta_shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    return {n: list(t.shape) for n, t in weight_tensors(model).items()}


def build_target(t: TargetCheckpoint, aux_layer_ids, layout=None) -> Llama | GptOss:
    """The target on the meta device (rank-local shapes when `layout` shards/pads it), built once per
    layout and shared by the checks, `plan` and the build (the aux ids only pick which states its
    forward returns, so they are set on the shared model)."""
    layout = layout or llama_layout(t.args, 1)
    model = t.meta_models.get(layout)
    if model is None:
        cls = GptOss if isinstance(t.args, GptOssArgs) else Llama
        with torch.device("meta"):
            model = t.meta_models[layout] = cls(t.args, tuple(aux_layer_ids), layout)
    model.aux_layer_ids = tuple(aux_layer_ids)
    return model


def build_draft(d: DraftCheckpoint, layout=None) -> Eagle3Draft:
    """The draft on the meta device, built once per layout (as build_target)."""
    layout = layout or draft_layout(d.args, 1)
    model = d.meta_models.get(layout)
    if model is None:
        with torch.device("meta"):
            model = d.meta_models[layout] = Eagle3Draft(d.args, layout)
    return model


def check_target(t: TargetCheckpoint) -> None:
    expected = meta_shapes(build_target(t, ()))
    _check_tensors("target", t.source.spec.uri, expected, t.tensors.shapes, optional=set())


def check_pair(t: TargetCheckpoint, d: DraftCheckpoint) -> None:
    ta, da = t.args, d.args
    uri = d.source.spec.uri
    if da.target_hidden_size != ta.hidden_size:
        raise PairError(f"hidden size mismatch: draft {uri} was trained on a target with hidden "
                        f"{da.target_hidden_size}, the target has {ta.hidden_size}; pair the draft with its own target")
    if da.vocab_size != ta.vocab_size:
        raise PairError(f"vocab mismatch: draft {uri} maps into a vocab of {da.vocab_size} tokens, the target has "
                        f"{ta.vocab_size}; pair the draft with its own target")
    shapes = d.tensors.shapes
    if "lm_head.weight" not in shapes:
        raise PairError(f"draft {uri} has no lm_head.weight; a draft without its own lm_head proposes garbage "
                        "(acceptance 1.0) — use the complete draft checkpoint")
    fc = shapes.get("fc.weight")
    if fc is None:
        raise PairError(f"draft {uri} has no fc.weight (the 3-layer fusion); this is not an EAGLE3 draft")
    if fc[1] != 3 * ta.hidden_size:
        raise PairError(f"fc input mismatch: draft fc.weight is {fc}, its input must be 3 x target hidden = "
                        f"{3 * ta.hidden_size}; this draft belongs to another target")
    for p in ("q_proj", "k_proj", "v_proj"):
        w = shapes.get(f"midlayer.self_attn.{p}.weight")
        if w is not None and w[1] != 2 * da.hidden_size:
            raise PairError(f"draft {p} input is {w[1]}, an EAGLE3 layer reads cat(embed, hidden) = 2 x "
                            f"{da.hidden_size} = {2 * da.hidden_size}; the checkpoint is not an EAGLE3 draft")
    if da.draft_vocab_size < ta.vocab_size and "d2t" not in shapes:
        raise PairError(f"draft vocab {da.draft_vocab_size} < target vocab {ta.vocab_size} but the draft has no "
                        "d2t map; without it draft ids would be read as the first target ids — use a checkpoint "
                        "that includes d2t")
    if len(da.aux_layer_ids) != 3:
        raise PairError(f"draft aux layer ids {list(da.aux_layer_ids)}: EAGLE3 fuses exactly 3 target layers")
    bad = [i for i in da.aux_layer_ids if not 0 <= i < ta.num_layers]
    if bad:
        raise PairError(f"draft aux layer ids {list(da.aux_layer_ids)} out of range for a {ta.num_layers}-layer "
                        f"target (valid 0..{ta.num_layers - 1}, input-of-layer); check eagle_aux_hidden_state_layer_ids")
    if not d.has_embed and da.hidden_size != ta.hidden_size:
        raise PairError(f"draft has no embed_tokens and its hidden {da.hidden_size} differs from the target's "
                        f"{ta.hidden_size}, so the target's embedding cannot be borrowed")
    expected = meta_shapes(build_draft(d))
    _check_tensors("draft", uri, expected, shapes, optional={"embed_tokens.weight"}, ignored={"t2d"})
    if "d2t" in shapes:
        check_d2t(d, ta.vocab_size)


def check_d2t(d: DraftCheckpoint, target_vocab: int) -> None:
    d2t = d.tensors.get("d2t").long()
    ids = torch.arange(d2t.numel()) + d2t
    if ids.min() < 0 or ids.max() >= target_vocab:
        raise PairError(f"draft d2t maps outside the target vocab (ids {int(ids.min())}..{int(ids.max())}, "
                        f"vocab {target_vocab}); d2t must hold offsets (target_id - draft_id)")
    if "t2d" in d.tensors:
        t2d = d.tensors.get("t2d").bool()
        if t2d.numel() != target_vocab or not torch.equal(torch.nonzero(t2d).flatten(), ids):
            raise PairError("draft d2t and t2d disagree (flatnonzero(t2d) != arange(Vd) + d2t); the d2t map is "
                            "corrupt or stored as absolute ids — re-export the draft")


def _check_tensors(role, uri, expected: dict, present: dict, optional: set, ignored: set = frozenset()):
    missing = sorted(n for n in expected if n not in present and n not in optional)
    if missing:
        raise PairError(f"{role} {uri} lacks tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}; "
                        "the checkpoint is incomplete or of another architecture")
    extra = sorted(n for n in present if n not in expected and n not in ignored)
    if extra:
        raise PairError(f"{role} {uri} has tensors this build does not understand: {extra[:5]}"
                        f"{' ...' if len(extra) > 5 else ''}; refusing rather than ignoring them")
    wrong = [f"{n} {present[n]} (expected {expected[n]})" for n in expected if n in present
             and list(present[n]) != list(expected[n])]
    if wrong:
        raise PairError(f"{role} {uri}: tensor shapes disagree with config.json: {'; '.join(wrong[:3])}")
