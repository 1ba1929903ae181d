"""The reference: the bundle's target loaded with transformers, its greedy generation and hidden states."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3_runtime.manifest import Manifest, torch_dtype

from ..checkpoints.sources import resolve
from ..errors import UserError, VerifyError
from ..recipe import SourceSpec


@dataclass(frozen=True)
class TargetLocation:
    """Where the reference target is on this machine."""

    directory: Path
    gguf_file: str | None  # a .gguf file in `directory`, else an HF checkpoint directory
    description: str


def target_location(manifest: Manifest, target_source: str | Path | None = None) -> TargetLocation:
    """`target_source` (an HF directory or .gguf file) or else the target source recorded in the manifest."""
    if target_source is not None:
        p = Path(target_source).expanduser().resolve()
        if p.is_file() and p.suffix == ".gguf":
            return TargetLocation(p.parent, p.name, str(p))
        if p.is_dir() and (p / "config.json").exists():
            return TargetLocation(p, None, str(p))
        raise VerifyError(f"--target {target_source}: not a checkpoint directory with config.json nor a .gguf file")
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
    return TargetLocation(src.directory, src.gguf_file, desc)


def load_reference(manifest: Manifest, target_source: str | Path | None = None, dtype: str | None = None,
                   location: TargetLocation | None = None):
    """-> (transformers causal LM in eval mode, description), in `dtype` (default: the bundle's)."""
    from transformers import AutoModelForCausalLM

    loc = location or target_location(manifest, target_source)
    kw = {"gguf_file": loc.gguf_file} if loc.gguf_file else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(loc.directory, dtype=torch_dtype(dtype or manifest.dtype), **kw)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for checkpoints it cannot load
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise VerifyError(f"target {loc.description}: transformers cannot load it as the reference: {first}") from e
    if hasattr(model, "set_experts_implementation"):  # GPT-OSS on CPU: only the eager experts run
        with contextlib.suppress(Exception):  # a model without experts has nothing to switch
            model.set_experts_implementation("eager")
    model.eval()
    return model, f"transformers {type(model).__name__} from {loc.description}"


@dataclass
class Reference:
    """The reference's greedy continuation of one prompt."""

    ids: list[int]
    logits: torch.Tensor  # [n, V] float32, the logits each reference token was chosen from


@torch.inference_mode()
def reference_greedy(model, prompt_ids: list[int], n: int, eos_ids: list[int]) -> Reference:
    """transformers' greedy ``generate()`` of up to `n` tokens, with none of the model's own generation defaults."""
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
    return Reference(ids, logits)


@torch.inference_mode()
def teacher_forced_logits(model, ids: list[int]) -> torch.Tensor:
    """The reference's float32 logits [T, V] at every position of `ids` (row j predicts token j + 1)."""
    return model(torch.tensor([ids])).logits[0].float()


@dataclass
class HiddenStates:
    """One sequence run through the reference with every layer's input kept."""

    tokens: torch.Tensor  # prompt + reference continuation
    n_prompt: int
    hidden: list[torch.Tensor]  # hidden[k] = input of layer k, float32 [T, H]
    logits: torch.Tensor  # [T, V]


@torch.inference_mode()
def hidden_states(model, sequences: list[tuple[list[int], list[int]]]) -> list[HiddenStates]:
    """Each (prompt, continuation) run once through the reference with ``output_hidden_states``."""
    out = []
    for prompt, cont in sequences:
        ids = torch.tensor([list(prompt) + list(cont)])
        o = model(ids, output_hidden_states=True)
        out.append(HiddenStates(ids[0], len(prompt), [h[0].float() for h in o.hidden_states], o.logits[0].float()))
    return out
