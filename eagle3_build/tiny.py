"""Tiny random Llama target + EAGLE3 draft pairs for tests and smoke checks.

``make_tiny_pair(out_dir)`` writes, in a few seconds and fully deterministically given ``seed``:

* ``out_dir/target/``  a transformers ``LlamaForCausalLM`` (8 layers, hidden 64, vocab 512,
  llama3 rope scaling, untied lm_head) + a byte-level BPE tokenizer with Llama-3 style specials;
* ``out_dir/draft/``   an EAGLE3 draft in one of the three on-disk formats of REFERENCE §2
  (``"eagle"``: SafeAILab ``pytorch_model.bin``; ``"speculators"``: RedHatAI; ``"specforge"``: SGLang);
* ``out_dir/recipe.yaml`` a build recipe pointing at both.

The weights are "structured random" so that the draft is useful but imperfect:

* target: token ``t`` mostly continues with ``f(t) = perm[t]`` (lm_head row ``j`` is the embedding of
  ``perm^-1[j]``); the decoder layers add enough context noise that the target does not follow ``f``
  every step;
* draft: ``fc`` picks the first aux chunk (~ the embedding of ``t_i``), the draft lm_head row for draft
  id ``k`` is the target embedding of ``g^-1(ids[k])`` with ``g = f∘f``, so the first draft step guesses
  ``t_{i+2} = g(t_i)``; tokens outside the draft vocabulary can never be proposed.

The draft vocabulary is closed under ``f`` (``perm`` maps it onto itself and its complement onto the
complement) and the target's lm_head favours draft-vocabulary tokens slightly (rows scaled by
``_TARGET_DRAFT_VOCAB_GAIN``), so that - as with a real frequency-built draft vocabulary - the target's
text mostly lives inside the draft vocabulary. Without that, a random 256-of-512 draft vocabulary caps
the draft's hit rate at ~50% of the already imperfect ``f∘f`` rate.

Measured (seeds 0-9, greedy, text prompts): the target follows ``f`` on 71-87% of steps; the draft's
first step proposes the target's token two ahead on 52-75% of positions (seed 0: 85% / 73%).
Recurrent draft steps (2..K) carry the step-1 state forward and mostly repeat its guess, so they are
nearly always rejected: with K=3 the acceptance length is mostly 1 or 2 (mean ~1.9 for seed 0).

No global RNG state is touched: all randomness comes from one seeded ``torch.Generator``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = [
    "DRAFT_FORMATS",
    "EFFECTIVE_AUX_IDS",
    "TINY_CORPUS",
    "SPECIAL_TOKENS",
    "make_tiny_pair",
    "make_tiny_tokenizer",
    "tiny_structure",
]

DRAFT_FORMATS = ("eagle", "speculators", "specforge")

# --- shapes --------------------------------------------------------------------------------------
VOCAB = 512
HIDDEN = 64
INTERMEDIATE = 128
N_LAYERS = 8
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
DRAFT_VOCAB = 256
DRAFT_ROPE_THETA = 10000.0

# aux layer ids (vLLM semantics: input of layer k) used by the eagle/speculators drafts: the default
DEFAULT_AUX_IDS = (2, N_LAYERS // 2, N_LAYERS - 3)
# SpecForge/SGLang semantics (output of layer k); effective vLLM ids are these + 1 = (1, 4, 6)
SPECFORGE_AUX_IDS = (0, 3, 5)
# effective aux ids (input of target layer k) per draft format
EFFECTIVE_AUX_IDS = {
    "eagle": DEFAULT_AUX_IDS,
    "speculators": DEFAULT_AUX_IDS,
    "specforge": tuple(k + 1 for k in SPECFORGE_AUX_IDS),
}

# --- weight scales (tuned: f-rate ~0.71-0.87, draft first-step hit ~0.52-0.75 over seeds 0-9) ---
_EMBED_STD = 1.0
_LAYER_STD = 0.08  # target q/k/v/gate/up
_OUT_STD = 0.18  # target o_proj/down_proj: sets how much context perturbs the residual stream
_CLOSED_DRAFT_VOCAB = True  # perm maps the draft vocab onto itself (see module docstring)
_TARGET_DRAFT_VOCAB_GAIN = 1.2  # target lm_head rows of draft-vocab tokens are scaled by this
_DRAFT_FC_NOISE = 0.01
_DRAFT_LAYER_STD = 0.02

SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")
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
def _randn(g: torch.Generator, *shape: int, std: float) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float32) * std


def tiny_structure(seed: int = 0) -> dict:
    """The hidden structure of the pair for ``seed``: ``perm`` (f), ``ids`` (draft vocab), all weights.

    Returned dict: ``perm`` [512] int64 (f(t) = perm[t]), ``ids`` [256] int64 sorted (draft vocab),
    ``target`` (transformers LlamaForCausalLM state dict), ``draft`` (draft tensors without prefix
    handling: keys ``fc.weight``, ``layer.<name>``, ``norm.weight``, ``lm_head.weight``, ``d2t``,
    ``t2d``, ``embed_tokens.weight``).
    """
    g = torch.Generator().manual_seed(int(seed))

    # ---- target ----
    embed = _randn(g, VOCAB, HIDDEN, std=_EMBED_STD)
    # draft vocabulary: a random subset, sorted
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

    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed}
    q_out, kv_out = N_HEADS * HEAD_DIM, N_KV_HEADS * HEAD_DIM
    std, ostd = _LAYER_STD, _OUT_STD
    for li in range(N_LAYERS):
        p = f"model.layers.{li}."
        t[p + "self_attn.q_proj.weight"] = _randn(g, q_out, HIDDEN, std=std)
        t[p + "self_attn.k_proj.weight"] = _randn(g, kv_out, HIDDEN, std=std)
        t[p + "self_attn.v_proj.weight"] = _randn(g, kv_out, HIDDEN, std=std)
        t[p + "self_attn.o_proj.weight"] = _randn(g, HIDDEN, q_out, std=ostd)
        t[p + "mlp.gate_proj.weight"] = _randn(g, INTERMEDIATE, HIDDEN, std=std)
        t[p + "mlp.up_proj.weight"] = _randn(g, INTERMEDIATE, HIDDEN, std=std)
        t[p + "mlp.down_proj.weight"] = _randn(g, HIDDEN, INTERMEDIATE, std=ostd)
        t[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        t[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN)
    t["model.norm.weight"] = torch.ones(HIDDEN)
    t["lm_head.weight"] = lm_head

    # ---- draft ----
    g2 = perm[perm]  # g = f∘f
    g2_inv = torch.empty_like(g2)
    g2_inv[g2] = torch.arange(VOCAB)
    fc = torch.zeros(HIDDEN, 3 * HIDDEN)
    fc[:, :HIDDEN] = torch.eye(HIDDEN)
    fc += _randn(g, HIDDEN, 3 * HIDDEN, std=_DRAFT_FC_NOISE)
    d: dict[str, torch.Tensor] = {"fc.weight": fc}
    d["layer.self_attn.q_proj.weight"] = _randn(g, q_out, 2 * HIDDEN, std=_DRAFT_LAYER_STD)
    d["layer.self_attn.k_proj.weight"] = _randn(g, kv_out, 2 * HIDDEN, std=_DRAFT_LAYER_STD)
    d["layer.self_attn.v_proj.weight"] = _randn(g, kv_out, 2 * HIDDEN, std=_DRAFT_LAYER_STD)
    d["layer.self_attn.o_proj.weight"] = _randn(g, HIDDEN, q_out, std=_DRAFT_LAYER_STD)
    d["layer.mlp.gate_proj.weight"] = _randn(g, INTERMEDIATE, HIDDEN, std=_DRAFT_LAYER_STD)
    d["layer.mlp.up_proj.weight"] = _randn(g, INTERMEDIATE, HIDDEN, std=_DRAFT_LAYER_STD)
    d["layer.mlp.down_proj.weight"] = _randn(g, HIDDEN, INTERMEDIATE, std=_DRAFT_LAYER_STD)
    d["layer.input_layernorm.weight"] = torch.ones(HIDDEN)
    d["layer.hidden_norm.weight"] = torch.ones(HIDDEN)
    d["layer.post_attention_layernorm.weight"] = torch.ones(HIDDEN)
    d["norm.weight"] = torch.ones(HIDDEN)
    d["lm_head.weight"] = embed[g2_inv[ids]].clone()
    d["d2t"] = (ids - torch.arange(DRAFT_VOCAB)).to(torch.int64)
    d["t2d"] = in_d.clone()
    d["embed_tokens.weight"] = embed.clone()

    return {"perm": perm, "ids": ids, "target": t, "draft": d}


# =================================================================================================
# writers
# =================================================================================================
def _target_config(bos_id: int, eos_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=N_HEADS,
        num_key_value_heads=N_KV_HEADS,
        head_dim=HEAD_DIM,
        hidden_act="silu",
        max_position_embeddings=MAX_POS,
        rms_norm_eps=RMS_EPS,
        rope_parameters=dict(TARGET_ROPE),
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        attention_bias=False,
        mlp_bias=False,
        dtype="float32",
    )


def _write_target(target_dir: Path, state: dict[str, torch.Tensor], tokenizer) -> None:
    from transformers import GenerationConfig, LlamaForCausalLM

    bos_id = tokenizer.convert_tokens_to_ids(BOS)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    cfg = _target_config(bos_id, eos_id)
    # Building the module runs transformers' random init: keep it off the global RNG.
    with torch.random.fork_rng(devices=[]):
        model = LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not k.endswith("inv_freq")]:
        raise RuntimeError(f"tiny target state mismatch: missing={missing} unexpected={unexpected}")
    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id)
    model.eval()
    model.save_pretrained(str(target_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(target_dir))


def _flat_draft_llama_config(bos_id: int, eos_id: int, *, rope_theta: float | None) -> dict:
    cfg = {
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
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
        cfg = _flat_draft_llama_config(bos_id, eos_id, rope_theta=None)  # no rope_theta -> 10000
        cfg.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=DRAFT_VOCAB,
                   torch_dtype="float32")
        torch.save(sd, draft_dir / "pytorch_model.bin")
    elif fmt == "specforge":
        cfg = _flat_draft_llama_config(bos_id, eos_id, rope_theta=DRAFT_ROPE_THETA)
        cfg.update(
            architectures=["LlamaForCausalLMEagle3"],
            draft_vocab_size=DRAFT_VOCAB,
            target_hidden_size=HIDDEN,
            eagle_config={
                "eagle_aux_hidden_state_layer_ids": list(SPECFORGE_AUX_IDS),
                "use_aux_hidden_state": True,
            },
            torch_dtype="float32",
        )
        _save_safetensors(sd, draft_dir / "model.safetensors")
    elif fmt == "speculators":
        layer_cfg = _flat_draft_llama_config(bos_id, eos_id, rope_theta=DRAFT_ROPE_THETA)
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
    (draft_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _save_safetensors(sd: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(sd, str(path), metadata={"format": "pt"})


def _write_recipe(path: Path, fmt: str, *, dtype: str, k: int, max_model_len: int) -> None:
    if fmt == "eagle":
        draft = (
            "    # the official EAGLE format is a pickle (pytorch_model.bin, torch.save): loading it needs\n"
            "    # torch.load, which the build only does when the recipe opts in explicitly\n"
            "    draft: {source: ./draft, allow_pickle: true}\n"
        )
    else:
        draft = "    draft: ./draft\n"
    text = (
        "# tiny random Llama target + EAGLE3 draft (eagle3_build.tiny.make_tiny_pair)\n"
        "pairs:\n"
        f"  - name: tiny-llama-{fmt}\n"
        "    target: ./target\n"
        f"{draft}"
        f"    dtype: {dtype}\n"
        f"    speculation: {{num_speculative_tokens: {int(k)}}}\n"
        f"    serving: {{max_num_seqs: 1, max_model_len: {int(max_model_len)}}}\n"
        "    # keep the number of graphs small\n"
        "    buckets: {prefill: [64, 128], batch: [1]}\n"
        "    backend: export\n"
    )
    path.write_text(text)


# =================================================================================================
# public entry point
# =================================================================================================
_DTYPES = ("float32", "bfloat16", "float16")


def make_tiny_pair(
    out_dir: str | Path,
    *,
    draft_format: str = "speculators",
    seed: int = 0,
    num_speculative_tokens: int = 3,
    max_model_len: int = 256,
    dtype: str = "float32",
) -> Path:
    """Writes out_dir/target/, out_dir/draft/, out_dir/recipe.yaml; returns the recipe path.

    The checkpoint files are always float32; ``dtype`` is the build dtype written into the recipe.
    The same ``seed`` gives byte-identical weight files (the speculators config records the absolute
    target path as its verifier, so that one file depends on ``out_dir``).
    """
    if draft_format not in DRAFT_FORMATS:
        raise ValueError(f"draft_format must be one of {DRAFT_FORMATS}, got {draft_format!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    if int(num_speculative_tokens) < 1:
        raise ValueError("num_speculative_tokens must be >= 1")
    if not (int(num_speculative_tokens) + 1 < int(max_model_len) <= MAX_POS):
        raise ValueError(f"max_model_len must be in ({int(num_speculative_tokens) + 1}, {MAX_POS}]")

    out = Path(out_dir).resolve()
    target_dir, draft_dir = out / "target", out / "draft"
    target_dir.mkdir(parents=True, exist_ok=True)
    draft_dir.mkdir(parents=True, exist_ok=True)

    s = tiny_structure(seed)
    tokenizer = make_tiny_tokenizer()
    bos_id = tokenizer.convert_tokens_to_ids(BOS)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)

    _write_target(target_dir, s["target"], tokenizer)
    _write_draft(
        draft_dir,
        draft_format,
        s["draft"],
        bos_id=bos_id,
        eos_id=eos_id,
        num_speculative_tokens=int(num_speculative_tokens),
        target_dir=target_dir,
    )
    recipe = out / "recipe.yaml"
    _write_recipe(recipe, draft_format, dtype=dtype, k=int(num_speculative_tokens),
                  max_model_len=int(max_model_len))
    return recipe
