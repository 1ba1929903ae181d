"""End to end through compiled bundles: with temperature 1 the tokens the engine emits WITH speculation
follow the target's own distribution, for a reasonable draft and for a deliberately bad one.

tests/test_sampling.py checks `verify_sampled` on fixed logits; this file checks the whole path: prefill
sampling, draft proposals from the compiled draft graphs, the verify pass, acceptance/rejection,
truncation at EOS and max_tokens, and the catch-up between rounds. A hand-built pair with a 16-token
vocabulary makes the exact target distribution computable with transformers:

* target: a random 4-layer Llama (hidden 32). Residual channel 0 is a constant (every embedding has
  it = ``_BIAS_CHANNEL``; no layer writes to it), so lm_head column 0 acts as a per-token logit bias:
  EOS is made rare-but-possible and ``BAD`` unlikely (~0.5%), the other tokens stay spread out.
* "good" draft: fc passes the target's last aux state through, lm_head/embedding are the target's, the
  decoder layer is small random noise: it proposes roughly the target's favourite next token
  (first-position acceptance ~27%).
* "bad" draft: fc keeps only the constant channel and lm_head maps it to ``BAD`` alone, so every
  proposal is the token the target finds unlikely: drafts are almost always rejected and the emitted
  tokens come from the residual distribution.

The trials run batched (8 sequence slots, `Engine.generate_many`: one prefill per step while the other rows
decode and speculate together), so batched speculative sampling is checked too: each request keeps its own
generator. With max_tokens=3, x1 comes from the prefill sample and x2/x3 from the speculative rounds. Their
empirical marginals (plus a "stopped" category after EOS) are compared with the exact marginals by total
variation distance, against a threshold from a Monte-Carlo null (TV of the same number of direct
multinomial draws from the exact distribution; 200 repetitions, 99.9th percentile). Negative controls
(monkeypatched samplers that always accept, or that skip the residual correction) must fail the check.
"""
from __future__ import annotations

import collections
import json
import time

import pytest
import torch

torch.set_num_threads(1)

V, H, INTER, N_LAYERS, N_HEADS, N_KV, HEAD_DIM = 16, 32, 64, 4, 4, 2, 8
K = 3
MAX_TOKENS = 3
STOP = V  # extra category: the sequence ended (EOS) before this position
TOKENS = ["<unk>", "<s>", "</s>"] + [chr(ord("a") + i) for i in range(V - 3)]
BOS, EOS = 1, 2
BAD = V - 1  # the token the bad draft always proposes
PROMPT = [BOS, 5, 9, 3]
AUX_IDS = [1, 2, 3]  # input of target layers 1..3 (vLLM semantics)

_BIAS_CHANNEL = 6.0  # value of residual channel 0 (constant: embeddings have it, no layer writes it)
_LAYER_STD = 0.3
_LM_STD = 0.25  # -> max next-token probability ~0.3-0.4
_EOS_BIAS, _BAD_BIAS = -4.0, -5.0  # lm_head column 0 for EOS / BAD: P(EOS) ~2%/step, P(BAD) ~0.5%
_DRAFT_STD, _DRAFT_FC_NOISE = 0.02, 0.01

N_TRIALS = 800  # per draft (the no_residual control fails at 400)
SEQS = 8  # sequence slots: trials run batched, as a server batches concurrent requests
N_CONTROL = {"always_accept": 150, "no_residual": 400}
NULL_REPS, QUANTILE = 200, 0.999


# ------------------------------------------------------------------------------------------ the pair


