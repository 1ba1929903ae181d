"""The committed draft's training prompts hold no prompt of any evaluation set the project reports on."""
import collections
import gzip
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "training"))

from eval_sets import eval_prompts, norm_text  # noqa: E402
from scale_draft import OPENINGS  # noqa: E402

PROMPTS = REPO / "training" / "data" / "draft-prompts.jsonl.gz"


def rows():
    return [json.loads(line) for line in gzip.open(PROMPTS, "rt")]


def test_no_evaluation_prompt_is_trained_on():
    sets = eval_prompts()  # MT-Bench from its PyPI wheel
    assert len(sets["mtbench"]) == 80 and len(sets["heldout-templates"]) == 48
    trained = {norm_text(r["prompt"]) for r in rows()}
    for name, prompts in sets.items():
        assert prompts, name
        hits = [p for p in prompts if norm_text(p) in trained]
        assert not hits, f"{name}: {len(hits)} evaluation prompts in the training prompts, e.g. {hits[0]!r}"


def test_prompt_file_is_what_the_readme_says():
    r = rows()
    known = {"templates"} | {f"magpie-{c}" for c in ["free", *OPENINGS]}
    assert {x["source"] for x in r} <= known
    split = collections.Counter(x["split"] for x in r)
    assert split == {"train": 19045, "heldout": 256}
    held = {norm_text(x["prompt"]) for x in r if x["split"] == "heldout"}
    assert not held & {norm_text(x["prompt"]) for x in r if x["split"] == "train"}
    assert len({norm_text(x["prompt"]) for x in r}) == len(r)  # deduplicated
