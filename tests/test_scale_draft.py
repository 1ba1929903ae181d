"""training/scale_draft.py end to end on a tiny 30-layer pair (the demo's aux layers 2 / 15 / 27 exist):
prompts from a file (some with a follow-up turn), the target's answers in a chunk, a TTT fine-tune keeping
the draft's vocabulary, a speculators draft the builder loads as a pair, the evaluation in its report (MT-Bench's
second turns among it); a second run answers nothing again."""
import gzip
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle3_build.testing.tiny import TINY_CORPUS, make_tiny_pair

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "training"))

import scale_draft  # noqa: E402

SETS = ("heldout-pool", "mtbench", "heldout-templates", "unseen-chat", "mtbench-turn2")
FOLLOW = "Say it again in fewer words."


def _prompts(path: Path) -> None:
    lines = [s.strip() for s in TINY_CORPUS.replace("\n", " ").split(".") if len(s.split()) > 4]
    rows = [{"prompt": f"Continue: {s}.", "source": "test", "split": "heldout" if i < 4 else "train"}
            for i, s in enumerate(lines)]
    for r in rows[3:7]:  # one held-out row, three training rows
        r["followup"] = FOLLOW
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def _weights(d: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_prompts_answers_finetune_eval(tmp_path):
    make_tiny_pair(tmp_path / "pair", num_layers=30)
    _prompts(tmp_path / "prompts.jsonl.gz")
    mt = tmp_path / "question.jsonl"
    mt.write_text("".join(json.dumps({"question_id": i, "category": "writing", "turns": [q, "Shorter, please."]}) + "\n"
                          for i, q in enumerate(["Tell me about the river.", "What did the farmers do?"])))
    data, out = tmp_path / "data", tmp_path / "out"
    args = ["--target", str(tmp_path / "pair" / "target"), "--init-from", str(tmp_path / "pair" / "draft"),
            "--prompts-from", str(tmp_path / "prompts.jsonl.gz"), "--mtbench", str(mt), "--data", str(data),
            "--device", "cpu", "--threads", "1", "--gen-batch", "16", "--max-new-tokens", "24",
            "--eval-max-new-tokens", "8", "--keep-vocab", "--batch-tokens", "256", "--epochs", "10", "--lr", "3e-3",
            "--warmup", "2", "--deadline", "600", "--shares", "0.0,0.3,0.9"]
    assert scale_draft.main(args + ["--out", str(out)]) == 0

    answers = data / "answers-000.safetensors"
    seqs = scale_draft.load_answers(answers)
    rows = [json.loads(x) for x in gzip.open(tmp_path / "prompts.jsonl.gz", "rt")]
    train = [r for r in rows if r["split"] == "train"]
    assert len(seqs) == len(train) + 3 and all(len(s["tokens"]) > s["P"] for s in seqs)
    # a follow-up's context is the conversation so far: the first prompt, the target's own answer, the next turn
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "pair" / "target")
    for first, follow in zip(seqs[:3], seqs[-3:]):
        said = tok.decode(first["tokens"][first["P"]:], skip_special_tokens=True).strip()
        context = tok.decode(follow["tokens"][:follow["P"]])
        assert said and context.startswith(tok.decode(first["tokens"][:first["P"]])) and said in context, context
        assert context.rstrip().removesuffix("assistant").rstrip().removesuffix("<|eot_id|>").endswith(FOLLOW)
    assert len(scale_draft.load_answers(data / "answers-heldout.safetensors")) == 5
    report = json.loads((data / "report.json").read_text())
    assert report["answers"]["train_sequences"] == len(seqs) and report["vocab"]["rule"] == "kept from --init-from"
    assert report["training"]["steps"] >= 2
    for name in SETS:
        ev = report["eval"][name]
        assert ev["before"]["drafts"] == ev["after"]["drafts"] > 0, name
        assert 1.0 <= ev["after"]["K1"] <= ev["after"]["K4"] <= 5.0 and 0.0 < ev["vocab_coverage"] <= 1.0, name
        assert 1.0 <= ev["after"]["served"]["K1"] <= ev["after"]["served"]["K4"] <= 5.0, name
    # the draft learnt the target's answers: acceptance on held-out prompts of the same kind rose
    pool = report["eval"]["heldout-pool"]
    assert pool["after"]["K3"] > pool["before"]["K3"] + 0.2, pool

    # the output is a speculators draft: the starting one's vocabulary, its weights moved, the run recorded
    before, after = _weights(tmp_path / "pair" / "draft"), _weights(out)
    assert torch.equal(after["d2t"], before["d2t"])
    assert not torch.allclose(after["fc.weight"].float(), before["fc.weight"].float())
    cfg = json.loads((out / "config.json").read_text())
    rec = cfg["eagle3_build_training"]
    assert rec["init_from"]["path"] == str(tmp_path / "pair" / "draft") and set(SETS) <= set(rec["eval"])

    # ... that the builder loads and checks against its target
    from eagle3_build.pair import load_pair
    from eagle3_build.recipe import load_recipe

    recipe = tmp_path / "pair" / "recipe.yaml"
    recipe.write_text(recipe.read_text().replace("draft: ./draft", f"draft: {out}"))
    lp = load_pair(load_recipe(recipe).pairs[0])
    assert lp.draft is not None

    # a second run over the same data answers nothing again (the chunk file is kept as it is)
    mtime = answers.stat().st_mtime_ns
    assert scale_draft.main(args + ["--answers-only"]) == 0
    assert answers.stat().st_mtime_ns == mtime


def test_served_rounds_start_where_the_last_round_ended():
    # run[i]: drafts a chain at base i would get right. Base 1 (the prompt's last token): 2 accepted, then the
    # round at base 4 (1 + 2 + the bonus) gets 0, at 5 gets min(5, 3) = 3; at 9 the pending token is the
    # answer's last (n = 11): no round
    run = [9, 2, 9, 9, 0, 5, 9, 9, 9, 1, 0]
    assert scale_draft.served_rounds(run, 1, 11, 3) == [2, 0, 3]
    assert scale_draft.served_rounds(run, 1, 11, 1) == [1, 1, 1, 1]
    # per position the same run averages higher: positions inside an accepted run start no round
    assert sum(min(r, 3) for r in run[1:9]) / 8 > sum([2, 0, 3]) / 3
