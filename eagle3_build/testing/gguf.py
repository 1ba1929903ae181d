"""Write a Llama checkpoint directory (config, safetensors, tokenizer) as one GGUF file in llama.cpp's
layout, so GGUF loading is tested without a model download; usable for your own tests too."""
from __future__ import annotations

import json
from pathlib import Path

import torch

EOT = "<|eot_id|>"  # Llama-3 end of turn: written as the GGUF eot token when the vocabulary has it



# =================================================================================================
# GGUF export of the target (llama.cpp conventions, loadable by transformers' GGUF reader)
# =================================================================================================
_GGUF_DTYPES = ("float32", "float16")


# HF per-layer suffix -> llama.cpp per-layer tensor name (gguf MODEL_TENSOR names for LLM_ARCH_LLAMA)
_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_permute(w: torch.Tensor, n_head: int, n_head_kv: int | None = None) -> torch.Tensor:
    """llama.cpp ``convert_hf_to_gguf.LlamaModel.permute``: HF's rotate-half q/k rows -> GGML's
    interleaved-pair layout. transformers' ``LlamaTensorProcessor._reverse_permute_weights`` undoes it."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _gguf_rope(cfg: dict) -> float:
    """The rope base of an HF Llama config; refuses any rope the GGUF round trip would change.

    llama.cpp carries llama3 rope scaling as a ``rope_freqs.weight`` tensor and linear/yarn scaling as
    ``llama.rope.scaling.*`` keys, but transformers' GGUF reader (``modeling_gguf_pytorch_utils``, the
    path ``general.architecture == "llama"`` takes) reads neither for llama: it maps only
    ``rope.freq_base`` -> ``rope_theta`` and silently drops unknown tensors. A scaled rope would load as
    plain rope with different logits, so it is refused here.
    """
    rp = dict(cfg.get("rope_parameters") or {})
    rs = dict(cfg.get("rope_scaling") or {})
    rope_type = rp.get("rope_type") or rs.get("rope_type") or rs.get("type") or "default"
    if rope_type != "default":
        raise ValueError(
            f"cannot write rope_type {rope_type!r} to GGUF: transformers' GGUF loader reads no rope "
            "scaling for llama (only rope.freq_base), so the model would load with a different rope; "
            "use a plain-rope target (e.g. make_tiny_pair(..., rope_scaling=False))"
        )
    prf = rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if prf not in (None, 1, 1.0):
        raise ValueError(f"cannot write partial_rotary_factor={prf} to GGUF")
    theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    return float(theta)


def _gguf_tokenizer(target_dir: Path, cfg: dict, vocab_size: int) -> dict:
    """Tokenizer metadata from ``tokenizer.json`` (byte-level BPE only, GPT-2 pre-tokenizer)."""
    from gguf import TokenType

    tj = json.loads((target_dir / "tokenizer.json").read_text())
    model = tj["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"only byte-level BPE tokenizers can be written to GGUF, got {model.get('type')!r}")
    pre = tj.get("pre_tokenizer") or {}
    if not (pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
            and not pre.get("add_prefix_space", False)):
        raise ValueError(
            "only the GPT-2 byte-level pre-tokenizer (ByteLevel, use_regex, no prefix space) maps onto "
            f"a GGUF tokenizer.ggml.pre this writer knows; got {pre}"
        )
    vocab: dict[str, int] = dict(model["vocab"])
    added = {int(a["id"]): a for a in tj.get("added_tokens", [])}
    for i, a in added.items():
        vocab[a["content"]] = i
    by_id = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i in added:
            tokens.append(added[i]["content"])
            types.append(int(TokenType.CONTROL if added[i].get("special") else TokenType.USER_DEFINED))
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(int(TokenType.NORMAL))
        else:  # as llama.cpp's converter: pad the vocabulary up to the model's
            tokens.append(f"[PAD{i}]")
            types.append(int(TokenType.UNUSED))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]

    tc_path = target_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.exists() else {}

    def _tok_id(key: str, tc_key: str) -> int | None:
        v = cfg.get(key)
        if isinstance(v, list):
            v = v[0] if v else None
        if v is None and isinstance(tc.get(tc_key), str):
            v = vocab.get(tc[tc_key])
        return None if v is None else int(v)

    bos_id = _tok_id("bos_token_id", "bos_token")
    eos_id = _tok_id("eos_token_id", "eos_token")
    # BOS is added when the post-processor's single-sequence template starts with the BOS token
    add_bos = tc.get("add_bos_token")
    if add_bos is None:
        pp = tj.get("post_processor") or {}
        single = pp.get("single") or [] if pp.get("type") == "TemplateProcessing" else []
        first = single[0].get("SpecialToken", {}).get("id") if single else None
        add_bos = bos_id is not None and first is not None and vocab.get(first) == bos_id
    chat_template = None
    if (target_dir / "chat_template.jinja").exists():
        chat_template = (target_dir / "chat_template.jinja").read_text()
    elif isinstance(tc.get("chat_template"), str):
        chat_template = tc["chat_template"]
    return {
        "tokens": tokens,
        "types": types,
        "merges": merges,
        "bos_id": bos_id,
        "eos_id": eos_id,
        "eot_id": vocab.get(EOT),
        "add_bos": bool(add_bos),
        "chat_template": chat_template,
    }


def write_gguf(target_dir: str | Path, out_file: str | Path, *, dtype: str = "float32") -> Path:
    """Convert an HF Llama target dir (config.json, *.safetensors, tokenizer.json) to one GGUF file.

    Follows llama.cpp's ``convert_hf_to_gguf`` for ``LlamaForCausalLM``: architecture ``llama``,
    tensor names ``token_embd`` / ``blk.N.{attn_norm,attn_q,attn_k,attn_v,attn_output,ffn_norm,
    ffn_gate,ffn_up,ffn_down}`` / ``output_norm`` / ``output`` (omitted when tied), attn_q/attn_k rows
    permuted to GGML's rope layout, the ``llama.*`` hyper-parameters and a ``gpt2`` (byte-level BPE)
    tokenizer with ``tokenizer.ggml.pre = "gpt-2"`` and the chat template. ``dtype``: ``"float32"``
    (all F32) or ``"float16"`` (2-D weights F16, norms F32, as llama.cpp's ``--outtype f16``).

    Raises ``ValueError`` for what the GGUF round trip through transformers cannot keep: any rope
    scaling (llama3/linear/yarn...: transformers' llama GGUF reader ignores it), biases, a
    non-``silu`` MLP, a non-byte-level tokenizer. The output is a pure function of the inputs
    (same target dir contents -> byte-identical file).
    """
    import numpy as np
    from gguf import GGUFWriter, LlamaFileType
    from safetensors.torch import load_file

    if dtype not in _GGUF_DTYPES:
        raise ValueError(f"dtype must be one of {_GGUF_DTYPES}, got {dtype!r}")
    target_dir, out_file = Path(target_dir), Path(out_file)
    cfg = json.loads((target_dir / "config.json").read_text())
    if cfg.get("model_type") != "llama":
        raise ValueError(f"write_gguf handles Llama targets only, got model_type={cfg.get('model_type')!r}")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ValueError("cannot write a Llama with attention/mlp biases to GGUF")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"cannot write hidden_act={cfg.get('hidden_act')!r} to GGUF (llama is silu)")
    rope_theta = _gguf_rope(cfg)

    hidden = int(cfg["hidden_size"])
    n_layers = int(cfg["num_hidden_layers"])
    n_head = int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads") or n_head)
    head_dim = int(cfg.get("head_dim") or hidden // n_head)
    vocab_size = int(cfg["vocab_size"])
    tok = _gguf_tokenizer(target_dir, cfg, vocab_size)

    state: dict[str, torch.Tensor] = {}
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in {target_dir}")
    for f in files:
        state.update(load_file(str(f)))
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    tied = "lm_head.weight" not in state

    names: list[tuple[str, str]] = [("model.embed_tokens.weight", "token_embd.weight")]
    for li in range(n_layers):
        names += [(f"model.layers.{li}.{h}", f"blk.{li}.{g}") for h, g in _GGUF_LAYER_NAMES.items()]
    names.append(("model.norm.weight", "output_norm.weight"))
    if not tied:
        names.append(("lm_head.weight", "output.weight"))
    missing = [h for h, _ in names if h not in state]
    unknown = sorted(set(state) - {h for h, _ in names})
    if missing or unknown:
        raise ValueError(f"unexpected Llama state dict: missing={missing} unknown={unknown}")

    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_name(out_file.name + ".tmp")
    w = GGUFWriter(str(tmp), "llama")
    w.add_name(target_dir.name)
    w.add_file_type(int(LlamaFileType.ALL_F32 if dtype == "float32" else LlamaFileType.MOSTLY_F16))
    w.add_quantization_version(2)  # GGML_QUANT_VERSION
    w.add_vocab_size(vocab_size)
    w.add_context_length(int(cfg.get("max_position_embeddings", 2048)))
    w.add_embedding_length(hidden)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(rope_theta)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    if head_dim != hidden // n_head:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    if tok["bos_id"] is not None:
        w.add_bos_token_id(tok["bos_id"])
    if tok["eos_id"] is not None:
        w.add_eos_token_id(tok["eos_id"])
    if tok["eot_id"] is not None:
        w.add_eot_token_id(int(tok["eot_id"]))
    w.add_add_bos_token(tok["add_bos"])
    w.add_add_eos_token(False)
    if tok["chat_template"] is not None:
        w.add_chat_template(tok["chat_template"])

    for hf_name, gguf_name in names:
        t = state[hf_name].to(torch.float32)
        if gguf_name.endswith("attn_q.weight"):
            t = _gguf_permute(t, n_head, n_head)
        elif gguf_name.endswith("attn_k.weight"):
            t = _gguf_permute(t, n_head, n_kv)
        arr = t.contiguous().numpy()
        if dtype == "float16" and arr.ndim > 1:
            arr = arr.astype(np.float16)
        w.add_tensor(gguf_name, np.ascontiguousarray(arr))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(out_file)
    return out_file
