"""Tiny random target + EAGLE3 draft pairs for tests and smoke checks (how well they speculate, measured:
docs/tiny-pairs.md).

``make_tiny_pair(out_dir)`` writes, in a few seconds and fully deterministically given ``seed``:

* ``out_dir/target/``  a transformers ``LlamaForCausalLM`` (4 layers or ``num_layers``, hidden 64 or ``hidden_size``, vocab
  512, llama3 rope scaling, untied lm_head) + a byte-level BPE tokenizer with Llama-3 style specials;
* ``out_dir/draft/``   an EAGLE3 draft in one of the three on-disk formats: ``"eagle"`` (SafeAILab,
  ``pytorch_model.bin``), ``"speculators"`` (RedHatAI), ``"specforge"`` (SGLang);
* ``out_dir/recipe.yaml`` a build recipe pointing at both;
* with ``target_format="gguf"`` also ``out_dir/target.gguf`` (``write_gguf``: llama.cpp layout, F32),
  which the recipe then names as its target. That target has plain rope (``rope_scaling=False``):
  transformers' GGUF loader reads no llama3 rope scaling for ``llama``, so ``write_gguf`` refuses it.

The weights are "structured random" so that the draft is useful but imperfect:

* target: token ``t`` mostly continues with ``f(t) = perm[t]`` (lm_head row ``j`` is the embedding of
  ``perm^-1[j]``); the decoder layers add enough context noise that the target does not follow ``f``
  every step;
* draft: ``fc`` picks the first aux chunk (~ the embedding of ``t_i``), the draft lm_head row for draft
  id ``k`` is the target embedding of ``g^-1(ids[k])`` with ``g = f∘f``, so the first draft step guesses
  ``t_{i+2} = g(t_i)``; tokens outside the draft vocabulary can never be proposed. Recurrent draft
  steps (2..K) carry the step-1 state forward and mostly repeat its guess, so they are mostly rejected.

The draft vocabulary is closed under ``f`` (``perm`` maps it onto itself and its complement onto the
complement) and the target's lm_head favours draft-vocabulary tokens slightly (rows scaled by
``_TARGET_DRAFT_VOCAB_GAIN``), so that - as with a real frequency-built draft vocabulary - the target's
text mostly lives inside the draft vocabulary. Without that, a random 256-of-512 draft vocabulary would
cap the draft's hit rate at about half of the already imperfect ``f∘f`` rate.

``hidden_size`` (a multiple of 4, e.g. 92: q width 64 != hidden, as GPT-OSS) keeps the structure: the
weights reading the residual stream are scaled by ``sqrt(64 / hidden)``.

``make_tiny_pair(out_dir, arch="gpt-oss")`` writes instead the GPT-OSS twin of seed system 003
(``recipes/gpt-oss-120b-eagle3.yaml``, scaled down; ``gpt_oss_structure``): 4 layers alternating sliding
(window 8) and full attention, sinks, q/k/v/o biases, YaRN, 4 experts top-2 with the clamped SwiGLU,
intermediate = hidden = 90 (GPT-OSS 2880 / 32, padded to 96 = 3072 / 32), stored in BF16 -- or, with
``target_format="mxfp4"``, hidden 96 with the experts as MXFP4 ``*_blocks`` / ``*_scales`` (MXFP4 packs
32 values along each expert's input dim, so 90 cannot be stored that way) --, a speculators draft with
``norm_before_fc`` and the same f / f∘f structure, and a recipe shaped like the GPT-OSS-120B seed system (K 1,
max_num_seqs 1, one prefill bucket).

No global RNG state is touched: all randomness comes from one seeded ``torch.Generator``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from eagle3_runtime.manifest import MODEL_DTYPES

from ..recipe import min_max_model_len
from .gguf import EOT, write_gguf

__all__ = [
    "ARCHS",
    "DRAFT_FORMATS",
    "GPT_OSS_TARGET_FORMATS",
    "effective_aux_ids",
    "specforge_aux_ids",
    "TARGET_FORMATS",
    "TINY_CORPUS",
    "SPECIAL_TOKENS",
    "make_tiny_pair",
    "make_tiny_tokenizer",
    "gpt_oss_structure",
    "mxfp4_quantize",
    "sensitize_structure",
    "tiny_structure",
    "write_gguf",
]

ARCHS = ("llama", "gpt-oss")
DRAFT_FORMATS = ("eagle", "speculators", "specforge")
TARGET_FORMATS = ("hf", "gguf")  # Llama; the GPT-OSS twin: GPT_OSS_TARGET_FORMATS

# --- shapes --------------------------------------------------------------------------------------
VOCAB = 512
HIDDEN = 64
INTERMEDIATE = 128
N_LAYERS = 4  # the default pair; the sensitive pair (verify's fault tests) has SENSITIVE_LAYERS
SENSITIVE_LAYERS = 8
N_HEADS = 4
N_KV_HEADS = 2
HEAD_DIM = 16
MAX_POS = 1024
RMS_EPS = 1e-5
TARGET_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# the plain-rope variant (``rope_scaling=False``): GGUF-able, see ``write_gguf``
TARGET_PLAIN_ROPE = {"rope_type": "default", "rope_theta": TARGET_ROPE["rope_theta"]}
DRAFT_VOCAB = 256
DRAFT_ROPE_THETA = 10000.0



def specforge_aux_ids(num_layers: int = N_LAYERS) -> tuple[int, int, int]:
    """The aux ids a SpecForge draft's config states (SGLang semantics: output of layer k)."""
    return (0, num_layers // 2 - 1, num_layers - 2)


def effective_aux_ids(draft_format: str, num_layers: int = N_LAYERS) -> tuple[int, int, int]:
    """The aux ids (vLLM semantics: input of target layer k) a tiny draft of this format reads: eagle and
    speculators drafts state none, so EAGLE's default (2, N // 2, N - 3) applies (at 4 layers (2, 2, 1):
    layer 2's input twice); SpecForge's stated ids + 1."""
    from ..checkpoints.load import default_aux_layer_ids

    if draft_format == "specforge":
        return tuple(k + 1 for k in specforge_aux_ids(num_layers))
    return default_aux_layer_ids(num_layers)


# --- weight scales (tuned: f-rate ~0.71-0.87, draft first-step hit ~0.52-0.75 over seeds 0-9) ---
_EMBED_STD = 1.0
_LAYER_STD = 0.08  # target q/k/v/gate/up
_OUT_STD = 0.18  # target o_proj/down_proj at 8 layers: sets how much context perturbs the residual stream
_OUT_DEPTH = 8  # ... scaled by sqrt(_OUT_DEPTH / layers): the same total perturbation at any depth
_CLOSED_DRAFT_VOCAB = True  # perm maps the draft vocab onto itself (see module docstring)
_TARGET_DRAFT_VOCAB_GAIN = 1.2  # target lm_head rows of draft-vocab tokens are scaled by this
_DRAFT_FC_NOISE = 0.01
_DRAFT_LAYER_STD = 0.02

SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", EOT)
BOS, EOS, EOT = SPECIAL_TOKENS

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}\n\n{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant\n\n{% endif %}"
)

