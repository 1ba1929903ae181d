"""training/sharegpt_prompts.py: a cut-off ShareGPT file gives its complete conversations' first user turns,
filtered, and never an evaluation prompt (nor one that begins as an evaluation prompt does); the second user
turn rides along as a follow-up under the same rules."""
import gzip
import hashlib
import json
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "training"))

from eval_sets import eval_prompts  # noqa: E402
from sharegpt_prompts import MEMBER, main  # noqa: E402


def _chat(cid, *turns):
    return {"id": cid, "conversations": [{"from": f, "value": v} for t in turns for f, v in (("human", t), ("gpt", "ok"))]}


def test_first_turns_of_complete_conversations_only(tmp_path):
    evals = eval_prompts(None)
    mt, mt2 = evals["mtbench"][0], evals["mtbench-turn2"][0]
    chats = [_chat("a_0", "How do I sort a list in Python?", "And how do I sort it in reverse order?"),
             _chat("a_1", "and what about tuples?"),  # a continuation the cleaned split made
             _chat("b_0", "  " + mt.upper() + "  "),  # an evaluation prompt, case and spacing aside
             _chat("c_0", mt + " Answer in French."),  # begins as one does
             _chat("d_0", "hi"),  # too short
             _chat("e_0", "Объясни, пожалуйста, как работает TCP и чем он отличается от UDP?"),  # not English
             _chat("f_0", "Write a haiku about the sea.", mt2),  # a follow-up that is MT-Bench's second turn
             _chat("g_0", "how do i sort a list in python?"),  # a duplicate
             {"id": "i_0", "conversations": [{"from": "human", "value": ["not", "text"]}]},  # malformed: skipped
             {"id": "j_0", "conversations": "not a list"}, ["not", "a", "conversation"],
             _chat("h_0", "Summarise the plot of Hamlet in three sentences.")]
    text = "[" + ", ".join(json.dumps(c) for c in chats)
    text = text[:-25]  # cut off inside the last conversation
    wheel = tmp_path / "sharegpt.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(MEMBER, text)
    out = tmp_path / "prompts.jsonl.gz"
    assert main([str(wheel), "--out", str(out), "--heldout", "1",
                 "--sha256", hashlib.sha256(wheel.read_bytes()).hexdigest()]) == 0
    rows = [json.loads(x) for x in gzip.open(out, "rt")]
    assert sorted(r["prompt"] for r in rows) == ["How do I sort a list in Python?", "Write a haiku about the sea."]
    assert [r["split"] for r in rows] == ["train", "heldout"] and {r["source"] for r in rows} == {"sharegpt-v3"}
    follow = {r["prompt"]: r.get("followup") for r in rows}
    assert follow == {"How do I sort a list in Python?": "And how do I sort it in reverse order?",
                      "Write a haiku about the sea.": None}


def test_another_or_missing_wheel_is_one_line_exit_2(tmp_path, capsys):
    wheel = tmp_path / "other.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(MEMBER, "[]")
    empty = tmp_path / "empty.whl"  # pinned by its own digest, but nothing in ShareGPT's form
    with zipfile.ZipFile(empty, "w") as z:
        z.writestr(MEMBER, json.dumps([{"id": "a_0", "conversations": [{"from": "human", "value": 7}]}, 3]))
    for argv, needle in (([str(wheel)], "sha256"), ([str(tmp_path / "none.whl")], "no such file"),
                         ([str(empty), "--sha256", hashlib.sha256(empty.read_bytes()).hexdigest()], "ShareGPT's form"),
                         ([str(REPO / "README.md"), "--sha256", hashlib.sha256((REPO / "README.md").read_bytes()).hexdigest()],
                          "not a wheel")):
        with pytest.raises(SystemExit) as e:
            main([*argv, "--out", str(tmp_path / "p.jsonl.gz")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and needle in err and "Traceback" not in err, err
    assert not (tmp_path / "p.jsonl.gz").exists()
