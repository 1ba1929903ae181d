"""Tests for eagle3_build.testing.tiny: the tiny random Llama target + EAGLE3 draft pairs.

Besides file layout, the tests check that the pair has the intended structure: the target mostly (not
always) continues token t with f(t) = perm[t], and an independent pure-PyTorch EAGLE3 draft forward
(the EAGLE-3 draft of arXiv:2503.01840, written here from the on-disk files and configs only) proposes
the target's actual token two steps ahead for a clear majority of positions but not all of them.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from eagle3_build.testing import tiny
from eagle3_build.testing.tiny import DRAFT_FORMATS, make_tiny_pair

H, V, VD, NL = 64, 512, 256, tiny.N_LAYERS
# an "awkward" hidden size, as GPT-OSS (hidden 2880 padded to 3072, q width 4096 != hidden): q width
# stays 4 x 16 = 64. 90 itself cannot be loaded by transformers (hidden % num_attention_heads != 0).
H_ODD = 92
PROMPTS = [
    "The weather this morning",
    "Speculative decoding lets a small",
    "She opened the door and",
    "Compilers turn programs into",
    "Numbers such as 1, 2, 3",
    "hello world, this is a test",
]
GEN = 64


# --------------------------------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for fmt in DRAFT_FORMATS:
        recipe = make_tiny_pair(root / fmt, draft_format=fmt, seed=0)
        assert recipe == (root / fmt / "recipe.yaml").resolve()
        out[fmt] = root / fmt
    return out


@pytest.fixture(scope="module")
def odd_pairs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_odd")
    return {fmt: make_tiny_pair(root / fmt, draft_format=fmt, seed=0, hidden_size=H_ODD).parent
            for fmt in DRAFT_FORMATS}


@pytest.fixture(scope="module", params=[H, H_ODD], ids=lambda h: f"hidden{h}")
def hidden(request) -> int:
    return request.param


@pytest.fixture(scope="module")
def struct_pairs(request, hidden) -> dict[str, Path]:
    """The pairs for the structure tests: the default ones, or those with hidden_size=H_ODD."""
    return request.getfixturevalue("pairs" if hidden == H else "odd_pairs")


@pytest.fixture(scope="module")
def struct_target(request, hidden, struct_pairs):
    if hidden == H:
        return request.getfixturevalue("target")
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(struct_pairs["speculators"] / "target")).eval()


@pytest.fixture(scope="module")
def struct_generations(request, hidden, struct_target, tokenizer):
    if hidden == H:
        return request.getfixturevalue("generations")
    return _generate(struct_target, tokenizer)


@pytest.fixture(scope="module")
def target(pairs):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(pairs["speculators"] / "target"))
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer(pairs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(pairs["speculators"] / "target"))


@pytest.fixture(scope="module")
def generations(target, tokenizer):
    return _generate(target, tokenizer)


def _generate(target, tokenizer):
    """Greedy target generations: list of (token ids [P+GEN], prompt length P, hidden_states)."""
    out = []
    with torch.no_grad():
        for text in PROMPTS:
            ids = torch.tensor([tokenizer(text)["input_ids"]])
            seq = target.generate(
                ids, max_new_tokens=GEN, min_new_tokens=GEN, do_sample=False, pad_token_id=0
            )
            hs = target(seq, output_hidden_states=True).hidden_states
            out.append((seq[0], ids.shape[1], [h[0] for h in hs]))
    return out


def _load_draft(d: Path, fmt: str) -> dict[str, torch.Tensor]:
    if fmt == "eagle":
        return torch.load(d / "pytorch_model.bin", weights_only=True, map_location="cpu")
    return load_file(str(d / "model.safetensors"))


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


# --------------------------------------------------------------------------------------------------
# layout
# --------------------------------------------------------------------------------------------------
def _expected_draft_shapes(prefix: str, with_embed: bool,
                           H: int = H) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    f32 = torch.float32
    s = {
        "fc.weight": ((H, 3 * H), f32),
        f"{prefix}self_attn.q_proj.weight": ((64, 2 * H), f32),
        f"{prefix}self_attn.k_proj.weight": ((32, 2 * H), f32),
        f"{prefix}self_attn.v_proj.weight": ((32, 2 * H), f32),
        f"{prefix}self_attn.o_proj.weight": ((H, 64), f32),
        f"{prefix}mlp.gate_proj.weight": ((128, H), f32),
        f"{prefix}mlp.up_proj.weight": ((128, H), f32),
        f"{prefix}mlp.down_proj.weight": ((H, 128), f32),
        f"{prefix}input_layernorm.weight": ((H,), f32),
        f"{prefix}hidden_norm.weight": ((H,), f32),
        f"{prefix}post_attention_layernorm.weight": ((H,), f32),
        "norm.weight": ((H,), f32),
        "lm_head.weight": ((VD, H), f32),
        "d2t": ((VD,), torch.int64),
        "t2d": ((V,), torch.bool),
    }
    if with_embed:
        s["embed_tokens.weight"] = ((V, H), f32)
    return s


@pytest.mark.parametrize("fmt", DRAFT_FORMATS)
def test_draft_files_keys_shapes(pairs, fmt):
    d = pairs[fmt] / "draft"
    names = sorted(p.name for p in d.iterdir())
    weights = "pytorch_model.bin" if fmt == "eagle" else "model.safetensors"
    assert names == sorted(["config.json", weights])
    sd = _load_draft(d, fmt)
    prefix = "layers.0." if fmt == "speculators" else "midlayer."
    expected = _expected_draft_shapes(prefix, with_embed=(fmt == "speculators"))
    assert set(sd) == set(expected)
    for k, (shape, dtype) in expected.items():
        assert tuple(sd[k].shape) == shape, k
        assert sd[k].dtype == dtype, k
    if fmt == "eagle":  # plain tensors only: loads under weights_only=True (done above)
        assert all(type(v) is torch.Tensor for v in sd.values())


@pytest.mark.parametrize("fmt", DRAFT_FORMATS)
def test_draft_config(pairs, fmt):
    cfg = json.loads((pairs[fmt] / "draft" / "config.json").read_text())
    if fmt == "speculators":
        assert cfg["speculators_model_type"] == "eagle3"
        assert cfg["architectures"] == ["Eagle3Speculator"]
        assert cfg["draft_vocab_size"] == VD
        assert cfg["norm_before_residual"] is True
        assert cfg["target_hidden_size"] is None
        assert cfg["eagle_aux_hidden_state_layer_ids"] is None
        sc = cfg["speculators_config"]
        assert sc["algorithm"] == "eagle3"
        assert sc["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 3}]
        assert sc["default_proposal_method"] == "greedy"
        assert sc["verifier"]["architectures"] == ["LlamaForCausalLM"]
        assert Path(sc["verifier"]["name_or_path"]) == (pairs[fmt] / "target").resolve()
        layer = cfg["transformer_layer_config"]
        assert layer["rope_theta"] == 10000.0
    else:
        layer = cfg
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
        assert cfg["draft_vocab_size"] == VD
        assert "embed_tokens" not in json.dumps(cfg)
        if fmt == "eagle":
            assert "rope_theta" not in cfg and "eagle_config" not in cfg
        else:
            assert cfg["target_hidden_size"] == H
            assert cfg["eagle_config"] == {
                "eagle_aux_hidden_state_layer_ids": [0, 1, 2],
                "use_aux_hidden_state": True,
            }
    for key, val in dict(hidden_size=H, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=V, rms_norm_eps=1e-5,
                         bos_token_id=0, eos_token_id=1).items():
        assert layer[key] == val, key
    assert _aux_ids(cfg, fmt) == tiny.effective_aux_ids(fmt)


@pytest.mark.parametrize("fmt", DRAFT_FORMATS)
def test_vocab_maps(pairs, fmt):
    sd = _load_draft(pairs[fmt] / "draft", fmt)
    d2t, t2d = sd["d2t"], sd["t2d"]
    assert int(t2d.sum()) == VD
    ids = torch.nonzero(t2d).flatten()
    assert torch.equal(ids, torch.arange(VD) + d2t)
    assert torch.all(ids[1:] > ids[:-1])  # sorted ascending, unique
    assert torch.equal(ids, tiny.tiny_structure(0)["ids"])


@pytest.mark.parametrize("fmt", DRAFT_FORMATS)
def test_recipe(pairs, fmt):
    text = (pairs[fmt] / "recipe.yaml").read_text()
    r = yaml.safe_load(text)
    (p,) = r["pairs"]
    assert p["name"] == f"tiny-llama-{fmt}"
    assert p["target"] == "./target"
    if fmt == "eagle":
        assert p["draft"] == {"source": "./draft", "allow_pickle": True}
        assert "#" in text.split("allow_pickle")[0]  # a comment explains why
    else:
        assert p["draft"] == "./draft"
    assert p["dtype"] == "float32"
    assert p["speculation"] == {"num_speculative_tokens": 3}
    assert p["serving"] == {"max_num_seqs": 1, "max_model_len": 256}
    assert p["buckets"] == {"prefill": [64], "batch": [1]}
    assert p["backend"] == "export"


def test_recipe_options(tmp_path):
    r = make_tiny_pair(tmp_path, draft_format="specforge", seed=3, num_speculative_tokens=5,
                       max_model_len=200, dtype="bfloat16")
    p = yaml.safe_load(r.read_text())["pairs"][0]
    assert p["dtype"] == "bfloat16"
    assert p["speculation"] == {"num_speculative_tokens": 5}
    assert p["serving"]["max_model_len"] == 200
    with pytest.raises(ValueError):
        make_tiny_pair(tmp_path / "x", draft_format="medusa")
    with pytest.raises(ValueError):
        make_tiny_pair(tmp_path / "y", dtype="int8")
    from eagle3_build.recipe import min_max_model_len  # the recipe's rule, not a copy of it

    lo = min_max_model_len(3)
    with pytest.raises(ValueError, match=rf"max_model_len must be in \[{lo}, "):
        make_tiny_pair(tmp_path / "z", num_speculative_tokens=3, max_model_len=lo - 1)


# --------------------------------------------------------------------------------------------------
# target + tokenizer
# --------------------------------------------------------------------------------------------------
def test_target_files_identical_across_formats(pairs):
    names = sorted(p.name for p in (pairs["eagle"] / "target").iterdir())
    for needed in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                   "tokenizer_config.json"):
        assert needed in names
    for fmt in DRAFT_FORMATS[1:]:
        for n in names:
            assert _sha(pairs[fmt] / "target" / n) == _sha(pairs["eagle"] / "target" / n), n


def test_target_config_and_rope(pairs, target):
    cfg = json.loads((pairs["eagle"] / "target" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    for key, val in dict(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=NL,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=1024, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=1).items():
        assert cfg[key] == val, key
    rp = cfg["rope_parameters"]
    assert rp["rope_type"] == "llama3" and rp["rope_theta"] == 500000.0
    assert (rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]) == (8.0, 1.0, 4.0)
    assert rp["original_max_position_embeddings"] == 64

    # the reloaded model really applies llama3 scaling
    d, theta = 16, 500000.0
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    wavelen = 2 * math.pi / inv
    low_wl, high_wl = 64 / 1.0, 64 / 4.0
    scaled = torch.where(wavelen > low_wl, inv / 8.0, inv)
    smooth = (64 / wavelen - 1.0) / (4.0 - 1.0)
    smoothed = (1 - smooth) * scaled / 8.0 + smooth * scaled
    medium = (wavelen >= high_wl) & (wavelen <= low_wl)
    expected = torch.where(medium, smoothed, scaled)
    got = target.model.rotary_emb.inv_freq.double()
    assert not torch.allclose(got, inv, rtol=1e-3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-9)

    # state dict = the generated structure (lm_head row perm[t] is the embedding of t)
    s = tiny.tiny_structure(0)
    sd = load_file(str(pairs["eagle"] / "target" / "model.safetensors"))
    assert all(v.dtype == torch.float32 for v in sd.values())
    embed, lm = sd["model.embed_tokens.weight"], sd["lm_head.weight"]
    cos = torch.nn.functional.cosine_similarity(lm[s["perm"]], embed, dim=-1)
    assert torch.all(cos > 0.999)


def test_tokenizer(pairs, tokenizer):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(pairs["eagle"] / "target" / "tokenizer.json"))
    assert raw.get_vocab_size() == V and len(tokenizer) == V
    assert tokenizer.bos_token == "<|begin_of_text|>" and tokenizer.eos_token == "<|end_of_text|>"
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)
    assert tokenizer.convert_tokens_to_ids("<|eot_id|>") == 2
    for text in ["Hello world!", "The weather this morning was cold.", "ünïcödé 🙂\n\tx = 42;", ""]:
        a = tokenizer(text)["input_ids"]
        b = raw.encode(text).ids
        assert a == b, text
        assert a[0] == tokenizer.bos_token_id and a.count(0) == 1
        assert tokenizer.decode(a, skip_special_tokens=True) == text
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat.startswith("<|begin_of_text|>") and "<|eot_id|>" in chat


def test_target_follows_f_mostly(hidden, struct_generations):
    perm = tiny.tiny_structure(0, hidden_size=hidden)["perm"]
    hits = []
    for seq, plen, _ in struct_generations:
        assert len(seq) == plen + GEN
        cur, nxt = seq[plen - 1:-1], seq[plen:]
        hits.append(perm[cur] == nxt)
    rate = torch.cat(hits).float().mean().item()
    print(f"\n[tiny] hidden {hidden}: fraction of greedy target steps equal to f(current token): "
          f"{rate:.3f}")
    assert 0.55 < rate < 0.95, rate


# --------------------------------------------------------------------------------------------------
# independent EAGLE3 draft reference (EAGLE-3, arXiv:2503.01840), from the on-disk files only
# --------------------------------------------------------------------------------------------------
def _aux_ids(cfg: dict, fmt: str) -> tuple[int, int, int]:
    """Effective aux ids (input of target layer k), from the draft config alone."""
    default = (2, NL // 2, NL - 3)
    if "speculators_model_type" in cfg:
        ids = cfg.get("eagle_aux_hidden_state_layer_ids")
        return tuple(ids) if ids else default
    ec = cfg.get("eagle_config") or {}
    if ec.get("eagle_aux_hidden_state_layer_ids"):  # SGLang: output of layer k = input of k+1
        return tuple(k + 1 for k in ec["eagle_aux_hidden_state_layer_ids"])
    return default


def _rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class _RefDraft:
    def __init__(self, d: Path, fmt: str, target_embed: torch.Tensor):
        cfg = json.loads((d / "config.json").read_text())
        layer_cfg = cfg.get("transformer_layer_config", cfg)
        self.aux_ids = _aux_ids(cfg, fmt)
        self.nbr = bool(cfg.get("norm_before_residual", True)) if "speculators_model_type" in cfg else False
        self.theta = float(layer_cfg.get("rope_theta", 10000.0))
        self.eps = float(layer_cfg["rms_norm_eps"])
        self.nh, self.nkv, self.hd = (layer_cfg["num_attention_heads"],
                                      layer_cfg["num_key_value_heads"], layer_cfg["head_dim"])
        sd = _load_draft(d, fmt)
        p = "layers.0." if any(k.startswith("layers.0.") for k in sd) else "midlayer."
        self.w = {k[len(p):] if k.startswith(p) else k: v for k, v in sd.items()}
        self.embed = self.w.get("embed_tokens.weight", target_embed)

    def first_step(self, hidden_states, seq, *, use_d2t=True):
        """Proposal for t_{i+2} at each position i in [0, len(seq) - 2] (target ids)."""
        w, T = self.w, len(seq) - 1
        aux = torch.cat([hidden_states[k][:T] for k in self.aux_ids], -1)
        x = aux @ w["fc.weight"].T
        e = self.embed[seq[1:]]
        en = _rms(e, w["input_layernorm.weight"], self.eps)
        xn = _rms(x, w["hidden_norm.weight"], self.eps)
        res = xn if self.nbr else x
        inp = torch.cat([en, xn], -1)
        pos = torch.arange(T)
        q = (inp @ w["self_attn.q_proj.weight"].T).view(T, self.nh, self.hd).transpose(0, 1)
        k = (inp @ w["self_attn.k_proj.weight"].T).view(T, self.nkv, self.hd).transpose(0, 1)
        v = (inp @ w["self_attn.v_proj.weight"].T).view(T, self.nkv, self.hd).transpose(0, 1)
        q, k = _rope(q, pos, self.theta), _rope(k, pos, self.theta)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(self.hd)
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        o = (att @ v).transpose(0, 1).reshape(T, self.nh * self.hd) @ w["self_attn.o_proj.weight"].T
        r = res + o
        hn = _rms(r, w["post_attention_layernorm.weight"], self.eps)
        mlp = (torch.nn.functional.silu(hn @ w["mlp.gate_proj.weight"].T)
               * (hn @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
        out = r + mlp
        logits = _rms(out, w["norm.weight"], self.eps) @ w["lm_head.weight"].T
        a = logits.argmax(-1)
        return a + w["d2t"][a] if use_d2t else a


@pytest.mark.parametrize("fmt", DRAFT_FORMATS)
def test_draft_reference_predicts_two_ahead(hidden, struct_pairs, struct_target, struct_generations,
                                            fmt):
    embed = struct_target.model.embed_tokens.weight.detach()
    assert embed.shape == (V, hidden)
    ref = _RefDraft(struct_pairs[fmt] / "draft", fmt, embed)
    hits, hits_no_d2t = [], []
    with torch.no_grad():
        for seq, plen, hs in struct_generations:
            prop = ref.first_step(hs, seq)[:-1]  # the last proposal has nothing to compare with
            actual = seq[2:]
            sl = slice(plen - 2, None)  # positions whose t_{i+2} the target generated
            hits.append((prop == actual)[sl])
            hits_no_d2t.append((ref.first_step(hs, seq, use_d2t=False)[:-1] == actual)[sl])
    rate = torch.cat(hits).float().mean().item()
    broken = torch.cat(hits_no_d2t).float().mean().item()
    print(f"\n[tiny] hidden {hidden}, {fmt}: draft first-step proposal == target token two ahead: {rate:.3f} "
          f"(ignoring d2t: {broken:.3f}); aux ids {ref.aux_ids}")
    assert 0.4 < rate < 0.95, rate
    assert broken < rate / 2


# --------------------------------------------------------------------------------------------------
# determinism
# --------------------------------------------------------------------------------------------------
def test_deterministic_and_no_global_rng(pairs, tmp_path):
    before = torch.random.get_rng_state()
    make_tiny_pair(tmp_path / "again", draft_format="speculators", seed=0)
    make_tiny_pair(tmp_path / "other", draft_format="speculators", seed=1)
    assert torch.equal(before, torch.random.get_rng_state())
    first, again, other = pairs["speculators"], tmp_path / "again", tmp_path / "other"
    for rel in ("target/model.safetensors", "target/tokenizer.json", "draft/model.safetensors"):
        assert _sha(first / rel) == _sha(again / rel), rel
    assert _sha(first / "target/model.safetensors") != _sha(other / "target/model.safetensors")
    assert _sha(first / "draft/model.safetensors") != _sha(other / "draft/model.safetensors")


# --------------------------------------------------------------------------------------------------
# hidden_size != q width (GPT-OSS-like), parallel settings in the recipe
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", DRAFT_FORMATS)
def test_odd_hidden_files(odd_pairs, fmt):
    d = odd_pairs[fmt]
    sd = _load_draft(d / "draft", fmt)
    prefix = "layers.0." if fmt == "speculators" else "midlayer."
    expected = _expected_draft_shapes(prefix, with_embed=(fmt == "speculators"), H=H_ODD)
    assert {k: tuple(v.shape) for k, v in sd.items()} == {k: s for k, (s, _) in expected.items()}
    fc = sd["fc.weight"]  # identity on the first aux chunk, small noise elsewhere
    assert torch.allclose(fc[:, :H_ODD], torch.eye(H_ODD), atol=0.1)
    assert fc[:, H_ODD:].abs().max() < 0.1

    cfg = json.loads((d / "draft" / "config.json").read_text())
    layer = cfg.get("transformer_layer_config", cfg)
    assert (layer["hidden_size"], layer["num_attention_heads"], layer["head_dim"],
            layer["intermediate_size"]) == (H_ODD, 4, 16, 128)
    if fmt == "specforge":
        assert cfg["target_hidden_size"] == H_ODD

    tcfg = json.loads((d / "target" / "config.json").read_text())
    assert (tcfg["hidden_size"], tcfg["num_attention_heads"], tcfg["num_key_value_heads"],
            tcfg["head_dim"], tcfg["intermediate_size"]) == (H_ODD, 4, 2, 16, 128)
    tsd = load_file(str(d / "target" / "model.safetensors"))
    assert tuple(tsd["model.layers.0.self_attn.q_proj.weight"].shape) == (64, H_ODD)
    assert tuple(tsd["model.layers.0.self_attn.o_proj.weight"].shape) == (H_ODD, 64)
    assert tuple(tsd["lm_head.weight"].shape) == (V, H_ODD)
    assert "parallel" not in yaml.safe_load((d / "recipe.yaml").read_text())["pairs"][0]


def test_hidden_size_default_is_the_historical_pair(pairs):
    a, b = tiny.tiny_structure(0), tiny.tiny_structure(0, hidden_size=H)
    for part in ("target", "draft"):
        assert a[part].keys() == b[part].keys()
        assert all(torch.equal(a[part][k], b[part][k]) for k in a[part])
    c = tiny.tiny_structure(0, hidden_size=H_ODD)
    assert c["target"]["model.embed_tokens.weight"].shape == (V, H_ODD)
    assert c["draft"]["fc.weight"].shape == (H_ODD, 3 * H_ODD)


def test_odd_hidden_gguf_round_trip(tmp_path):
    """write_gguf needs no change: head_dim 16 != 92 // 4 goes out as llama.attention.key_length."""
    from transformers import LlamaForCausalLM

    make_tiny_pair(tmp_path, seed=0, hidden_size=H_ODD, target_format="gguf")
    hf = LlamaForCausalLM.from_pretrained(str(tmp_path / "target")).eval()
    gg = LlamaForCausalLM.from_pretrained(str(tmp_path), gguf_file="target.gguf").eval()
    assert (gg.config.hidden_size, gg.config.head_dim) == (H_ODD, 16)
    ids = torch.tensor([[0, 5, 17, 300, 42, 7, 99, 511]])
    with torch.no_grad():
        torch.testing.assert_close(gg(ids).logits, hf(ids).logits, rtol=0, atol=1e-5)


def test_recipe_parallel(tmp_path):
    def parallel(**kw):
        r = make_tiny_pair(tmp_path / str(len(list(tmp_path.iterdir()))), hidden_size=H_ODD, **kw)
        return yaml.safe_load(r.read_text())["pairs"][0].get("parallel")

    assert parallel() is None
    assert parallel(tp_degree=1) is None
    assert parallel(tp_degree=2) == {"tp_degree": 2}
    assert parallel(padded_hidden_size=96) == {"padded_hidden_size": 96}
    assert parallel(tp_degree=8, padded_hidden_size=96) == {"tp_degree": 8, "padded_hidden_size": 96}
    for bad in (dict(hidden_size=90), dict(hidden_size=0), dict(hidden_size=64.0),
                dict(tp_degree=0), dict(padded_hidden_size=0), dict(padded_hidden_size="96")):
        with pytest.raises(ValueError):
            make_tiny_pair(tmp_path / "bad", **bad)