TINY_CORPUS = """\
Speculative decoding lets a small draft model guess several tokens ahead while the large target
model checks all of the guesses in one forward pass. When the guesses are right, the target accepts
them and the text grows by more than one token per step; when a guess is wrong, the target keeps the
accepted prefix, emits its own token at the first mismatch, and the draft starts again from there.
The output is exactly the text the target would have written on its own, only faster.

EAGLE drafts do not read the text alone. They read the hidden states of the target model, taken from
a few of its layers, and the embedding of the next token. A single decoder layer then predicts the
token after that. Because the draft sees what the target was thinking, it guesses well, and the
acceptance rate stays high even on long and difficult prompts.

The weather this morning was cold and clear. A thin layer of frost covered the fields, and the river
ran slow and grey under the old stone bridge. By noon the sun had warmed the valley, the birds were
singing in the hedges, and the farmers were out with their tractors, turning the dark soil for the
spring planting. In the evening the wind rose again from the north, and everyone went home early.

Compilers turn programs into machine code. A good compiler reads the whole program, builds a graph of
the operations, fuses small steps into larger ones, chooses where each value should live in memory,
and writes code that keeps every unit of the chip busy. Compiling a large model can take an hour, so
the results are cached on disk and reused until the model, the compiler or the settings change.

She opened the door, put the kettle on, and sat down by the window with a book she had been meaning
to read for years. The first chapter was slow, but by the third she could not put it down. When she
finally looked up, the tea was cold, the sky was dark, and the cat was asleep on the chair beside her.

Numbers such as 1, 2, 3, 10, 42, 100 and 2024 appear in text, and so do symbols: (a + b) * c = d,
x < y, "quotes", 'apostrophes', e-mail@example.com, #tags, 50% off, $9.99, and the path /usr/bin/env.
"""


