"""GPT-OSS targets (the GPT-OSS-120B seed) on the scaled-down twin (`make-tiny-pair --arch gpt-oss`).

* MXFP4 dequantization is transformers' to the bit, also when streamed one expert at a time, and the
  twin's MXFP4 checkpoint reads as exactly its BF16 one;
* the target graphs (prefill, verify, decode) match transformers' GptOssForCausalLM logits and aux
  states within 1e-4 in float32 on a sequence longer than the sliding window, at TP 1 and TP 2
  (torchrun), padded (hidden 90 -> 96, MXFP4 twin 96 -> 128) and unpadded;
* the bundle decodes token-for-token like transformers' greedy generate with speculation (K 1, K 3),
  from the BF16 and the MXFP4 checkpoint, at TP 1 and TP 2 (`eagle3-run` under torchrun);
* the 120B config gives a per-rank weight size consistent with 120B BF16 at TP 16.
The default run covers each item once; the rest of the matrix is marked slow.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve().parent
PADDED = {"hf": 96, "mxfp4": 128}  # hidden 90 / 96
PROMPTS = ["Once upon a time, in a land far away, there lived a", "The quick brown fox jumps over the dog",
           "1, 2, 3, 4, 5, 6, 7, 8, 9,", "She opened the door, put the kettle on"]
MAX_TOKENS = 40


def torchrun(n: int, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)


@pytest.fixture(scope="module")
def world(tiny, tmp_path_factory):
    return {"tiny": tiny, "root": tmp_path_factory.mktemp("gpt-oss"), "hf": {}, "greedy": {}}


def pair_dir(world, fmt: str) -> Path:
    return world["tiny"].pair(arch="gpt-oss", target_format=fmt).parent


def bundle_for(world, fmt: str, tp: int, padded: bool, k: int) -> Path:
    return world["tiny"].bundle(arch="gpt-oss", target_format=fmt, tp=tp, padded=PADDED[fmt] if padded else None,
                                k=k).path


def hf_target(world, fmt: str):
    """transformers' model of the checkpoint (the MXFP4 one dequantized by transformers itself)."""
    from transformers import AutoModelForCausalLM

    if fmt not in world["hf"]:
        m = AutoModelForCausalLM.from_pretrained(pair_dir(world, fmt) / "target", dtype=torch.float32)
        m.set_experts_implementation("eager")  # the default grouped_mm kernel fails on CPU
        assert m.config._attn_implementation == "eager"
        world["hf"][fmt] = m.eval()
    return world["hf"][fmt]


def hf_greedy(world, fmt: str, ids: list[int]) -> list[int]:
    key = (fmt, tuple(ids))
    if key not in world["greedy"]:
        out = hf_target(world, fmt).generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
        world["greedy"][key] = out[0, len(ids):].tolist()
    return world["greedy"][key]


def local_target(d: Path):
    from eagle3_build.checkpoints.load import load_target
    from eagle3_build.checkpoints.sources import resolve
    from eagle3_build.recipe import SourceSpec

    return load_target(resolve(SourceSpec(uri=str(d), kind="local", path=str(d)), "target"))


# ------------------------------------------------------------------ MXFP4

def mxfp4_from_spec(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 as transformers' convert_moe_packed_tensors reads it, written out: LUT, low nibble first, ldexp(v, scale - 127), [E, R, G*32] -> [E, in, out]."""
    lut = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.bfloat16)
    vals = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)
    vals = torch.ldexp(vals, (scales.to(torch.int32) - 127)[..., None].to(torch.bfloat16))
    E, R, G, _ = blocks.shape
    return vals.reshape(E, R, G * 32).transpose(1, 2).contiguous()


def test_mxfp4_dequantization_is_transformers_exactly(tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from eagle3_build.checkpoints.sources import mxfp4_dequantize, mxfp4_source, safetensors_source
    from eagle3_build.testing.tiny import mxfp4_quantize

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 10, 4), generator=g, dtype=torch.uint8)
    ref = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.bfloat16)
    assert ref.shape == (3, 128, 10) and ref.dtype == torch.bfloat16
    assert torch.equal(mxfp4_dequantize(blocks, scales), ref)
    assert torch.equal(mxfp4_from_spec(blocks, scales), ref)
    # streamed from a checkpoint file one expert at a time (what the sharder reads) == all at once
    save_file({"x.gate_up_proj_blocks": blocks, "x.gate_up_proj_scales": scales, "x.gate_up_proj_bias":
               torch.ones(3, 10)}, tmp_path / "model.safetensors")
    src = mxfp4_source(safetensors_source(tmp_path), "t")
    assert sorted(src.names()) == ["x.gate_up_proj", "x.gate_up_proj_bias"]
    assert src.shapes["x.gate_up_proj"] == [3, 128, 10]
    assert torch.equal(torch.cat([src.get_rows("x.gate_up_proj", e, e + 1) for e in range(3)]), ref)
    assert torch.equal(src.get("x.gate_up_proj"), ref)
    # the twin's writer: quantizing MXFP4 values gives back the same blocks and scales
    b2, s2 = mxfp4_quantize(ref.float().transpose(1, 2))
    assert torch.equal(convert_moe_packed_tensors(b2, s2, dtype=torch.bfloat16), ref)


