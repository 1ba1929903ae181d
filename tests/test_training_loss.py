"""scale_draft's training-time-test loss: the target's distribution lines up with the token each TTT step
predicts, and the soft loss (EAGLE-3's) becomes the hard one as the target grows certain."""
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "training"))

from scale_draft import ttt_logits, ttt_loss  # noqa: E402
from train_eagle3_draft import AUX_LAYER_IDS, TrainDraft  # noqa: E402

V, H, TTT = 64, 32, 3


def _target():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=max(AUX_LAYER_IDS) + 1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # confident logits: greedy tokens far from ties, also in bfloat16
        model.model.embed_tokens.weight.mul_(40.0)
    return model.requires_grad_(False)


def _greedy(model, prompt: list[int], n: int) -> torch.Tensor:
    toks = torch.tensor(prompt)
    with torch.no_grad():
        for _ in range(n):
            toks = torch.cat([toks, model(toks[None]).logits[0, -1].argmax()[None]])
    return toks


def test_teacher_is_the_targets_prediction_of_each_steps_token():
    model = _target()
    seqs = [{"tokens": _greedy(model, [5, 9, 11, 3], 14), "P": 4}, {"tokens": _greedy(model, [7, 1, 30], 10), "P": 3}]
    ids = torch.arange(V)
    draft = TrainDraft(H, 64, 2, 1, 16, 1e-6, V, 10000.0, model.model.embed_tokens.weight.detach().clone())
    logits, tgt, teacher = ttt_logits(draft, model, seqs, TTT, "cpu", head=model.lm_head.weight[ids])
    start = 2  # min(P) - 1
    assert teacher.shape[1] == tgt.shape[-1] - 1 and len(logits) == TTT
    # step j at base position start+i predicts token start+i+2+j: the target's argmax at start+i+1+j
    checked = 0
    for j in range(TTT):
        ok = tgt[:, j, :teacher.shape[1] - j] >= 0
        got = teacher[:, j:].argmax(-1)[ok]
        assert torch.equal(got, tgt[:, j, :teacher.shape[1] - j][ok]), j
        checked += int(ok.sum())
    assert checked > 20

    # a near-certain target: the soft loss equals the hard one; a flat one does not
    lab = torch.where(tgt >= 0, tgt, torch.full_like(tgt, -100))  # draft ids = target ids here
    hard = ttt_loss(logits, lab, None)
    soft = ttt_loss(logits, lab, teacher.float() * 1e3)
    torch.testing.assert_close(soft, hard, rtol=1e-4, atol=1e-4)
    flat = ttt_loss(logits, lab, torch.zeros_like(teacher))
    assert abs(float(flat) - float(hard)) > 1e-3
    soft.backward()
    assert draft.fc.weight.grad is not None and draft.fc.weight.grad.abs().sum() > 0