# =================================================================================================
# tokenizer
# =================================================================================================
def make_tiny_tokenizer():
    """Train the byte-level BPE tokenizer (vocab exactly 512) and wrap it in PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TINY_CORPUS.split("\n\n"), trainer=trainer)
    if tok.get_vocab_size() != VOCAB:
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB}")
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        additional_special_tokens=[EOT],
        model_max_length=MAX_POS,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


# =================================================================================================
# weights
# =================================================================================================
def _check_hidden_size(hidden_size) -> int:
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
        raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
    if hidden_size % N_HEADS:
        # transformers' LlamaConfig validation refuses hidden_size % num_attention_heads != 0 even when
        # head_dim is given, so such a target could not be loaded (from_pretrained, GGUF) at all
        raise ValueError(
            f"hidden_size must be a multiple of num_attention_heads={N_HEADS} (transformers' LlamaConfig "
            f"refuses anything else), got {hidden_size}; e.g. 92 is awkward (q width "
            f"{N_HEADS * HEAD_DIM}, not a multiple of 8)"
        )
    return int(hidden_size)


def _randn(g: torch.Generator, *shape: int, std: float) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float32) * std


def tiny_structure(seed: int = 0, *, hidden_size: int = HIDDEN, num_layers: int = N_LAYERS) -> dict:
    """The hidden structure of the pair for ``seed``: ``perm`` (f), ``ids`` (draft vocab), all weights.

    ``hidden_size``: the residual width (target and draft), a multiple of ``N_HEADS`` (transformers
    refuses others). Heads, head_dim (q width ``N_HEADS * HEAD_DIM`` = 64) and the MLP width stay
    fixed, so any other value gives a model whose q width differs from its hidden size (as GPT-OSS:
    hidden 2880, 64 heads x 64). The draws happen in
    the same order for every size; ``hidden_size=HIDDEN`` is the historical pair, tensor for tensor.

    Returned dict: ``perm`` [512] int64 (f(t) = perm[t]), ``ids`` [256] int64 sorted (draft vocab),
    ``target`` (transformers LlamaForCausalLM state dict), ``draft`` (draft tensors without prefix
    handling: keys ``fc.weight``, ``layer.<name>``, ``norm.weight``, ``lm_head.weight``, ``d2t``,
    ``t2d``, ``embed_tokens.weight``).
    """
    hidden = _check_hidden_size(hidden_size)
    g = torch.Generator().manual_seed(int(seed))

    q_out, kv_out = N_HEADS * HEAD_DIM, N_KV_HEADS * HEAD_DIM
    # weights that read the residual stream (fan-in = hidden) scale as 1/sqrt(hidden), so that the
    # structure (how much context perturbs the stream) does not depend on hidden_size; 1.0 at HIDDEN
    fan = math.sqrt(HIDDEN / hidden)
    std, ostd = _LAYER_STD * fan, _OUT_STD * math.sqrt(_OUT_DEPTH / int(num_layers))

    def layer(g: torch.Generator) -> dict[str, torch.Tensor]:
        return {"self_attn.q_proj.weight": _randn(g, q_out, hidden, std=std),
                "self_attn.k_proj.weight": _randn(g, kv_out, hidden, std=std),
                "self_attn.v_proj.weight": _randn(g, kv_out, hidden, std=std),
                "self_attn.o_proj.weight": _randn(g, hidden, q_out, std=ostd),
                "mlp.gate_proj.weight": _randn(g, INTERMEDIATE, hidden, std=std),
                "mlp.up_proj.weight": _randn(g, INTERMEDIATE, hidden, std=std),
                "mlp.down_proj.weight": _randn(g, hidden, INTERMEDIATE, std=ostd)}

    t, embed, (ids, in_d, perm) = _target_frame(g, hidden, int(num_layers), layer)
    d = _structured_draft(g, embed, perm, ids, in_d, hidden)
    return {"perm": perm, "ids": ids, "target": t, "draft": d}


def _target_frame(g: torch.Generator, hidden: int, n_layers: int, layer) -> tuple[dict, torch.Tensor, tuple]:
    """The target state dict both twins share: embedding, vocab structure, ``layer(g)``'s weights per
    layer (under ``model.layers.<i>.``) plus unit norms, final norm and lm_head, drawn in this order.
    Returns (state dict, embedding, (ids, in_d, perm))."""
    embed = _randn(g, VOCAB, hidden, std=_EMBED_STD)
    ids, in_d, perm, lm_head = _vocab_structure(g, embed)
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed}
    for li in range(n_layers):
        p = f"model.layers.{li}."
        t.update({p + k: v for k, v in layer(g).items()})
        t[p + "input_layernorm.weight"] = torch.ones(hidden)
        t[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    t["model.norm.weight"] = torch.ones(hidden)
    t["lm_head.weight"] = lm_head
    return t, embed, (ids, in_d, perm)


def _vocab_structure(g: torch.Generator, embed: torch.Tensor):
    """-> (ids, in_d, perm, target lm_head): the draft vocabulary (a random sorted subset), the map
    f(t) = perm[t] (closed on the draft vocabulary) and the lm_head that makes the target follow f."""
    ids = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values
    in_d = torch.zeros(VOCAB, dtype=torch.bool)
    in_d[ids] = True
    # perm: random, mapping the draft vocab onto itself and the rest onto the rest
    perm = torch.empty(VOCAB, dtype=torch.int64)
    if _CLOSED_DRAFT_VOCAB:
        blocks = (ids, torch.nonzero(~in_d).flatten())
    else:
        blocks = (torch.arange(VOCAB),)
    for block in blocks:
        perm[block] = block[torch.randperm(len(block), generator=g)]
    perm_inv = torch.empty_like(perm)
    perm_inv[perm] = torch.arange(VOCAB)

    lm_head = embed[perm_inv].clone()  # row j = e_{perm^-1[j]} -> logit_j max at j = perm[t]
    lm_head[in_d] *= _TARGET_DRAFT_VOCAB_GAIN
    return ids, in_d, perm, lm_head


def _structured_draft(g: torch.Generator, embed, perm, ids, in_d, hidden: int) -> dict[str, torch.Tensor]:
    """The draft's tensors: fc picks the first aux chunk, its lm_head guesses g(t_i) = f(f(t_i))."""
    fan = math.sqrt(HIDDEN / hidden)
    q_out, kv_out = N_HEADS * HEAD_DIM, N_KV_HEADS * HEAD_DIM
    g2 = perm[perm]  # g = f∘f
    g2_inv = torch.empty_like(g2)
    g2_inv[g2] = torch.arange(VOCAB)
    fc = torch.zeros(hidden, 3 * hidden)
    fc[:, :hidden] = torch.eye(hidden)
    fc += _randn(g, hidden, 3 * hidden, std=_DRAFT_FC_NOISE * fan)
    d: dict[str, torch.Tensor] = {"fc.weight": fc}
    dstd = _DRAFT_LAYER_STD * fan  # q/k/v/gate/up read the (2x) hidden stream
    d["layer.self_attn.q_proj.weight"] = _randn(g, q_out, 2 * hidden, std=dstd)
    d["layer.self_attn.k_proj.weight"] = _randn(g, kv_out, 2 * hidden, std=dstd)
    d["layer.self_attn.v_proj.weight"] = _randn(g, kv_out, 2 * hidden, std=dstd)
    d["layer.self_attn.o_proj.weight"] = _randn(g, hidden, q_out, std=_DRAFT_LAYER_STD)
    d["layer.mlp.gate_proj.weight"] = _randn(g, INTERMEDIATE, hidden, std=dstd)
    d["layer.mlp.up_proj.weight"] = _randn(g, INTERMEDIATE, hidden, std=dstd)
    d["layer.mlp.down_proj.weight"] = _randn(g, hidden, INTERMEDIATE, std=_DRAFT_LAYER_STD)
    d["layer.input_layernorm.weight"] = torch.ones(hidden)
    d["layer.hidden_norm.weight"] = torch.ones(hidden)
    d["layer.post_attention_layernorm.weight"] = torch.ones(hidden)
    d["norm.weight"] = torch.ones(hidden)
    d["lm_head.weight"] = embed[g2_inv[ids]].clone()
    d["d2t"] = (ids - torch.arange(DRAFT_VOCAB)).to(torch.int64)
    d["t2d"] = in_d.clone()
    d["embed_tokens.weight"] = embed.clone()
    return d


# =================================================================================================
# writers
# =================================================================================================
def _rope_kwargs(rope: dict) -> dict:
    """The rope arguments of a transformers config class, in the form the installed transformers reads
    (5.x ``rope_parameters``, 4.x ``rope_theta`` + ``rope_scaling``)."""
    from ..models.llama import Rope

    return Rope.config_kwargs(rope)


def _with_both_rope_forms(cfg: dict, rope: dict) -> dict:
    """``cfg`` (a config.json dict) with the rope in both forms, ``rope_parameters`` for transformers 5 and
    ``rope_theta`` + ``rope_scaling`` for 4.x readers (the Neuron SDK's stack), which agree: 5.x reads the
    legacy pair back into exactly ``rope_parameters``."""
    from ..models.llama import Rope

    return {**cfg, **Rope.config_fields(rope)}