def test_mxfp4_checkpoint_reads_as_the_bf16_one(world):
    """Same seed and hidden (96): the MXFP4 twin's dequantized experts are its BF16 twin's, bit for bit."""
    bf16 = world["tiny"].pair(arch="gpt-oss", hidden_size=96).parent
    t_bf, t_mx = (local_target(d / "target") for d in (bf16, pair_dir(world, "mxfp4")))
    assert t_mx.args == t_bf.args and t_mx.args.ARCH == "gpt_oss"
    assert sorted(t_mx.tensors.names()) == sorted(t_bf.tensors.names())
    for n in t_bf.tensors.names():
        assert torch.equal(t_mx.tensors.get(n), t_bf.tensors.get(n)), n


# ------------------------------------------------------------------ target graphs vs transformers

def run_roles(bundle: Path, tp: int, tokens: list[int], out: Path) -> dict[str, torch.Tensor]:
    tok_file = out.with_suffix(".json")
    tok_file.write_text(json.dumps(tokens))
    args = [str(HERE / "tp_roles.py"), str(bundle), str(out), str(tok_file)]
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, check=False) if tp == 1 \
        else torchrun(tp, *args)
    assert r.returncode == 0, r.stderr[-3000:]
    return load_file(out)


CONFIGS = [  # (checkpoint format, tp, padded, K)
    pytest.param("hf", 1, False, 3, id="bf16-tp1-k3"),
    pytest.param("hf", 2, True, 1, id="bf16-tp2-padded-k1", marks=pytest.mark.slow),  # mxfp4-tp2-padded: CI
    pytest.param("mxfp4", 2, True, 3, id="mxfp4-tp2-padded-k3"),
    pytest.param("hf", 1, True, 1, id="bf16-tp1-padded-k1", marks=pytest.mark.slow),
    pytest.param("hf", 2, False, 3, id="bf16-tp2-k3", marks=pytest.mark.slow),
    pytest.param("mxfp4", 1, False, 1, id="mxfp4-tp1-k1", marks=pytest.mark.slow),
    pytest.param("mxfp4", 1, True, 3, id="mxfp4-tp1-padded-k3", marks=pytest.mark.slow),
    pytest.param("mxfp4", 2, False, 1, id="mxfp4-tp2-k1", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("fmt,tp,padded,k", CONFIGS)
def test_target_graphs_match_transformers(world, fmt, tp, padded, k):
    bundle = bundle_for(world, fmt, tp, padded, k)
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["models"]["target"]["architecture"] == "gpt_oss" and m["tp_degree"] == tp
    hf = hf_target(world, fmt)
    n = 40  # prompt 5x the sliding window; K+1 verified and 1 decoded after it
    tokens = torch.randint(0, hf.config.vocab_size, (n + k + 2,), generator=torch.Generator().manual_seed(tp)).tolist()
    got = run_roles(bundle, tp, tokens, world["root"] / f"roles-{fmt}-{tp}-{padded}-{k}.safetensors")
    with torch.no_grad():
        ref = hf(torch.tensor([tokens]), output_hidden_states=True)
    aux_ids = m["aux_layer_ids"]
    ref_aux = torch.cat([ref.hidden_states[i][0] for i in aux_ids], dim=-1)
    pairs = {"prefill.logits": (got["seq.prefill.logits"], ref.logits[0, n - 1]),
             "prefill.aux": (got["seq.prefill.aux"], ref_aux[:n]),
             "verify.logits": (got["seq.verify.logits"], ref.logits[0, n:n + k + 1]),
             "verify.aux": (got["seq.verify.aux"], ref_aux[n:n + k + 1]),
             "decode.logits": (got["seq.decode.logits"], ref.logits[0, n + k + 1])}
    worst = {name: (a - b).abs().max().item() for name, (a, b) in pairs.items()}
    print(f"\n{fmt} tp{tp} {'padded' if padded else 'plain'} K{k}: max |Δ| " +
          ", ".join(f"{name} {d:.2e}" for name, d in worst.items()))
    for name, (a, b) in pairs.items():
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=name)


# ------------------------------------------------------------------ lossless decoding

@pytest.mark.parametrize("fmt,tp,padded,k", CONFIGS)
def test_bundle_decodes_like_transformers(world, fmt, tp, padded, k):
    bundle = bundle_for(world, fmt, tp, padded, k)
    if tp > 1:  # the real CLI, one process per rank
        accepted = 0
        for prompt in PROMPTS[:1]:
            r = torchrun(tp, "-m", "eagle3_runtime.cli", str(bundle), "--prompt", prompt, "--max-tokens",
                         str(MAX_TOKENS), "--json")
            assert r.returncode == 0, r.stderr[-3000:]
            res = json.loads(r.stdout.strip().splitlines()[-1])
            assert res["token_ids"] == hf_greedy(world, fmt, res["prompt_token_ids"]), prompt
            accepted += res["spec_decoding"]["num_accepted_tokens"]
        assert accepted > 0
        return
    from eagle3_runtime.bundle import Bundle
    from eagle3_runtime.engine import Engine
    from eagle3_runtime.tokenizer import BundleTokenizer

    engine, tok = Engine(Bundle(bundle)), BundleTokenizer(bundle)
    accepted = drafted = 0
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        ref = hf_greedy(world, fmt, ids)
        spec = engine.generate(ids, MAX_TOKENS, speculative=True)
        assert spec.token_ids == ref, f"speculative output differs for {prompt!r}"
        assert engine.generate(ids, MAX_TOKENS, speculative=False).token_ids == ref, prompt
        accepted += spec.stats.num_accepted_tokens
        drafted += spec.stats.num_draft_tokens
    assert 0 < accepted < drafted  # the structured draft exercises both the accept and the reject path


# ------------------------------------------------------------------ model pieces

def test_moe_routed_and_dense_paths_agree():
    """Decode/verify gather the top-k experts, prefill runs all of them: the same function."""
    from eagle3_build.models.gpt_oss import Experts

    g = torch.Generator().manual_seed(0)
    ex = Experts(5, 12, 8, limit=7.0, alpha=1.702)
    for p in ex.parameters():
        p.data = torch.randn(p.shape, generator=g)
    x = torch.randn(6, 12, generator=g)
    w, idx = torch.randn(6, 5, generator=g).topk(2, dim=-1)
    w = w.softmax(-1)
    ref = torch.zeros(6, 12)
    for n in range(6):
        for j in range(2):
            e = idx[n, j]
            gu = x[n] @ ex.gate_up_proj[e] + ex.gate_up_proj_bias[e]
            ref[n] += w[n, j] * (ex.act(gu) @ ex.down_proj[e] + ex.down_proj_bias[e])
    torch.testing.assert_close(ex.routed(x, idx, w), ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ex.dense(x, idx, w), ref, atol=1e-4, rtol=1e-5)
    # the clamped SwiGLU: gate capped above at limit, up clamped both sides, (up + 1) * gate * sigmoid(alpha * gate)
    gu = torch.tensor([[9.0, -9.0, -2.0, 0.5]])  # (gate 9, up -9), (gate -2, up 0.5)
    expect = torch.tensor([[(1 - 7) * 7 * torch.sigmoid(torch.tensor(7 * 1.702)).item(),
                            1.5 * -2 * torch.sigmoid(torch.tensor(-2 * 1.702)).item()]])
    torch.testing.assert_close(ex.act(gu), expect)


# ------------------------------------------------------------------ 120B: configs only

GPT_OSS_120B = {  # openai/gpt-oss-120b config.json
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "head_dim": 64,
    "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64,
    "num_key_value_heads": 8, "num_local_experts": 128, "num_experts_per_tok": 4, "experts_per_token": 4,
    "vocab_size": 201088, "rms_norm_eps": 1e-05, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "max_position_embeddings": 131072, "rope_theta": 150000,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "quantization_config": {"quant_method": "mxfp4"},
}


def weight_bytes_per_rank(config: dict, tp: int, padded_hidden: int | None = None, dtype=torch.bfloat16) -> int:
    """Bytes one rank's target weights file holds: the parameters of the rank-local model the build makes."""
    from eagle3_build.models.gpt_oss import GptOss, gpt_oss_args
    from eagle3_build.models.llama import llama_layout

    a = gpt_oss_args(config, "target")
    with torch.device("meta"):
        m = GptOss(a, (), llama_layout(a, tp, padded_hidden))
    return sum(p.numel() for p in m.parameters()) * (getattr(torch, dtype) if isinstance(dtype, str) else dtype).itemsize


def test_120b_weight_bytes_per_rank():
    params = weight_bytes_per_rank(GPT_OSS_120B, tp=1, dtype="bfloat16") / 2
    assert abs(params / 116.83e9 - 1) < 0.005  # GPT-OSS-120B: 116.8B parameters
    per_rank = weight_bytes_per_rank(GPT_OSS_120B, tp=16, padded_hidden=3072, dtype=torch.bfloat16)
    # hidden and expert intermediate 2880 -> 3072: (3072 / 2880)^2 = 1.14x the experts, vocab rows split 16 ways
    assert 16.0e9 < per_rank < 17.0e9, per_rank
    assert 1.13 < per_rank * 16 / (2 * params) < 1.15
    unpadded = weight_bytes_per_rank(GPT_OSS_120B, tp=16, dtype=torch.bfloat16)
    assert abs(unpadded * 16 / (2 * params) - 1) < 0.01  # only the replicated router/norms/sinks repeat


def test_120b_recipe_graphs():
    from eagle3_build.pair import graph_plan
    from eagle3_build.recipe import load_recipe

    (p,) = load_recipe(HERE.parent / "recipes" / "gpt-oss-120b-eagle3.yaml").pairs
    assert p.parallel.tp_degree == 16 and p.speculation.num_speculative_tokens == 1
    assert sorted(g.name for g in graph_plan(p)) == sorted(
        ["target_prefill_s512", "draft_prefill_s512", "target_verify_b1", "target_decode_b1", "draft_catchup_b1"])
    # (K 1: no draft_step, the catch-up proposes the one draft token)


# ------------------------------------------------------------------ refusals

def test_bad_gpt_oss_checkpoints_are_refused(world, tmp_path):
    import shutil

    from eagle3_build.errors import CheckpointError

    src = pair_dir(world, "mxfp4") / "target"

    def load(mutate_cfg=None, drop=None):
        d = tmp_path / "t"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(src, d)
        if mutate_cfg:
            cfg = json.loads((d / "config.json").read_text())
            mutate_cfg(cfg)
            (d / "config.json").write_text(json.dumps(cfg))
        if drop:
            sd = load_file(d / "model.safetensors")
            save_file({k: v for k, v in sd.items() if k != drop}, d / "model.safetensors")
        return local_target(d)

    with pytest.raises(CheckpointError, match="without their pair"):
        load(drop="model.layers.1.mlp.experts.down_proj_scales")
    with pytest.raises(CheckpointError, match="quantization 'fp8' is not supported"):
        load(lambda c: c["quantization_config"].update(quant_method="fp8"))
    with pytest.raises(CheckpointError, match="layer_types must list 4 entries"):
        load(lambda c: c.update(layer_types=["sliding_attention", "chunked_attention", "full_attention"]))
    with pytest.raises(CheckpointError, match="lacks 'num_local_experts'"):
        load(lambda c: c.pop("num_local_experts"))


def test_make_tiny_pair_gpt_oss_cli(tmp_path):
    from typer.testing import CliRunner

    from eagle3_build.cli import app

    def cli(*args):  # in-process: the command's own checks, without another interpreter start
        return CliRunner().invoke(app, ["make-tiny-pair", str(tmp_path / "p"), *args])

    r = cli("--arch", "gpt-oss", "--target-format", "gguf")
    assert r.exit_code == 2 and "choose one of hf, mxfp4 for --arch gpt-oss" in r.output
    r = cli("--arch", "gpt-oss", "--target-format", "mxfp4", "--draft-format", "eagle")
    assert r.exit_code == 2 and "speculators-format" in r.output and "Traceback" not in r.output
    r = cli("--arch", "gpt-oss", "--target-format", "mxfp4")
    assert r.exit_code == 0, r.output
    text = (tmp_path / "p" / "recipe.yaml").read_text()
    assert "num_speculative_tokens: 1" in text and "max_num_seqs: 1" in text and "prefill: [64]" in text
    draft = json.loads((tmp_path / "p" / "draft" / "config.json").read_text())
    assert draft["norm_before_fc"] is True and draft["speculators_model_type"] == "eagle3"
    target = json.loads((tmp_path / "p" / "target" / "config.json").read_text())
    assert target["model_type"] == "gpt_oss" and target["quantization_config"]["quant_method"] == "mxfp4"
    assert set(target["layer_types"]) == {"sliding_attention", "full_attention"}