def _randn(g, *shape, std):
    return torch.randn(*shape, generator=g) * std


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(TOKENS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    assert len(hf) == V and hf.bos_token_id == BOS and hf.eos_token_id == EOS
    return hf


def _target_state(g) -> dict[str, torch.Tensor]:
    embed = _randn(g, V, H, std=1.0)
    embed[:, 0] = _BIAS_CHANNEL
    sd = {"model.embed_tokens.weight": embed}
    q, kv = N_HEADS * HEAD_DIM, N_KV * HEAD_DIM
    for li in range(N_LAYERS):
        p = f"model.layers.{li}."
        sd[p + "self_attn.q_proj.weight"] = _randn(g, q, H, std=_LAYER_STD)
        sd[p + "self_attn.k_proj.weight"] = _randn(g, kv, H, std=_LAYER_STD)
        sd[p + "self_attn.v_proj.weight"] = _randn(g, kv, H, std=_LAYER_STD)
        sd[p + "self_attn.o_proj.weight"] = _randn(g, H, q, std=_LAYER_STD)
        sd[p + "mlp.gate_proj.weight"] = _randn(g, INTER, H, std=_LAYER_STD)
        sd[p + "mlp.up_proj.weight"] = _randn(g, INTER, H, std=_LAYER_STD)
        sd[p + "mlp.down_proj.weight"] = _randn(g, H, INTER, std=_LAYER_STD)
        sd[p + "self_attn.o_proj.weight"][0] = 0.0  # nothing writes residual channel 0
        sd[p + "mlp.down_proj.weight"][0] = 0.0
        sd[p + "input_layernorm.weight"] = torch.ones(H)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(H)
    sd["model.norm.weight"] = torch.ones(H)
    lm = _randn(g, V, H, std=_LM_STD)
    lm[:, 0] = 0.0
    lm[EOS, 0], lm[BAD, 0] = _EOS_BIAS, _BAD_BIAS
    sd["lm_head.weight"] = lm
    return sd


def _write_target(d, sd, tok):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=INTER, num_hidden_layers=N_LAYERS,
                      num_attention_heads=N_HEADS, num_key_value_heads=N_KV, head_dim=HEAD_DIM,
                      max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      bos_token_id=BOS, eos_token_id=EOS, attention_bias=False, mlp_bias=False)
    with torch.random.fork_rng(devices=[]):  # transformers' random init: keep it off the global RNG
        model = LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all(k.endswith("inv_freq") for k in missing), (missing, unexpected)
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS)
    model.eval()
    model.save_pretrained(str(d))
    tok.save_pretrained(str(d))
    return model


def _draft_state(g, target: dict[str, torch.Tensor], bad: bool) -> dict[str, torch.Tensor]:
    """speculators layout (`layers.0.*`, own embed_tokens); draft vocab = target vocab, so no d2t."""
    q, kv = N_HEADS * HEAD_DIM, N_KV * HEAD_DIM
    fc = torch.zeros(H, 3 * H)
    fc[:, 2 * H:] = torch.eye(H)  # x = the last aux chunk (input of target layer 3)
    p = "layers.0."
    sd = {
        "fc.weight": fc + _randn(g, H, 3 * H, std=_DRAFT_FC_NOISE),
        p + "self_attn.q_proj.weight": _randn(g, q, 2 * H, std=_DRAFT_STD),
        p + "self_attn.k_proj.weight": _randn(g, kv, 2 * H, std=_DRAFT_STD),
        p + "self_attn.v_proj.weight": _randn(g, kv, 2 * H, std=_DRAFT_STD),
        p + "self_attn.o_proj.weight": _randn(g, H, q, std=_DRAFT_STD),
        p + "mlp.gate_proj.weight": _randn(g, INTER, H, std=_DRAFT_STD),
        p + "mlp.up_proj.weight": _randn(g, INTER, H, std=_DRAFT_STD),
        p + "mlp.down_proj.weight": _randn(g, H, INTER, std=_DRAFT_STD),
        p + "input_layernorm.weight": torch.ones(H),
        p + "hidden_norm.weight": torch.ones(H),
        p + "post_attention_layernorm.weight": torch.ones(H),
        "norm.weight": torch.ones(H),
        "lm_head.weight": target["lm_head.weight"].clone(),
        "embed_tokens.weight": target["model.embed_tokens.weight"].clone(),
    }
    if bad:
        # out[0] = hidden_norm(x)[0] > 0 always (x[0] = the constant channel, no layer writes channel 0);
        # lm_head reads only channel 0 and only for BAD: logit(BAD) > 0 = every other logit
        fc = torch.zeros(H, 3 * H)
        fc[0, 0] = 1.0
        sd["fc.weight"] = fc
        sd[p + "self_attn.o_proj.weight"][0] = 0.0
        sd[p + "mlp.down_proj.weight"][0] = 0.0
        lm = torch.zeros(V, H)
        lm[BAD, 0] = 1.0
        sd["lm_head.weight"] = lm
    return sd