def _target_config(bos_id: int, eos_id: int, *, rope_scaling: bool = True, hidden_size: int = HIDDEN,
                   num_layers: int = N_LAYERS):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=int(hidden_size),
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=int(num_layers),
        num_attention_heads=N_HEADS,
        num_key_value_heads=N_KV_HEADS,
        head_dim=HEAD_DIM,
        hidden_act="silu",
        max_position_embeddings=MAX_POS,
        rms_norm_eps=RMS_EPS,
        **_rope_kwargs(TARGET_ROPE if rope_scaling else TARGET_PLAIN_ROPE),
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        attention_bias=False,
        mlp_bias=False,
        dtype="float32",
    )


def _write_target(
    target_dir: Path,
    state: dict[str, torch.Tensor],
    tokenizer,
    *,
    rope_scaling: bool = True,
    hidden_size: int = HIDDEN,
    num_layers: int = N_LAYERS,
) -> None:
    from transformers import GenerationConfig, LlamaForCausalLM

    bos_id = tokenizer.convert_tokens_to_ids(BOS)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    cfg = _target_config(bos_id, eos_id, rope_scaling=rope_scaling, hidden_size=hidden_size,
                         num_layers=num_layers)
    # Building the module runs transformers' random init: keep it off the global RNG.
    with torch.random.fork_rng(devices=[]):
        model = LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not k.endswith("inv_freq")]:
        raise RuntimeError(f"tiny target state mismatch: missing={missing} unexpected={unexpected}")
    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id)
    model.eval()
    model.save_pretrained(str(target_dir), safe_serialization=True)
    cfg_path = target_dir / "config.json"
    rope = TARGET_ROPE if rope_scaling else TARGET_PLAIN_ROPE
    cfg_path.write_text(json.dumps(_with_both_rope_forms(json.loads(cfg_path.read_text()), rope),
                                   indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(str(target_dir))


def _flat_draft_llama_config(
    bos_id: int, eos_id: int, *, rope_theta: float | None, hidden_size: int = HIDDEN
) -> dict:
    cfg = {
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": int(hidden_size),
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": N_HEADS,
        "num_key_value_heads": N_KV_HEADS,
        "head_dim": HEAD_DIM,
        "num_hidden_layers": 1,
        "rms_norm_eps": RMS_EPS,
        "vocab_size": VOCAB,
        "max_position_embeddings": MAX_POS,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    }
    if rope_theta is not None:
        cfg["rope_theta"] = rope_theta
    return cfg


def _write_draft(
    draft_dir: Path,
    fmt: str,
    tensors: dict[str, torch.Tensor],
    *,
    bos_id: int,
    eos_id: int,
    num_speculative_tokens: int,
    target_dir: Path,
    hidden_size: int = HIDDEN,
    num_layers: int = N_LAYERS,
    extra_config: dict | None = None,
) -> None:
    prefix = "layers.0." if fmt == "speculators" else "midlayer."
    sd: dict[str, torch.Tensor] = {}
    for k, v in tensors.items():
        if k == "embed_tokens.weight" and fmt != "speculators":
            continue  # eagle / specforge drafts borrow the target's embedding
        key = prefix + k[len("layer."):] if k.startswith("layer.") else k
        sd[key] = v.contiguous().clone()
    sd = dict(sorted(sd.items()))

    if fmt == "eagle":
        # no rope_theta -> 10000
        cfg = _flat_draft_llama_config(bos_id, eos_id, rope_theta=None, hidden_size=hidden_size)
        cfg.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=DRAFT_VOCAB,
                   torch_dtype="float32")
        torch.save(sd, draft_dir / "pytorch_model.bin")
    elif fmt == "specforge":
        cfg = _flat_draft_llama_config(bos_id, eos_id, rope_theta=DRAFT_ROPE_THETA,
                                       hidden_size=hidden_size)
        cfg.update(
            architectures=["LlamaForCausalLMEagle3"],
            draft_vocab_size=DRAFT_VOCAB,
            target_hidden_size=int(hidden_size),
            eagle_config={
                "eagle_aux_hidden_state_layer_ids": list(specforge_aux_ids(num_layers)),
                "use_aux_hidden_state": True,
            },
            torch_dtype="float32",
        )
        _save_safetensors(sd, draft_dir / "model.safetensors")
    elif fmt == "speculators":
        layer_cfg = _flat_draft_llama_config(bos_id, eos_id, rope_theta=DRAFT_ROPE_THETA,
                                       hidden_size=hidden_size)
        layer_cfg["rope_scaling"] = None
        cfg = {
            "speculators_model_type": "eagle3",
            "architectures": ["Eagle3Speculator"],
            "transformer_layer_config": layer_cfg,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [
                    {"proposal_type": "greedy", "speculative_tokens": int(num_speculative_tokens)}
                ],
                "default_proposal_method": "greedy",
                "verifier": {
                    "name_or_path": str(target_dir),
                    "architectures": ["LlamaForCausalLM"],
                },
            },
            "draft_vocab_size": DRAFT_VOCAB,
            "norm_before_residual": True,
            "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": None,
            "torch_dtype": "float32",
        }
        _save_safetensors(sd, draft_dir / "model.safetensors")
    else:  # pragma: no cover - checked by the caller
        raise ValueError(fmt)
    cfg.update(extra_config or {})
    (draft_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _save_safetensors(sd: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(sd, str(path), metadata={"format": "pt"})


def _write_recipe(
    path: Path,
    fmt: str,
    *,
    dtype: str,
    k: int,
    max_model_len: int,
    target: str = "./target",
    tp_degree: int = 1,
    padded_hidden_size: int | None = None,
    name: str | None = None,
    prefill_buckets: tuple[int, ...] = (64,),
    header: str = "tiny random Llama target + EAGLE3 draft",
) -> None:
    if fmt == "eagle":
        draft = (
            "    # the official EAGLE format is a pickle (pytorch_model.bin, torch.save): loading it needs\n"
            "    # torch.load, which the build only does when the recipe opts in explicitly\n"
            "    draft: {source: ./draft, allow_pickle: true}\n"
        )
    else:
        draft = "    draft: ./draft\n"
    par = []
    if int(tp_degree) != 1:
        par.append(f"tp_degree: {int(tp_degree)}")
    if padded_hidden_size is not None:
        par.append(f"padded_hidden_size: {int(padded_hidden_size)}")
    parallel = f"    parallel: {{{', '.join(par)}}}\n" if par else ""
    text = (
        f"# {header} (written by `eagle3-build make-tiny-pair`)\n"
        "pairs:\n"
        f"  - name: {name or f'tiny-llama-{fmt}'}\n"
        f"    target: {target}\n"
        f"{draft}"
        f"    dtype: {dtype}\n"
        f"    speculation: {{num_speculative_tokens: {int(k)}}}\n"
        f"    serving: {{max_num_seqs: 1, max_model_len: {int(max_model_len)}}}\n"
        f"{parallel}"
        "    # keep the number of graphs small\n"
        f"    buckets: {{prefill: [{', '.join(map(str, prefill_buckets))}], batch: [1]}}\n"
        "    backend: export\n"
    )
    path.write_text(text)













# =================================================================================================
# GPT-OSS twin (seed system 003 scaled down)
# =================================================================================================
GPT_OSS_HIDDEN = 90  # GPT-OSS 2880 / 32; padded to 96 (3072 / 32) in the padded builds
GPT_OSS_MXFP4_HIDDEN = 96  # MXFP4 packs 32 values along each expert's input dim: H and I multiples of 32
GPT_OSS_LAYERS = 4  # sliding, full, sliding, full (even layers slide, as GPT-OSS)
GPT_OSS_EXPERTS = 4
GPT_OSS_TOP_K = 2
GPT_OSS_WINDOW = 8  # shorter than the test prompts
GPT_OSS_ROPE = {  # YaRN as GPT-OSS (theta 150000, factor 32, beta 32/1), original context MAX_POS / 32
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": MAX_POS // 32,
}
GPT_OSS_AUX_IDS = (1, 2, 3)  # input of target layers 1..3 (speculators config states them)
GPT_OSS_TARGET_FORMATS = ("hf", "mxfp4")  # hf: BF16 safetensors; mxfp4: experts as *_blocks/*_scales
_GPT_OSS_BIAS_STD = 0.02
_GPT_OSS_SINK_STD = 1.0
_GPT_OSS_ROUTER_STD = 0.5  # x fan: router logits of order 1 -> routing varies from token to token
_GPT_OSS_DOWN_STD = 0.3  # expert down_proj: with o_proj (_GPT_OSS_OUT_STD) sets the context noise
_GPT_OSS_OUT_STD = 0.3

MXFP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, R, C] (C a multiple of 32) -> (blocks [E, R, C/32, 16] uint8, scales [E, R, C/32] uint8):
    per group of 32 values the power-of-two scale that brings the largest into [-6, 6], each value rounded
    to the nearest FP4 (e2m1) value, two per byte, the even-indexed value in the low nibble."""
    E, R, C = w.shape
    if C % 32:
        raise ValueError(f"MXFP4 needs the input dim to be a multiple of 32, got {C}")
    groups = w.float().reshape(E, R, C // 32, 32)
    amax = groups.abs().amax(-1).clamp_min(2.0 ** -120)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127).to(torch.int32)
    scaled = groups / torch.exp2(exp.float())[..., None]
    lut = torch.tensor(MXFP4_VALUES)
    idx = (scaled[..., None] - lut).abs().argmin(-1).to(torch.uint8)
    return idx[..., 0::2] | (idx[..., 1::2] << 4), (exp + 127).to(torch.uint8)


def _mxfp4_round(w: torch.Tensor) -> torch.Tensor:
    """An expert tensor [E, in, out] rounded onto the MXFP4 grid (what its MXFP4 form dequantizes to)."""
    from ..checkpoints.sources import mxfp4_dequantize

    return mxfp4_dequantize(*mxfp4_quantize(w.transpose(1, 2)), dtype=torch.float32)


def gpt_oss_structure(seed: int = 0, *, hidden_size: int = GPT_OSS_HIDDEN) -> dict:
    """The GPT-OSS twin for ``seed``: the same structure as ``tiny_structure`` (the target mostly
    continues t with f(t) = perm[t], the draft guesses f(f(t))) on a GPT-OSS body: q/k/v/o biases,
    sinks, a top-2 router over 4 experts with the clamped SwiGLU, intermediate = hidden (as GPT-OSS).
    The experts are rounded onto the MXFP4 grid when hidden is a multiple of 32, so the BF16 and the
    MXFP4 checkpoints of one seed hold the same model. Keys as ``tiny_structure``; ``target`` is a
    transformers GptOssForCausalLM state dict (float32 values), ``draft`` has ``input_norm.weight``."""
    hidden = int(hidden_size)
    inter = hidden
    g = torch.Generator().manual_seed(int(seed))
    q_out, kv_out = N_HEADS * HEAD_DIM, N_KV_HEADS * HEAD_DIM
    fan = math.sqrt(HIDDEN / hidden)
    std, E = _LAYER_STD * fan, GPT_OSS_EXPERTS

    def layer(g: torch.Generator) -> dict[str, torch.Tensor]:
        w = {}
        for name, rows in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            w[f"self_attn.{name}.weight"] = _randn(g, rows, hidden, std=std)
            w[f"self_attn.{name}.bias"] = _randn(g, rows, std=_GPT_OSS_BIAS_STD)
        w["self_attn.o_proj.weight"] = _randn(g, hidden, q_out, std=_GPT_OSS_OUT_STD)
        w["self_attn.o_proj.bias"] = _randn(g, hidden, std=_GPT_OSS_BIAS_STD)
        w["self_attn.sinks"] = _randn(g, N_HEADS, std=_GPT_OSS_SINK_STD)
        w["mlp.router.weight"] = _randn(g, E, hidden, std=_GPT_OSS_ROUTER_STD * fan / math.sqrt(HIDDEN))
        w["mlp.router.bias"] = _randn(g, E, std=_GPT_OSS_BIAS_STD)
        gate_up = _randn(g, E, hidden, 2 * inter, std=std)
        down = _randn(g, E, inter, hidden, std=_GPT_OSS_DOWN_STD * fan)
        if hidden % 32 == 0:
            gate_up, down = _mxfp4_round(gate_up), _mxfp4_round(down)
        w["mlp.experts.gate_up_proj"] = gate_up
        w["mlp.experts.gate_up_proj_bias"] = _randn(g, E, 2 * inter, std=_GPT_OSS_BIAS_STD)
        w["mlp.experts.down_proj"] = down
        w["mlp.experts.down_proj_bias"] = _randn(g, E, hidden, std=_GPT_OSS_BIAS_STD)
        return w

    t, embed, (ids, in_d, perm) = _target_frame(g, hidden, GPT_OSS_LAYERS, layer)
    d = _structured_draft(g, embed, perm, ids, in_d, hidden)
    d["input_norm.weight"] = torch.ones(3 * hidden)  # norm_before_fc
    return {"perm": perm, "ids": ids, "target": t, "draft": d}


def gpt_oss_config(bos_id: int, eos_id: int, *, hidden_size: int = GPT_OSS_HIDDEN, mxfp4: bool = False) -> dict:
    """config.json of the twin (transformers GptOssConfig)."""
    from transformers import GptOssConfig

    cfg = GptOssConfig(
        vocab_size=VOCAB, hidden_size=int(hidden_size), intermediate_size=int(hidden_size),
        num_hidden_layers=GPT_OSS_LAYERS, num_attention_heads=N_HEADS, num_key_value_heads=N_KV_HEADS,
        head_dim=HEAD_DIM, num_local_experts=GPT_OSS_EXPERTS, num_experts_per_tok=GPT_OSS_TOP_K,
        sliding_window=GPT_OSS_WINDOW, max_position_embeddings=MAX_POS, rms_norm_eps=RMS_EPS,
        **_rope_kwargs(GPT_OSS_ROPE), tie_word_embeddings=False, attention_bias=True,
        bos_token_id=bos_id, eos_token_id=eos_id, dtype="bfloat16",
    ).to_dict()
    cfg = _with_both_rope_forms(cfg, GPT_OSS_ROPE)
    cfg["architectures"] = ["GptOssForCausalLM"]
    if mxfp4:
        cfg["quantization_config"] = {
            "quant_method": "mxfp4",
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                       "model.embed_tokens", "lm_head"],
        }
    return cfg


def _write_gpt_oss_target(target_dir: Path, state: dict[str, torch.Tensor], tokenizer, *, hidden_size: int,
                          mxfp4: bool) -> None:
    """BF16 safetensors in HF GPT-OSS names; with ``mxfp4`` the experts' weights become
    ``*_blocks`` / ``*_scales`` (their biases stay BF16), as the openai/gpt-oss checkpoints ship."""
    from transformers import GenerationConfig

    bos_id = tokenizer.convert_tokens_to_ids(BOS)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if mxfp4 and k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[k + "_blocks"], out[k + "_scales"] = mxfp4_quantize(v.transpose(1, 2))
        else:
            out[k] = v.to(torch.bfloat16).contiguous()
    _save_safetensors(dict(sorted(out.items())), target_dir / "model.safetensors")
    cfg = gpt_oss_config(bos_id, eos_id, hidden_size=hidden_size, mxfp4=mxfp4)
    (target_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id).save_pretrained(str(target_dir))
    tokenizer.save_pretrained(str(target_dir))


def _make_tiny_gpt_oss_pair(out: Path, *, draft_format: str, seed: int, num_speculative_tokens: int,
                            max_model_len: int, dtype: str, target_format: str, hidden_size: int | None,
                            padded_hidden_size: int | None, tp_degree: int) -> Path:
    if draft_format != "speculators":
        raise ValueError(f"the GPT-OSS twin's draft is speculators-format (as the GPT-OSS-120B seed's), got {draft_format!r}")
    if target_format not in GPT_OSS_TARGET_FORMATS:
        raise ValueError(f"target_format for gpt-oss must be one of {GPT_OSS_TARGET_FORMATS}, got {target_format!r}")
    mxfp4 = target_format == "mxfp4"
    hidden = hidden_size or (GPT_OSS_MXFP4_HIDDEN if mxfp4 else GPT_OSS_HIDDEN)
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 2 or hidden % 2:
        raise ValueError(f"hidden_size must be a positive even int, got {hidden!r}")
    if mxfp4 and hidden % 32:
        raise ValueError(f"target_format='mxfp4' needs hidden_size (= intermediate) to be a multiple of 32 "
                         f"(MXFP4 packs 32 values along each expert's input dim), got {hidden}; e.g. 96")
    target_dir, draft_dir = out / "target", out / "draft"
    target_dir.mkdir(parents=True, exist_ok=True)
    draft_dir.mkdir(parents=True, exist_ok=True)
    s = gpt_oss_structure(seed, hidden_size=hidden)
    tokenizer = make_tiny_tokenizer()
    _write_gpt_oss_target(target_dir, s["target"], tokenizer, hidden_size=hidden, mxfp4=mxfp4)
    extra = {
        "norm_before_fc": True,
        "target_hidden_size": hidden,
        "eagle_aux_hidden_state_layer_ids": list(GPT_OSS_AUX_IDS),
    }
    _write_draft(draft_dir, "speculators", s["draft"], bos_id=tokenizer.convert_tokens_to_ids(BOS),
                 eos_id=tokenizer.convert_tokens_to_ids(EOS), num_speculative_tokens=num_speculative_tokens,
                 target_dir=target_dir, hidden_size=hidden, extra_config=extra)
    cfg_path = draft_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["speculators_config"]["verifier"]["architectures"] = ["GptOssForCausalLM"]
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    recipe = out / "recipe.yaml"
    _write_recipe(recipe, "speculators", dtype=dtype, k=num_speculative_tokens, max_model_len=max_model_len,
                  tp_degree=tp_degree, padded_hidden_size=padded_hidden_size,
                  name="tiny-gpt-oss" + ("-mxfp4" if mxfp4 else ""), prefill_buckets=(64,),
                  header=f"tiny random GPT-OSS target ({'MXFP4' if mxfp4 else 'BF16'}) + EAGLE3 draft, shaped like the GPT-OSS-120B seed")
    return recipe


# =================================================================================================
# public entry point
# =================================================================================================


def _check_common(num_speculative_tokens, max_model_len, tp_degree, padded_hidden_size) -> None:
    if int(num_speculative_tokens) < 1:
        raise ValueError("num_speculative_tokens must be >= 1")
    if isinstance(tp_degree, bool) or not isinstance(tp_degree, int) or tp_degree < 1:
        raise ValueError(f"tp_degree must be a positive int, got {tp_degree!r}")
    if padded_hidden_size is not None and (
        isinstance(padded_hidden_size, bool) or not isinstance(padded_hidden_size, int)
        or padded_hidden_size < 1
    ):
        raise ValueError(f"padded_hidden_size must be a positive int or None, got {padded_hidden_size!r}")
    lo = min_max_model_len(int(num_speculative_tokens))
    if not lo <= int(max_model_len) <= MAX_POS:
        raise ValueError(f"max_model_len must be in [{lo}, {MAX_POS}] for K {int(num_speculative_tokens)}")


def make_tiny_pair(
    out_dir: str | Path,
    *,
    draft_format: str = "speculators",
    seed: int = 0,
    num_speculative_tokens: int | None = None,
    max_model_len: int = 256,
    dtype: str = "float32",
    target_format: str = "hf",
    rope_scaling: bool | None = None,
    hidden_size: int | None = None,
    padded_hidden_size: int | None = None,
    tp_degree: int = 1,
    arch: str = "llama",
    sensitive_draft: bool = False,
    num_layers: int | None = None,
) -> Path:
    """Writes out_dir/target/, out_dir/draft/, out_dir/recipe.yaml; returns the recipe path.

    ``sensitive_draft=True`` (Llama only) applies ``sensitize_structure``: the draft then works only
    with the aux layer ids (and, for speculators drafts, the norm_before_residual) it was built for,
    as a trained draft does - what the fault-injection tests of ``eagle3-build verify`` need.

    ``arch="gpt-oss"`` writes the GPT-OSS twin instead (``gpt_oss_structure``): a BF16 (``target_format
    "hf"``, hidden 90) or MXFP4 (``"mxfp4"``, hidden 96: MXFP4 needs multiples of 32) GPT-OSS target, a
    speculators draft with ``norm_before_fc`` and a recipe mirroring the GPT-OSS-120B seed system (K 1 by default,
    max_num_seqs 1, one prefill bucket). The options below are the Llama pair's.

    The checkpoint files are always float32; ``dtype`` is the build dtype written into the recipe.
    The same ``seed`` gives byte-identical weight files (the speculators config records the absolute
    target path as its verifier, so that one file depends on ``out_dir``).

    ``target_format="gguf"`` also writes ``out_dir/target.gguf`` (``write_gguf``, F32) and points the
    recipe's ``target`` at it; ``out_dir/target/`` is kept (the draft configs refer to it).
    ``rope_scaling``: the target's llama3 rope scaling; ``None`` means on for ``"hf"`` and off for
    ``"gguf"`` (transformers' GGUF loader cannot express it, so ``rope_scaling=True`` with ``"gguf"``
    is refused). Same weights either way; only the rope differs.

    ``hidden_size``: the residual width of target and draft (``tiny_structure``); heads (4 q, 2 kv),
    head_dim 16 and intermediate 128 stay, so e.g. ``hidden_size=92`` gives q width 64 != hidden 92
    (as GPT-OSS: hidden 2880 padded to 3072, q width 4096). It must be a multiple of 4: transformers'
    ``LlamaConfig`` refuses ``hidden_size % num_attention_heads != 0`` even with an explicit head_dim.
    ``padded_hidden_size`` / ``tp_degree``: written into the recipe as
    ``parallel: {tp_degree: N, padded_hidden_size: P}`` (keys left at their default are omitted, and
    so is ``parallel`` when both are); they do not change the checkpoint files.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if sensitive_draft and arch != "llama":
        raise ValueError("sensitive_draft is implemented for the Llama pair only")
    if num_layers is None:
        num_layers = SENSITIVE_LAYERS if sensitive_draft else N_LAYERS
    if arch != "llama" and num_layers != N_LAYERS:
        raise ValueError("num_layers is the Llama pair's (the GPT-OSS twin has GPT_OSS_LAYERS)")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 4:
        raise ValueError(f"num_layers must be an int >= 4 (EAGLE3 reads three layers), got {num_layers!r}")
    if draft_format not in DRAFT_FORMATS:
        raise ValueError(f"draft_format must be one of {DRAFT_FORMATS}, got {draft_format!r}")
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"dtype must be one of {MODEL_DTYPES}, got {dtype!r}")
    if num_speculative_tokens is None:
        num_speculative_tokens = 1 if arch == "gpt-oss" else 3
    if arch == "gpt-oss":
        _check_common(num_speculative_tokens, max_model_len, tp_degree, padded_hidden_size)
        return _make_tiny_gpt_oss_pair(
            Path(out_dir).resolve(), draft_format=draft_format, seed=seed,
            num_speculative_tokens=int(num_speculative_tokens), max_model_len=int(max_model_len), dtype=dtype,
            target_format=target_format, hidden_size=hidden_size, padded_hidden_size=padded_hidden_size,
            tp_degree=tp_degree)
    if target_format not in TARGET_FORMATS:
        raise ValueError(f"target_format must be one of {TARGET_FORMATS}, got {target_format!r}")
    if rope_scaling is None:
        rope_scaling = target_format == "hf"
    if rope_scaling and target_format == "gguf":
        raise ValueError(
            "target_format='gguf' needs rope_scaling=False: transformers' GGUF loader reads no llama3 "
            "rope scaling for llama, see write_gguf"
        )
    _check_common(num_speculative_tokens, max_model_len, tp_degree, padded_hidden_size)
    hidden_size = _check_hidden_size(HIDDEN if hidden_size is None else hidden_size)

    out = Path(out_dir).resolve()
    target_dir, draft_dir = out / "target", out / "draft"
    target_dir.mkdir(parents=True, exist_ok=True)
    draft_dir.mkdir(parents=True, exist_ok=True)

    s = tiny_structure(seed, hidden_size=hidden_size, num_layers=num_layers)
    if sensitive_draft:
        sensitize_structure(s, effective_aux_ids(draft_format, num_layers), seed=seed,
                            scale_fc=draft_format == "speculators")
    tokenizer = make_tiny_tokenizer()
    bos_id = tokenizer.convert_tokens_to_ids(BOS)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)

    _write_target(target_dir, s["target"], tokenizer, rope_scaling=bool(rope_scaling),
                  hidden_size=hidden_size, num_layers=num_layers)
    target_ref = "./target"
    if target_format == "gguf":
        write_gguf(target_dir, out / "target.gguf", dtype="float32")
        target_ref = "./target.gguf"
    _write_draft(
        draft_dir,
        draft_format,
        s["draft"],
        bos_id=bos_id,
        eos_id=eos_id,
        num_speculative_tokens=int(num_speculative_tokens),
        target_dir=target_dir,
        hidden_size=hidden_size,
        num_layers=num_layers,
    )
    recipe = out / "recipe.yaml"
    _write_recipe(recipe, draft_format, dtype=dtype, k=int(num_speculative_tokens),
                  max_model_len=int(max_model_len), target=target_ref, tp_degree=int(tp_degree),
                  padded_hidden_size=None if padded_hidden_size is None else int(padded_hidden_size))
    return recipe


