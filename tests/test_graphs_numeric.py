"""Graph modules vs independent references: the target vs transformers (logits + aux states), the
draft vs an EAGLE3 forward written from the spec (the EAGLE-3 paper, arXiv:2503.01840, and vLLM's
vllm/model_executor/models/llama_eagle3.py) for every norm flag combination."""
import itertools

import pytest
import torch
import torch.nn.functional as F

from eagle3_build.graphs import DraftCatchup, DraftPrefill, DraftStep, TargetPrefill, TargetVerify
from eagle3_build.models.eagle3 import Eagle3Args, Eagle3Draft
from eagle3_build.models.llama import Llama, LlamaArgs
from eagle3_runtime.speculation import chain

CHAIN = chain(3)


R0 = torch.tensor([0])  # rank 0 of TP 1


def bind(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    for name, t in weights.items():
        parent, _, leaf = name.rpartition(".")
        mod = model.get_submodule(parent) if parent else model
        if leaf in mod._parameters:
            mod._parameters[leaf] = torch.nn.Parameter(t, requires_grad=False)
        else:
            mod._buffers[leaf] = t
    return model


def test_target_prefill_and_verify_match_transformers(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=6,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
                      max_position_embeddings=512, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 32})
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).eval()
    args = LlamaArgs(vocab_size=300, hidden_size=48, intermediate_size=96, num_layers=6, num_heads=6,
                     num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, tie_word_embeddings=True,
                     rope=dict(cfg.rope_parameters), max_position_embeddings=512)
    aux_ids = (2, 3, 3)
    with torch.device("meta"):
        model = Llama(args, aux_ids)
    sd = {k.removeprefix("model."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    model = bind(model, sd)
    tokens = torch.randint(0, 300, (1, 41))
    with torch.no_grad():
        ref = hf(tokens, output_hidden_states=True)
    kv = torch.zeros(model.kv_shape(2, 64))
    S, n = 48, 37  # bucket 48, 37 real tokens, cache row 1
    padded = torch.zeros(1, S, dtype=torch.long)
    padded[0, :n] = tokens[0, :n]
    logits, aux = TargetPrefill(model, CHAIN)(kv, R0, padded, torch.tensor([1]), torch.tensor([n - 1]))
    torch.testing.assert_close(logits[0], ref.logits[0, n - 1], atol=1e-4, rtol=1e-4)
    ref_aux = torch.cat([ref.hidden_states[i][0, :n] for i in aux_ids], -1)
    torch.testing.assert_close(aux[0, :n], ref_aux, atol=1e-4, rtol=1e-4)
    # verify the remaining 4 tokens from cache row 0, batch bucket 2 (row 1 is a padded slot)
    kv[:, :, 0] = kv[:, :, 1]  # verify reads rows 0..b-1: move the sequence to row 0
    toks = torch.stack([tokens[0, n:n + 4], torch.zeros(4, dtype=torch.long)])
    start = torch.tensor([n, 0])
    causal = torch.ones(4, 4, dtype=torch.bool).tril().repeat(2, 1, 1)
    v_logits, v_aux = TargetVerify(model, CHAIN)(kv, R0, toks, start[:, None] + torch.arange(4), start, causal)
    torch.testing.assert_close(v_logits[0], ref.logits[0, n:n + 4], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v_aux[0], torch.cat([ref.hidden_states[i][0, n:n + 4] for i in aux_ids], -1),
                               atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------ draft vs the spec

H, HT, V, VD, NH, NKV, HD = 32, 40, 200, 64, 4, 2, 8


def rms(x, w, eps=1e-5):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta=10000.0):  # x [T, h, d]
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    f = pos[:, None].float() * inv
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def ref_draft(w, flags, xs, next_tokens, positions, past=None):
    """EAGLE3 draft forward over a sequence, written from the spec (module doc). xs: fc output or recurrent
    hidden per position; past: (k, v) of earlier positions. Returns out, token, (k, v)."""
    e = w["embed_tokens.weight"][next_tokens]
    en, xn = rms(e, w["midlayer.input_layernorm.weight"]), rms(xs, w["midlayer.hidden_norm.weight"])
    res = xn if flags["norm_before_residual"] else xs
    h = torch.cat([en, xn], -1)
    T = h.shape[0]
    q = rope((h @ w["midlayer.self_attn.q_proj.weight"].T).view(T, NH, HD), positions)
    k = rope((h @ w["midlayer.self_attn.k_proj.weight"].T).view(T, NKV, HD), positions)
    v = (h @ w["midlayer.self_attn.v_proj.weight"].T).view(T, NKV, HD)
    if past is not None:
        k, v = torch.cat([past[0], k]), torch.cat([past[1], v])
    kk, vv = k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)
    s = torch.einsum("thd,shd->hts", q, kk) / HD ** 0.5
    S = kk.shape[0]
    mask = torch.arange(S)[None, :] <= torch.arange(S - T, S)[:, None]
    a = torch.einsum("hts,shd->thd", s.masked_fill(~mask, float("-inf")).softmax(-1), vv).reshape(T, NH * HD)
    r = res + a @ w["midlayer.self_attn.o_proj.weight"].T
    m = rms(r, w["midlayer.post_attention_layernorm.weight"])
    out = r + (F.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T)) \
        @ w["midlayer.mlp.down_proj.weight"].T
    idx = (rms(out, w["norm.weight"]) @ w["lm_head.weight"].T).argmax(-1)
    return out, idx + w["d2t"][idx], (k, v)