def _write_draft(d, sd, target_dir):
    from safetensors.torch import save_file

    d.mkdir(parents=True)
    layer = {"model_type": "llama", "hidden_act": "silu", "hidden_size": H, "intermediate_size": INTER,
             "num_attention_heads": N_HEADS, "num_key_value_heads": N_KV, "head_dim": HEAD_DIM,
             "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "vocab_size": V, "max_position_embeddings": 128,
             "bos_token_id": BOS, "eos_token_id": EOS, "tie_word_embeddings": False, "attention_bias": False,
             "mlp_bias": False, "rope_theta": 10000.0, "rope_scaling": None}
    cfg = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": K}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(target_dir), "architectures": ["LlamaForCausalLM"]},
        },
        "draft_vocab_size": V,
        "norm_before_residual": True,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": AUX_IDS,
        "torch_dtype": "float32",
    }
    save_file({k: v.contiguous() for k, v in sorted(sd.items())}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


RECIPE_PAIR = """\
  - name: {name}
    target: ./target
    draft: ./{name}
    dtype: float32
    speculation: {{num_speculative_tokens: {k}}}
    serving: {{max_num_seqs: {seqs}, max_model_len: 64}}
    buckets: {{prefill: [16], batch: [{seqs}]}}
    backend: export
"""


# ------------------------------------------------------------------------------ exact distributions


@torch.no_grad()
def exact_marginals(model) -> list[torch.Tensor]:
    """[P(x1), P(x2), P(x3)], each [V + 1] float64 (last = STOP: EOS came earlier), from the target's
    conditionals: one forward for the prompt, one for its 16 and one for its 256 continuations."""
    p1 = model(torch.tensor([PROMPT])).logits[0, -1].double().softmax(-1)                       # [V]
    c2 = torch.tensor([PROMPT + [a] for a in range(V)])
    p2 = model(c2).logits[:, -1].double().softmax(-1)                                          # [V, V]
    c3 = torch.tensor([PROMPT + [a, b] for a in range(V) for b in range(V)])
    p3 = model(c3).logits[:, -1].double().softmax(-1).view(V, V, V)                            # [V, V, V]
    alive1 = p1.clone()
    alive1[EOS] = 0.0                                            # P(x1 = a, not stopped)
    alive2 = alive1[:, None] * p2
    alive2[:, EOS] = 0.0                                         # P(x1 = a, x2 = b, not stopped)
    m1 = p1
    m2 = alive1 @ p2
    m3 = (alive2[..., None] * p3).sum((0, 1))
    out = []
    for m in (m1, m2, m3):
        out.append(torch.cat([m, (1.0 - m.sum()).clamp(min=0.0).reshape(1)]))
    return out


def _tv(counts: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    n = counts.sum(-1, keepdim=True).clamp(min=1)
    return 0.5 * (counts / n - p).abs().sum(-1)


def null_threshold(p: torch.Tensor, n: int, gen: torch.Generator) -> float:
    """99.9th percentile of the TV of n direct draws from p (NULL_REPS repetitions)."""
    draws = torch.multinomial(p.expand(NULL_REPS, -1), n, replacement=True, generator=gen)
    counts = torch.zeros(NULL_REPS, p.numel(), dtype=p.dtype).scatter_add_(
        1, draws, torch.ones_like(draws, dtype=p.dtype))
    return float(torch.quantile(_tv(counts, p), QUANTILE))


def compare(outputs: list[list[int]], exact: list[torch.Tensor], seed: int = 0) -> list[tuple[float, float]]:
    """[(TV, threshold)] for x1, x2, x3 of `outputs` (token lists, shorter after EOS)."""
    x = torch.tensor([(o + [STOP] * MAX_TOKENS)[:MAX_TOKENS] for o in outputs])
    gen = torch.Generator().manual_seed(seed)
    res = []
    for j in range(MAX_TOKENS):
        counts = torch.bincount(x[:, j], minlength=V + 1).double()
        res.append((float(_tv(counts, exact[j])), null_threshold(exact[j], len(outputs), gen)))
    return res


def _fmt(res) -> str:
    return "  ".join(f"x{j + 1}: TV={tv:.4f} thr={thr:.4f}" for j, (tv, thr) in enumerate(res))


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny):
    """Writes the target, the two drafts and a recipe; builds one bundle per draft (through the session's
    fixture factory); returns {"engines": {name: Engine}, "exact": [P(x1), P(x2), P(x3)]}."""
    from eagle3_build.recipe import load_recipe
    from eagle3_runtime.bundle import Bundle
    from eagle3_runtime.engine import Engine

    t0 = time.perf_counter()
    root = tmp_path_factory.mktemp("e2e_sampling")
    g = torch.Generator().manual_seed(0)
    tsd = _target_state(g)
    model = _write_target(root / "target", tsd, _tokenizer())
    for name in ("good", "bad"):
        _write_draft(root / name, _draft_state(g, tsd, bad=name == "bad"), root / "target")
    (root / "recipe.yaml").write_text("pairs:\n" + "".join(RECIPE_PAIR.format(name=n, k=K, seqs=SEQS) for n in ("good", "bad")))
    recipe = load_recipe(root / "recipe.yaml")

    exact = exact_marginals(model)
    for m in exact:
        assert m.sum().item() == pytest.approx(1.0, abs=1e-9)
    # spread-out target: no near-deterministic step; EOS possible but rare; BAD unlikely
    assert 0.2 < exact[0][:V].max() < 0.8
    assert 0.005 < exact[1][STOP] < exact[2][STOP] < 0.1
    assert all(float(m[BAD]) < 0.02 for m in exact)

    engines = {}
    for p in recipe.pairs:
        engines[p.name] = Engine(Bundle(tiny.bundle_of(root / "recipe.yaml", pair=p.name).path))
    print(f"\n[e2e sampling] pair + 2 bundles built and loaded in {time.perf_counter() - t0:.1f}s")
    print("exact P(x1..x3) (last = stopped): " +
          " | ".join("[" + " ".join(f"{v:.3f}" for v in m.tolist()) + "]" for m in exact))
    return {"engines": engines, "exact": exact}


def run_trials(engine, n: int, seed0: int = 0):
    """n generations at temperature 1 with speculation, batched as the server batches them (generate_many:
    up to max_num_seqs rows decode together, each request with its own seed); returns (token lists, summed
    SpecStats)."""
    from eagle3_runtime.engine import SpecStats
    from eagle3_runtime.sampling import SamplingParams

    gens = engine.generate_many([PROMPT] * n, MAX_TOKENS, speculative=True,
                                sampling=[SamplingParams(temperature=1.0, seed=seed0 + i) for i in range(n)])
    outs, total = [], SpecStats(K)
    for gen in gens:
        toks = gen.token_ids
        assert 1 <= len(toks) <= MAX_TOKENS and all(0 <= t < V for t in toks)
        if len(toks) < MAX_TOKENS:  # only EOS ends a sequence early
            assert toks[-1] == EOS and gen.finish_reason == "stop", (toks, gen.finish_reason)
        assert EOS not in toks[:-1]
        total.add(gen.stats)
        outs.append(toks)
    return outs, total


@pytest.fixture(scope="module")
def runs(pair):
    """{draft: (token lists, summed SpecStats, seconds, Counter of proposed draft tokens)}. The real
    verify_tree_sampled runs; a pass-through spy only records which tokens the compiled draft proposed."""
    import eagle3_runtime.engine as engine_mod

    real = engine_mod.verify_tree_sampled
    out = {}
    for i, (name, engine) in enumerate(pair["engines"].items()):
        proposed: collections.Counter = collections.Counter()

        def spy(logits, tree, p, u, _seen=proposed):
            _seen.update(tree.tokens[1:])
            return real(logits, tree, p, u)

        t0 = time.perf_counter()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(engine_mod, "verify_tree_sampled", spy)
            outs, stats = run_trials(engine, N_TRIALS, seed0=i * N_TRIALS)  # different seeds per draft
        out[name] = (outs, stats, time.perf_counter() - t0, proposed)
    return out


# --------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("draft", ["good", "bad"])
def test_speculative_sampling_follows_target_distribution(pair, runs, draft):
    outs, stats, secs, proposed = runs[draft]
    res = compare(outs, pair["exact"], seed=1)
    stopped = sum(len(o) < MAX_TOKENS for o in outs)
    print(f"\n[{draft} draft] {N_TRIALS} trials in {secs:.1f}s, {stopped} ended by EOS; {_fmt(res)}")
    print(f"[{draft} draft] {stats.format()}; drafts per trial {stats.num_drafts / N_TRIALS:.2f}; "
          f"proposed tokens {dict(proposed.most_common(5))}")
    assert all(tv <= thr for tv, thr in res), res

    # every trial speculates; the rejection path is really exercised, and acceptance matches the draft
    assert stats.num_drafts >= N_TRIALS - stopped
    assert sum(proposed.values()) == stats.num_draft_tokens
    first = stats.per_position[0]
    if draft == "good":
        assert 0.1 < first < 0.9, stats.to_dict()  # accepted sometimes, rejected sometimes
        assert len(proposed) > 1  # the draft network's proposals vary with the context
        assert stats.accepted_per_position[1] > 0  # two drafts accepted in one round happens too
    else:
        assert set(proposed) == {BAD}, proposed  # the rigged draft proposes BAD every time ...
        assert first < 0.02, stats.to_dict()  # ... and is almost never accepted
        assert stats.num_drafts > 1.8 * N_TRIALS  # nearly every trial needs a second round for x3


def _chain(sampler):
    """A chain sampler (logits, drafts, params, u) -> (a, tokens) as the engine's tree sampler."""
    def run(logits, tree, p, u):
        a, new = sampler(logits, tree.tokens[1:], p, u)
        return list(range(a + 1)), new
    run.__name__ = sampler.__name__
    return run


def _always_accept(logits, drafts, p, u):
    """Broken: emits every draft token (plus a bonus sample) without the acceptance test."""
    from eagle3_runtime.sampling import sample, target_probs

    return len(drafts), list(drafts) + [sample(target_probs(logits[len(drafts)], p), u(len(drafts)))]


def _no_residual(logits, drafts, p, u):
    """Broken: on rejection resamples from p instead of norm(max(p - q, 0)) (d gets too much mass)."""
    from eagle3_runtime.sampling import sample, target_probs

    probs = target_probs(logits, p)
    gen = torch.Generator().manual_seed(int(u(0) * 2 ** 53))  # independent draws for test and resample
    us = torch.rand(len(drafts) + 1, generator=gen).tolist()
    for a, d in enumerate(drafts):
        if us[a] >= probs[a, d]:
            return a, list(drafts[:a]) + [sample(probs[a], us[-1])]
    return len(drafts), list(drafts) + [sample(probs[-1], us[-1])]


@pytest.mark.parametrize("broken", [_always_accept, _no_residual], ids=["always_accept", "no_residual"])
def test_broken_sampler_fails_the_check(pair, monkeypatch, broken):
    """Negative control: the same comparison must reject a sampler that is subtly or grossly wrong."""
    import eagle3_runtime.engine as engine_mod

    monkeypatch.setattr(engine_mod, "verify_tree_sampled", _chain(broken))
    t0 = time.perf_counter()
    n = N_CONTROL[broken.__name__.strip("_")]
    outs, stats = run_trials(pair["engines"]["good"], n, seed0=100_000)
    res = compare(outs, pair["exact"], seed=2)
    print(f"\n[control {broken.__name__}] {n} trials in {time.perf_counter() - t0:.1f}s; {_fmt(res)}; "
          f"acceptance {stats.acceptance_rate:.3f}")
    tv2, thr2 = res[1]
    assert tv2 > thr2, res  # x2 (the first speculative token) is off
    assert res[0][0] <= res[0][1]  # x1 (prefill sampling, untouched) still passes
