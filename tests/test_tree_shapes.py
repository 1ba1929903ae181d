"""training/tree_shapes.py: static trees fitted to the ranks the target's tokens take under the draft, their
acceptance per position and per replayed round, and the whole run on a tiny 30-layer pair."""
import gzip
import json
import sys
from collections import Counter
from pathlib import Path

import torch

from eagle3_build.testing.tiny import TINY_CORPUS, make_tiny_pair
from eagle3_runtime.speculation import static_tree

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "training"))

import tree_shapes as ts  # noqa: E402

M = ts.MISS


def test_fit_takes_the_most_frequent_prefixes_and_is_a_valid_static_tree():
    # per base position the ranks (r_0, r_1, r_2) of the target's tokens at depths 1..3
    rows = [[0, 0, 0]] * 5 + [[0, 1, M]] * 3 + [[1, 0, 0]] * 2 + [[2, M, M]] + [[M, M, M]] * 4
    seqs = [{"tokens": torch.zeros(len(rows) + 2, dtype=torch.long), "P": 1}]
    counts, n = ts.prefix_counts([torch.tensor(rows + [[M] * 3] * 2)], seqs, max_rank=8)
    assert n == len(rows)
    assert counts[(0,)] == 8 and counts[(0, 0)] == 5 and counts[(0, 1)] == 3 and counts[(1,)] == 2
    tree = ts.fit_tree(counts, nodes=5, max_depth=3)
    assert tree == [[0], [0, 0], [0, 1], [0, 0, 0]]  # (1,) seen twice: fewer than (0, 1)'s 3
    static_tree(tree)  # prefix-closed: the runtime's own check passes
    # at most 2 deep: (1,) and (1, 0) tie at 2, the shallower first
    assert ts.fit_tree(counts, nodes=5, max_depth=2) == [[0], [1], [0, 0], [0, 1]]
    assert static_tree(tree).width == 1 and static_tree([[0], [1], [0, 0], [1, 0]]).width == 2


def test_acceptance_is_the_longest_path_of_the_tree_per_position_and_per_round():
    tree = [[0], [1], [0, 0], [1, 0], [0, 0, 0]]
    rk = torch.tensor([[1, 0, 0], [0, 0, 1], [2, 0, 0], [0, 0, 0], [1, 1, 0], [0, 0, 0], [M, M, M]])
    assert ts.accepted(rk, {tuple(p) for p in tree}) == [2, 2, 0, 3, 1, 3, 0]
    seqs = [{"tokens": torch.zeros(7, dtype=torch.long), "P": 1}]
    got = ts.score([rk], seqs, tree)
    # teacher-forced: bases 0..4 (the last two have no next token to predict); served: rounds at 0 (2 drafts),
    # then 3 (3 drafts); at 7 the answer is over
    assert got["teacher_forced"] == round(1 + (2 + 2 + 0 + 3 + 1) / 5, 3)
    assert got["served"] == 1 + (2 + 3) / 2 and got["rounds"] == 2
    # a chain is the tree of rank-0 paths
    assert ts.accepted(rk, {(0,), (0, 0), (0, 0, 0)}) == [0, 2, 0, 3, 0, 3, 0]


def test_run_on_a_tiny_pair(tmp_path):
    make_tiny_pair(tmp_path / "pair", num_layers=30)
    lines = [s.strip() for s in TINY_CORPUS.replace("\n", " ").split(".") if len(s.split()) > 4]
    with gzip.open(tmp_path / "pool.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"prompt": f"Continue: {s}.", "split": "heldout" if i < 6 else "train"}) + "\n"
                     for i, s in enumerate(lines))
    mt = tmp_path / "question.jsonl"
    mt.write_text("".join(json.dumps({"question_id": i, "turns": [q]}) + "\n"
                          for i, q in enumerate(["Tell me about the river.", "What did the farmers do?"])))
    out = tmp_path / "out"
    args = ["--target", str(tmp_path / "pair" / "target"), "--draft", str(tmp_path / "pair" / "draft"),
            "--pool", str(tmp_path / "pool.jsonl.gz"), "--mtbench", str(mt), "--eval", "mtbench",
            "--nodes", "4,6", "--max-depth", "3", "--max-tokens", "12", "--threads", "1", "--out", str(out)]
    assert ts.main(args) == 0
    report = json.loads((out / "report.json").read_text())
    shapes = report["shapes"]
    assert {"chain1", "chain2", "chain3"} <= set(shapes) and report["tune_positions"] > 0
    for tag, s in shapes.items():
        spec = static_tree(s["choices"])
        assert (spec.num_nodes, spec.depth, spec.width) == (s["nodes"], s["depth"], s["width"]), tag
        for name in ("heldout-pool", "mtbench"):
            assert 1.0 <= s[name]["served"] <= 1 + s["depth"] and 1.0 <= s[name]["teacher_forced"] <= 1 + s["depth"]
    # on the set the trees were fitted on, a tree of n nodes and depth d accepts at least as much as the chain of
    # min(d, n - 1): one of the trees it was chosen among
    pool = {t: s["heldout-pool"]["teacher_forced"] for t, s in shapes.items()}
    for tag, s in shapes.items():
        if tag.startswith("static"):
            assert pool[tag] >= pool[f"chain{min(s['depth'], s['nodes'] - 1)}"] - 1e-9, tag
    # answers are cached: a second run generates nothing
    files = {p: p.stat().st_mtime_ns for p in out.glob("answers-*.safetensors")}
    assert len(files) == 2 and ts.main(args) == 0
    assert {p: p.stat().st_mtime_ns for p in out.glob("answers-*.safetensors")} == files
    assert Counter(p.name.split("-")[1] for p in files) == Counter({"heldout": 1, "mtbench": 1})


def test_bad_arguments_are_one_usage_line(tmp_path, capsys):
    mt = tmp_path / "question.jsonl"
    mt.write_text(json.dumps({"question_id": 1, "turns": ["Hello?"]}) + "\n")
    for argv, said in ((["--eval", "heldout-pool"], "not an evaluation set"), (["--nodes", "1,8"], "integers, e.g. 8,12, >= 2"),
                       (["--pool", str(tmp_path / "no")], "no such"), (["--max-depth", "x"], "one integer")):
        try:
            ts.main(argv + ["--mtbench", str(mt)])
        except SystemExit as e:
            assert e.code == 2, argv
        else:
            raise AssertionError(f"{argv} accepted")
        assert said in capsys.readouterr().err, argv
