"""Padding and sharding rules, one by one."""
import math

import pytest
import torch
from safetensors.torch import load_file

from eagle3_build.errors import UserError
from eagle3_build.models.layout import Layout
from eagle3_build.models.llama import RMSNorm
from eagle3_build.sharding import (StreamingSafetensorsWriter, check_tp, kv_heads_for_rank, pad_chunks, pad_dim,
                                   shard_even, shard_kv, shard_vocab, tensor_plan, valid_tp_degrees)

Hu, Hp = 90, 96


def test_padding_appends_zeros():
    t = torch.randn(7, Hu)
    p = pad_dim(t, 1, Hp)
    assert p.shape == (7, Hp) and torch.equal(p[:, :Hu], t) and not p[:, Hu:].any()
    f = torch.randn(5, 3 * Hu)  # fc's three aux chunks: each padded at its own end
    c = pad_chunks(f, 1, 3, Hp).view(5, 3, Hp)
    assert torch.equal(c[:, :, :Hu], f.view(5, 3, Hu)) and not c[:, :, Hu:].any()


def layout(tp=1, vocab=10, **kw):
    base = dict(tp=tp, hidden=Hu, padded_hidden=Hp, num_heads=4, num_kv_heads=2, head_dim=16, intermediate=128,
                vocab=vocab, input_hidden=Hu, padded_input_hidden=Hp)
    base.update(kw)
    return Layout(**base)


def test_fc_interleaved_padding_zero_positions():
    fc = torch.randn(Hu, 3 * Hu) + 5.0  # no accidental zeros
    out = tensor_plan("draft", "fc.weight").apply(fc, 0, layout())
    assert out.shape == (Hp, 3 * Hp)
    zero_cols = torch.zeros(3 * Hp, dtype=torch.bool)
    for i in range(3):
        zero_cols[i * Hp + Hu:(i + 1) * Hp] = True
        assert torch.equal(out[:Hu, i * Hp:i * Hp + Hu], fc[:, i * Hu:(i + 1) * Hu])
    assert (out[:, zero_cols] == 0).all() and (out[:Hu, ~zero_cols] != 0).all()
    assert (out[Hu:] == 0).all()  # padded output rows


def test_draft_qkv_halves_padding():
    q = torch.randn(64, 2 * Hu) + 5.0
    out = tensor_plan("draft", "midlayer.self_attn.q_proj.weight").apply(q, 0, layout())
    assert out.shape == (64, 2 * Hp)
    assert torch.equal(out[:, :Hu], q[:, :Hu]) and torch.equal(out[:, Hp:Hp + Hu], q[:, Hu:])
    assert (out[:, Hu:Hp] == 0).all() and (out[:, Hp + Hu:] == 0).all()
    # the target's q_proj pads its (single) input at the end
    tq = tensor_plan("target", "layers.0.self_attn.q_proj.weight").apply(torch.randn(64, Hu) + 5, 0, layout())
    assert (tq[:, Hu:] == 0).all() and (tq[:, :Hu] != 0).all()


def test_norm_and_o_down_padding():
    w = torch.rand(Hu) + 0.5
    out = tensor_plan("target", "layers.3.input_layernorm.weight").apply(w, 0, layout())
    assert out.shape == (Hp,) and (out[Hu:] == 0).all() and torch.equal(out[:Hu], w)
    o = tensor_plan("target", "layers.0.self_attn.o_proj.weight").apply(torch.randn(Hu, 64) + 5, 0, layout())
    assert o.shape == (Hp, 64) and (o[Hu:] == 0).all()
    gate = tensor_plan("target", "layers.0.mlp.gate_proj.weight").apply(torch.randn(128, Hu) + 5, 0, layout())
    assert gate.shape == (128, Hp) and (gate[:, Hu:] == 0).all()


