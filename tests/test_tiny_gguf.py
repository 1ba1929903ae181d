"""Tests for the GGUF form of the tiny target: eagle3_build.testing.gguf / tiny.make_tiny_pair(target_format="gguf").

The GGUF file must round-trip through transformers' own GGUF loader
(``from_pretrained(dir, gguf_file=...)``): same logits as the HF-dir model, same greedy generations,
same tokenization (BOS included) and chat template; and it must be byte-deterministic.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from eagle3_build.testing import tiny
from eagle3_build.testing.gguf import write_gguf
from eagle3_build.testing.tiny import make_tiny_pair

H, V, NL, NH, NKV, HD = 64, 512, tiny.N_LAYERS, 4, 2, 16
PROMPTS = [
    "The weather this morning",
    "Speculative decoding lets a small",
    "Numbers such as 1, 2, 3",
    "hello world, this is a test",
]
STRINGS = PROMPTS + [
    "",
    "  leading spaces  and\nnewlines\n\n\ttabs ",
    "<|eot_id|>special<|begin_of_text|> tokens<|end_of_text|>",
    "ünïcødé 日本語 😀 -- e-mail@example.com, $9.99, 50% off, /usr/bin/env",
    "(a + b) * c = d, x < y, \"quotes\" and 'apostrophes' #tags",
]
GEN = 16


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny_gguf") / "p"
    recipe = make_tiny_pair(root, target_format="gguf", seed=0)
    assert recipe == (root / "recipe.yaml").resolve()
    return root


@pytest.fixture(scope="module")
def hf_model(pair):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(pair / "target")).eval()


@pytest.fixture(scope="module")
def gguf_model(pair):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(pair), gguf_file="target.gguf").eval()


@pytest.fixture(scope="module")
def hf_tok(pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(pair / "target"))


@pytest.fixture(scope="module")
def gguf_tok(pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(pair), gguf_file="target.gguf")


def _reader(path: Path):
    from gguf import GGUFReader

    return GGUFReader(str(path))


def _meta(reader, key):
    return reader.fields[key].contents()


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # transformers' LlamaTensorProcessor._reverse_permute_weights, written out independently
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --------------------------------------------------------------------------------------------------
# layout / metadata
# --------------------------------------------------------------------------------------------------
def test_layout_and_recipe(pair):
    assert (pair / "target.gguf").is_file()
    assert (pair / "target" / "config.json").is_file()  # the HF dir is kept
    assert (pair / "draft" / "config.json").is_file()
    (p,) = yaml.safe_load((pair / "recipe.yaml").read_text())["pairs"]
    assert p["target"] == "./target.gguf"
    assert p["draft"] == "./draft"
    # the GGUF-able target has plain rope (llama3 scaling is not expressible for transformers)
    rp = json.loads((pair / "target" / "config.json").read_text())["rope_parameters"]
    assert rp == {"rope_type": "default", "rope_theta": 500000.0}


def test_gguf_metadata(pair, hf_tok):
    from gguf import GGMLQuantizationType, TokenType

    r = _reader(pair / "target.gguf")
    expect = {
        "general.architecture": "llama",
        "llama.vocab_size": V,
        "llama.context_length": 1024,
        "llama.embedding_length": H,
        "llama.block_count": NL,
        "llama.feed_forward_length": 128,
        "llama.attention.head_count": NH,
        "llama.attention.head_count_kv": NKV,
        "llama.rope.dimension_count": HD,
        "llama.rope.freq_base": 500000.0,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.eot_token_id": 2,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.chat_template": tiny.CHAT_TEMPLATE,
    }
    for k, v in expect.items():
        assert _meta(r, k) == v, k
    assert _meta(r, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    assert not [k for k in r.fields if "rope.scaling" in k]

    tokens = _meta(r, "tokenizer.ggml.tokens")
    types = _meta(r, "tokenizer.ggml.token_type")
    vocab = hf_tok.get_vocab()
    assert len(tokens) == V and {t: i for i, t in enumerate(tokens)} == vocab
    assert types[:3] == [int(TokenType.CONTROL)] * 3
    assert set(types[3:]) == {int(TokenType.NORMAL)}
    assert len(_meta(r, "tokenizer.ggml.merges")) > 0

    names = [t.name for t in r.tensors]
    assert names[0] == "token_embd.weight" and names[-2:] == ["output_norm.weight", "output.weight"]
    assert len(names) == 3 + 9 * NL
    for li in range(NL):
        for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                  "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"):
            assert f"blk.{li}.{n}.weight" in names
    assert all(t.tensor_type == GGMLQuantizationType.F32 for t in r.tensors)
    assert "rope_freqs.weight" not in names


def test_qk_permutation(pair):
    from safetensors.torch import load_file

    sd = load_file(str(pair / "target" / "model.safetensors"))
    t = {x.name: np.asarray(x.data) for x in _reader(pair / "target.gguf").tensors}
    for li in (0, NL - 1):
        q = sd[f"model.layers.{li}.self_attn.q_proj.weight"].numpy()
        k = sd[f"model.layers.{li}.self_attn.k_proj.weight"].numpy()
        gq, gk = t[f"blk.{li}.attn_q.weight"], t[f"blk.{li}.attn_k.weight"]
        assert gq.shape == q.shape and gk.shape == k.shape
        assert not np.array_equal(gq, q) and not np.array_equal(gk, k)  # permuted...
        assert np.array_equal(_unpermute(gq, NH), q)  # ...as llama.cpp does
        assert np.array_equal(_unpermute(gk, NKV), k)
        v = sd[f"model.layers.{li}.self_attn.v_proj.weight"].numpy()
        assert np.array_equal(t[f"blk.{li}.attn_v.weight"], v)  # v is not permuted


# --------------------------------------------------------------------------------------------------
# round trip through transformers
# --------------------------------------------------------------------------------------------------
def test_gguf_config(gguf_model):
    c = gguf_model.config
    assert c.model_type == "llama"
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.intermediate_size, c.vocab_size) == (H, NL, NH, NKV, HD, 128, V)
    assert c.tie_word_embeddings is False
    assert c.rope_parameters["rope_type"] == "default"
    assert c.rope_parameters["rope_theta"] == 500000.0
    assert (c.bos_token_id, c.eos_token_id) == (0, 1)


def test_logits_match(hf_model, gguf_model, hf_tok):
    assert gguf_model.dtype == torch.float32
    with torch.no_grad():
        for text in PROMPTS:
            ids = torch.tensor([hf_tok(text)["input_ids"]])
            diff = (hf_model(ids).logits - gguf_model(ids).logits).abs().max().item()
            assert diff < 1e-5, (text, diff)
        ids = torch.randint(3, V, (2, 48), generator=torch.Generator().manual_seed(0))
        diff = (hf_model(ids).logits - gguf_model(ids).logits).abs().max().item()
        assert diff < 1e-5, diff


def test_greedy_generate_match(hf_model, gguf_model, hf_tok):
    perm = tiny.tiny_structure(0)["perm"]
    hits = []
    with torch.no_grad():
        for text in PROMPTS[:3]:
            ids = torch.tensor([hf_tok(text)["input_ids"]])
            kw = dict(max_new_tokens=GEN, min_new_tokens=GEN, do_sample=False, pad_token_id=0)
            a = hf_model.generate(ids, **kw)
            b = gguf_model.generate(ids, **kw)
            assert torch.equal(a, b), text
            p = ids.shape[1]
            hits.append(perm[a[0, p - 1:-1]] == a[0, p:])
    # the plain-rope target keeps the structure (mostly continues t with f(t))
    rate = torch.cat(hits).float().mean().item()
    assert 0.55 < rate < 0.95, rate


def test_tokenizer_match(hf_tok, gguf_tok):
    assert gguf_tok.bos_token == tiny.BOS and gguf_tok.eos_token == tiny.EOS
    # transformers builds a GGUF "gpt2" tokenizer as GPT2Tokenizer, whose default unk/bos/eos
    # "<|endoftext|>" it appends at id V when the vocabulary lacks it (as Llama-3's does); nothing in
    # the file can prevent that. Every real token keeps its id.
    extra = {t: i for t, i in gguf_tok.get_vocab().items() if i >= V}
    assert extra in ({}, {"<|endoftext|>": V})
    assert {t: i for t, i in gguf_tok.get_vocab().items() if i < V} == hf_tok.get_vocab()
    for s in STRINGS:
        a, b = hf_tok(s)["input_ids"], gguf_tok(s)["input_ids"]
        assert a == b, s
        assert a[0] == 0  # BOS
        assert hf_tok.decode(a) == gguf_tok.decode(b), s
        assert hf_tok.decode(a, skip_special_tokens=True) == gguf_tok.decode(b, skip_special_tokens=True), s
    msgs = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}]
    assert gguf_tok.chat_template == hf_tok.chat_template
    a = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    b = gguf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert a == b
    assert hf_tok(a, add_special_tokens=False)["input_ids"] == gguf_tok(b, add_special_tokens=False)["input_ids"]


def test_float16(pair, hf_model, tmp_path):
    from gguf import GGMLQuantizationType
    from transformers import AutoModelForCausalLM

    out = write_gguf(pair / "target", tmp_path / "t16.gguf", dtype="float16")
    assert out == tmp_path / "t16.gguf"
    r = _reader(out)
    for t in r.tensors:
        want = GGMLQuantizationType.F16 if len(t.shape) == 2 else GGMLQuantizationType.F32
        assert t.tensor_type == want, t.name
    m16 = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="t16.gguf").eval()
    # reference: the HF model with its matrices rounded to fp16 (norms stay fp32, as in the file)
    ref = AutoModelForCausalLM.from_pretrained(str(pair / "target")).eval()
    with torch.no_grad():
        for p in ref.parameters():
            if p.ndim == 2:
                p.copy_(p.half().float())
        ids = torch.tensor([[0, 5, 77, 300, 12, 9, 400, 41]])
        assert (ref(ids).logits - m16(ids).logits).abs().max().item() < 1e-5
        assert (hf_model(ids).logits - m16(ids).logits).abs().max().item() > 0  # it really is fp16


# --------------------------------------------------------------------------------------------------
# refusals, determinism
# --------------------------------------------------------------------------------------------------
def test_refuses_rope_scaling(pair, tmp_path):
    d = tmp_path / "llama3"
    shutil.copytree(pair / "target", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = dict(tiny.TARGET_ROPE)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="llama3"):
        write_gguf(d, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
    with pytest.raises(ValueError, match="dtype"):
        write_gguf(pair / "target", tmp_path / "x.gguf", dtype="bfloat16")
    with pytest.raises(ValueError, match="rope_scaling"):
        make_tiny_pair(tmp_path / "bad", target_format="gguf", rope_scaling=True)
    with pytest.raises(ValueError, match="target_format"):
        make_tiny_pair(tmp_path / "bad", target_format="onnx")
    assert not (tmp_path / "bad").exists()


def test_deterministic(pair, tmp_path):
    again = write_gguf(pair / "target", tmp_path / "again.gguf")
    assert _sha(again) == _sha(pair / "target.gguf")
    make_tiny_pair(tmp_path / "p", target_format="gguf", seed=0, draft_format="eagle")
    assert _sha(tmp_path / "p" / "target.gguf") == _sha(pair / "target.gguf")
    assert _sha(tmp_path / "p" / "target" / "model.safetensors") == _sha(pair / "target" / "model.safetensors")