def ref_fc(w, flags, aux):
    if flags["norm_before_fc"]:
        aux = rms(aux, w["input_norm.weight"])
    return aux @ w["fc.weight"].T


@pytest.mark.parametrize("nbr,nbfc", list(itertools.product([False, True], [False, True])))
def test_draft_graphs_match_spec(nbr, nbfc):
    flags = {"norm_before_residual": nbr, "norm_before_fc": nbfc}
    a = Eagle3Args(hidden_size=H, intermediate_size=64, num_heads=NH, num_kv_heads=NKV, head_dim=HD,
                   rms_norm_eps=1e-5, vocab_size=V, draft_vocab_size=VD, target_hidden_size=HT,
                   aux_layer_ids=(2, 3, 4), norm_before_residual=nbr, norm_before_fc=nbfc)
    with torch.device("meta"):
        draft = Eagle3Draft(a)
    g = torch.Generator().manual_seed(1)
    w = {}
    for name, p in draft.named_parameters():
        w[name] = (1.0 + 0.3 * torch.randn(p.shape, generator=g)) if p.dim() == 1 else \
            torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5
    ids = torch.sort(torch.randperm(V, generator=g)[:VD]).values
    w["d2t"] = ids - torch.arange(VD)
    draft = bind(draft, w)
    n, S = 9, 16
    aux = torch.randn(1, S, 3 * HT, generator=g)
    nxt = torch.randint(0, V, (1, S), generator=g)
    kv = torch.zeros(draft.kv_shape(1, 64))
    tok, _, hid = DraftPrefill(draft, CHAIN)(kv, R0, aux, nxt, torch.tensor([0]), torch.tensor([n - 1]))
    out, rtok, past = ref_draft(w, flags, ref_fc(w, flags, aux[0, :n]), nxt[0, :n], torch.arange(n))
    assert tok.item() == rtok[-1].item()
    torch.testing.assert_close(hid[0], out[-1], atol=1e-4, rtol=1e-4)
    # one recurrent step at position n
    # (a chain's step 1 at position n writes slot n = start + 0 and sees it)
    tok2, _, hid2 = DraftStep(draft, CHAIN)(kv, R0, hid[:, None], tok, torch.tensor([[n]]), torch.tensor([[n]]),
                                            torch.tensor([n]), torch.tensor([[[True, False]]]))
    out2, rtok2, past2 = ref_draft(w, flags, out[-1:], rtok[-1:], torch.tensor([n]), past)
    assert tok2.item() == rtok2[-1].item()
    torch.testing.assert_close(hid2[0, 0], out2[-1], atol=1e-4, rtol=1e-4)
    # catch-up over K+1 = 3 positions n..n+2 (2 valid), overwriting the recurrent step's cache entry
    aux_c = torch.randn(1, 3, 3 * HT, generator=g)
    nxt_c = torch.randint(0, V, (1, 3), generator=g)
    tok3, _, hid3 = DraftCatchup(draft, CHAIN)(kv, R0, aux_c, nxt_c, torch.tensor([n]), torch.tensor([1]))
    out3, rtok3, _ = ref_draft(w, flags, ref_fc(w, flags, aux_c[0, :2]), nxt_c[0, :2], torch.arange(n, n + 2), past)
    assert tok3.item() == rtok3[-1].item()
    torch.testing.assert_close(hid3[0], out3[-1], atol=1e-4, rtol=1e-4)