def test_rmsnorm_over_unpadded_width():
    x = torch.randn(3, Hu)
    w = torch.rand(Hu) + 0.5
    ref = RMSNorm(Hu, 1e-5)
    ref.weight.data = w
    padded = RMSNorm(Hp, 1e-5, true_dim=Hu)
    padded.weight.data = pad_dim(w, 0, Hp)
    y = padded(pad_dim(x, 1, Hp))
    torch.testing.assert_close(y[:, :Hu], ref(x))
    assert (y[:, Hu:] == 0).all()


@pytest.mark.parametrize("vocab,tp", [(10, 4), (10, 8), (512, 4), (11, 3)])
def test_vocab_shard_short_ranks(vocab, tp):
    emb = torch.arange(vocab, dtype=torch.float32)[:, None].repeat(1, 4) + 1  # row i holds i+1
    vpr = math.ceil(vocab / tp)
    shards = [shard_vocab(emb, r, tp) for r in range(tp)]
    for r, s in enumerate(shards):
        assert s.shape == (vpr, 4)
        real = max(0, min(vpr, vocab - r * vpr))
        assert torch.equal(s[:real, 0], torch.arange(r * vpr, r * vpr + real, dtype=torch.float32) + 1)
        assert (s[real:] == 0).all()
    assert torch.equal(torch.cat(shards)[:vocab], emb)
    if (vocab, tp) == (10, 8):  # more than one short rank: 2 rows per rank, ranks 5, 6, 7 hold nothing
        assert [int((s != 0).any(1).sum()) for s in shards] == [2, 2, 2, 2, 2, 0, 0, 0]