# =================================================================================================
# a draft that depends on its exact aux layer ids and norm_before_residual (verify fault injection)
# =================================================================================================
_MARK_VALUE = 2.0  # ~ the value a marker channel holds once its layer has written it
_MARK_UNITS = 32  # MLP units of a writer layer given to its marker
_MARK_DOMINANCE = 100.0  # how much a misplaced marker outweighs the draft's real input
_SENSITIVE_FC_SCALE = 0.002  # speculators drafts: fc output tiny unless hidden_norm rescales it


def sensitize_structure(s: dict, aux_ids: tuple[int, int, int], *, seed: int = 0, scale_fc: bool = True) -> dict:
    """Make a ``tiny_structure`` pair depend on its aux layer ids (and on norm_before_residual).

    The residual streams of neighbouring layers of the tiny target are nearly identical (the
    embedding dominates them), so a draft reading layers shifted by one works as well - unlike a
    trained draft on a real model. This makes the shift visible, in place:

    * the last two hidden channels become *marker* channels: zero in the embedding, read by nothing
      (their q/k/v/gate/up columns and lm_head columns are zero) and written only by layer ``a0``
      (marker A) and layer ``a1 - 1`` (marker B), each through 32 MLP units of its own whose
      output is positive (gate = up: silu(z)*z >= 0), ~``_MARK_VALUE``; every other o_proj /
      down_proj row of those channels is zero, so a marker, once written, stays unchanged;
    * the draft's fc adds ``v * (A(chunk0) + B(chunk2) - B(chunk1))`` to its output, with ``|v|``
      ~100x the rest: with the right ids (a0, a1, a2) that factor is exactly 0 (A is written after
      the state a0 enters layer a0; B is in both chunk 1 and chunk 2), with ids shifted by +1 chunk 0
      holds A, shifted by -1 chunk 1 lacks B - either way ``v`` swamps the draft, which then
      proposes one fixed token;
    * ``scale_fc`` (speculators drafts, norm_before_residual true): fc is scaled by 0.002, so the
      residual the layer adds to is useful only after hidden_norm; with norm_before_residual false
      the draft's own attention/MLP noise dominates.

    docs/tiny-pairs.md has the acceptance measured with and without each fault.
    """
    t, d = s["target"], s["draft"]
    H = t["model.embed_tokens.weight"].shape[1]
    a0, a1, _ = (int(i) for i in aux_ids)
    if not 0 <= a0 < a1 - 1:
        raise ValueError(f"sensitize_structure needs a0 < a1 - 1, got aux ids {tuple(aux_ids)}")
    mark_a, mark_b = H - 2, H - 1
    marks = [mark_a, mark_b]
    writers = {a0: mark_a, a1 - 1: mark_b}
    g = torch.Generator().manual_seed(10_000 + int(seed))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        t[name][:, marks] = 0
    for name in ("embed_tokens.weight", "lm_head.weight"):
        d[name][:, marks] = 0
    n_layers = 1 + max(int(k.split(".")[2]) for k in t if k.startswith("model.layers."))
    for li in range(n_layers):
        p = f"model.layers.{li}."
        for w in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            t[p + w + ".weight"][:, marks] = 0
        t[p + "self_attn.o_proj.weight"][marks] = 0
        t[p + "mlp.down_proj.weight"][marks] = 0
        if li in writers:
            w = torch.randn(_MARK_UNITS, H, generator=g) / math.sqrt(H - len(marks))
            w[:, marks] = 0
            t[p + "mlp.gate_proj.weight"][:_MARK_UNITS] = w
            t[p + "mlp.up_proj.weight"][:_MARK_UNITS] = w
            t[p + "mlp.down_proj.weight"][:, :_MARK_UNITS] = 0
            # mean of silu(z)*z for z ~ N(0, 1) is 1/2
            t[p + "mlp.down_proj.weight"][writers[li], :_MARK_UNITS] = 2 * _MARK_VALUE / _MARK_UNITS
    scale = _SENSITIVE_FC_SCALE if scale_fc else 1.0
    fc = d["fc.weight"] * scale
    for c in range(3):
        fc[:, [c * H + m for m in marks]] = 0
    v = torch.randn(H, generator=g)
    v[marks] = 0
    v *= _MARK_DOMINANCE * scale * math.sqrt(H) / _MARK_VALUE / v.norm()
    fc[:, mark_a] += v
    fc[:, 2 * H + mark_b] += v
    fc[:, H + mark_b] -= v
    d["fc.weight"] = fc
    return s