@pytest.mark.parametrize("n_kv", [2, 8])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_kv_head_assignment(tp, n_kv):
    heads = [kv_heads_for_rank(r, tp, n_kv) for r in range(tp)]
    if tp >= n_kv:
        replicas = tp // n_kv
        assert heads == [[r // replicas] for r in range(tp)]
    else:
        per = n_kv // tp
        assert heads == [list(range(r * per, (r + 1) * per)) for r in range(tp)]
    # GQA consistency: every q head of rank r uses a kv head the rank holds
    n_q = 32
    for r in range(tp):
        q_heads = range(r * n_q // tp, (r + 1) * n_q // tp)
        assert {h // (n_q // n_kv) for h in q_heads} <= set(heads[r])
    # the weight rule selects exactly those heads
    hd = 4
    k = torch.arange(n_kv, dtype=torch.float32).repeat_interleave(hd)[:, None].repeat(1, 3)
    for r in range(tp):
        got = shard_kv(k, r, tp, n_kv, hd)[::hd, 0].long().tolist()
        assert got == heads[r]


def test_column_and_row_shards_reassemble():
    w = torch.randn(128, 96)
    assert torch.equal(torch.cat([shard_even(w, 0, r, 4) for r in range(4)], 0), w)
    assert torch.equal(torch.cat([shard_even(w, 1, r, 4) for r in range(4)], 1), w)
    L = layout(tp=4)
    assert tensor_plan("target", "layers.0.self_attn.o_proj.weight").shard == "row"
    assert tensor_plan("target", "layers.0.mlp.gate_proj.weight").apply(torch.randn(128, Hu), 1, L).shape == (32, Hp)
    assert tensor_plan("draft", "fc.weight").shard == "replicate"


def test_tp_degree_refusal_names_valid_degrees():
    assert valid_tp_degrees(9, 3) == [1, 3, 9]  # SmolLM2-135M
    with pytest.raises(UserError, match="valid tp degrees: 1, 3, 9"):
        check_tp("target", 9, 3, 2)
    check_tp("target", 32, 8, 8)
    check_tp("target", 64, 8, 16)  # GPT-OSS: 2 replicas of each KV head


def test_streaming_writer_matches_safetensors(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7), "c": torch.randn(2, 2).to(torch.bfloat16)}
    specs = [(n, list(t.shape), t.dtype) for n, t in tensors.items()]
    p = tmp_path / "x.safetensors"
    w = StreamingSafetensorsWriter(p, specs)
    for n, t in tensors.items():
        w.write(n, t)
    w.close()
    back = load_file(p)
    assert set(back) == set(tensors) and all(torch.equal(back[n], t) for n, t in tensors.items())
    with pytest.raises(ValueError):
        w2 = StreamingSafetensorsWriter(tmp_path / "y.safetensors", specs)
        w2.write("b", tensors["b"])  # out of order


def test_row_parallel_bias_divided_by_tp():
    b = torch.randn(Hu)
    L = layout(tp=4)
    shards = [tensor_plan("target", "layers.0.self_attn.o_proj.bias").apply(b, r, L) for r in range(4)]
    assert all(s.shape == (Hp,) for s in shards)
    torch.testing.assert_close(sum(shards)[:Hu], b)  # the all-reduce adds the shares back up
    assert (sum(shards)[Hu:] == 0).all()
    qb = tensor_plan("target", "layers.0.self_attn.k_proj.bias").apply(torch.arange(2 * 16.0), 3, L)
    assert torch.equal(qb, torch.arange(16.0, 32.0))  # rank 3 of tp 4 holds KV head 1


# ------------------------------------------------------------------ GPT-OSS experts

def test_padded_intermediate_follows_the_hidden_when_equal():
    from eagle3_build.models.layout import padded_intermediate_size

    assert padded_intermediate_size(2880, 2880, 3072, 16) == 3072  # GPT-OSS: 192 per rank
    assert padded_intermediate_size(2880, 2880, 2880, 16) == 2880
    assert padded_intermediate_size(128, 92, 96, 2) == 128  # Llama twin: only rounded to tp
    assert padded_intermediate_size(90, 90, 96, 2) == 96 and padded_intermediate_size(90, 90, 90, 4) == 92
    assert layout(tp=2, intermediate=Hu).intermediate_per_rank == Hp // 2


def test_expert_gate_up_shards_keep_gate_up_pairs_together():
    E, I, tp = 3, 90, 2
    gate, up = torch.randn(E, Hu, I) + 5, torch.randn(E, Hu, I) - 5  # gate > 0, up < 0 everywhere
    fused = torch.stack([gate, up], dim=-1).reshape(E, Hu, 2 * I)  # gate at even, up at odd columns
    L = layout(tp=tp, intermediate=I)
    Ip = L.padded_intermediate
    plan = tensor_plan("target", "layers.0.mlp.experts.gate_up_proj")
    assert plan.per_expert and plan.shard == "expert_gate_up"
    for r in range(tp):
        s = plan.apply(fused, r, L)
        assert s.shape == (E, Hp, 2 * Ip // tp)
        # the rank's gate and up columns are the same intermediate channels: column-parallel gate and up
        want_gate = shard_even(pad_dim(pad_dim(gate, 1, Hp), 2, Ip), 2, r, tp)
        want_up = shard_even(pad_dim(pad_dim(up, 1, Hp), 2, Ip), 2, r, tp)
        assert torch.equal(s[..., 0::2], want_gate) and torch.equal(s[..., 1::2], want_up)
    # one expert at a time (how the sharder streams) gives the same slices
    assert torch.equal(plan.apply(fused[1:2], 1, L), plan.apply(fused, 1, L)[1:2])
    with pytest.raises(ValueError, match="whole gate/up pairs"):
        from eagle3_build.sharding import shard_gate_up_pairs
        shard_gate_up_pairs(torch.zeros(1, 4, 6), 0, 2)


def test_padded_experts_are_zero_gated_and_tp_shards_sum_to_the_expert():
    """Pad (90 -> 96, intermediate 90 -> 96) and shard one expert at tp 2: the ranks' outputs, each adding
    its 1/tp of the down bias, sum to the unpadded expert's output, and padded channels stay exactly 0."""
    from eagle3_build.models.gpt_oss import Experts

    E, I, tp = 2, 90, 2
    g = torch.Generator().manual_seed(0)
    w = {"gate_up_proj": torch.randn(E, Hu, 2 * I, generator=g) * 0.3,
         "gate_up_proj_bias": torch.randn(E, 2 * I, generator=g),
         "down_proj": torch.randn(E, I, Hu, generator=g) * 0.3, "down_proj_bias": torch.randn(E, Hu, generator=g)}
    ref = Experts(E, Hu, I, 7.0, 1.702)
    for n, t in w.items():
        getattr(ref, n).data = t
    x = torch.randn(4, Hu, generator=g)
    idx, wt = torch.tensor([[0, 1]] * 4), torch.tensor([[0.7, 0.3]] * 4)
    L = layout(tp=tp, intermediate=I)
    total = torch.zeros(4, Hp)
    for r in range(tp):
        ex = Experts(E, Hp, L.intermediate_per_rank, 7.0, 1.702)
        for n, t in w.items():
            getattr(ex, n).data = tensor_plan("target", f"layers.0.mlp.experts.{n}").apply(t, r, L)
        total += ex.dense(pad_dim(x, 1, Hp), idx, wt)
    torch.testing.assert_close(total[:, :Hu], ref.dense(x, idx, wt), atol=1e-5, rtol=1e-5)
    assert (total[:, Hu:] == 0).all()


def test_gpt_oss_attention_and_router_rules():
    L = layout(tp=2, num_heads=4)
    sinks = torch.arange(4.0)
    assert torch.equal(tensor_plan("target", "layers.1.self_attn.sinks").apply(sinks, 1, L), torch.tensor([2.0, 3.0]))
    router = tensor_plan("target", "layers.1.mlp.router.weight").apply(torch.randn(4, Hu) + 5, 1, L)
    assert router.shape == (4, Hp) and (router[:, Hu:] == 0).all()  # replicated, hidden padded
    assert tensor_plan("target", "layers.1.mlp.router.bias").shard == "replicate"
    b = torch.randn(3, Hu)
    shares = [tensor_plan("target", "layers.1.mlp.experts.down_proj_bias").apply(b, r, L) for r in range(2)]
    torch.testing.assert_close(sum(shares)[:, :Hu], b)
    assert shares[0].shape == (3, Hp)


def test_streaming_writer_accepts_expert_slabs(tmp_path):
    t = torch.randn(4, 3, 5)
    w = StreamingSafetensorsWriter(tmp_path / "x.safetensors", [("e", [4, 3, 5], torch.float32), ("s", [], torch.int64)])
    for e in range(4):
        w.write("e", t[e:e + 1])
    with pytest.raises(ValueError, match="expected s"):
        w.write("e", t[:1])  # one slab too many
    w.write("s", torch.tensor(7))
    w.close()
    back = load_file(tmp_path / "x.safetensors")
    assert torch.equal(back["e"], t) and back["s"].item() == 7
    w2 = StreamingSafetensorsWriter(tmp_path / "y.safetensors", [("e", [4, 3, 5], torch.float32)])
    with pytest.raises(ValueError, match="rows from 0"):
        w2.write("e", torch.randn(5, 3, 5))


def test_experts_stream_one_at_a_time(tmp_path):
    """write_rank_files reads a stacked expert tensor expert by expert (never whole) and writes the same
    per-rank files as sharding the whole tensor."""
    from eagle3_build.checkpoints.sources import TensorSource
    from eagle3_build.sharding import write_rank_files

    E, I = 4, 90
    full = torch.randn(E, Hu, 2 * I)
    reads = []

    def rows(lo, hi):
        reads.append(hi - lo)
        return full[lo:hi]

    def whole():
        raise AssertionError("an expert tensor was read whole")

    name = "layers.0.mlp.experts.gate_up_proj"
    src = TensorSource({name: whole}, {name: list(full.shape)}, "mem", {name: rows})
    L = layout(tp=2, intermediate=I)
    shape = [E, Hp, 2 * L.intermediate_per_rank]
    paths = write_rank_files("target", src, [name], {name: (shape, torch.float32)}, L, tmp_path)
    assert reads == [1] * E
    for r, p in enumerate(paths):
        assert torch.equal(load_file(p)[name], tensor_plan("target", name).apply(full, r, L))
