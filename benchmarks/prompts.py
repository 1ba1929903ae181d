"""The prompt sets every benchmark draws from, by name, and their encoding in a bundle's chat template."""
from __future__ import annotations

import itertools
import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
UNSEEN = REPO / "benchmarks" / "prompts" / "unseen-chat.txt"
SETS = "heldout | unseen | mtbench | mtbench-mix | builtin | FILE"
HELP = ("heldout: the draft training script's held-out prompts; unseen: benchmarks/prompts/unseen-chat.txt; "
        "mtbench: MT-Bench's 80 first turns; mtbench-mix: the same taken category by category in turn (the first "
        "40: 5 of each of the 8); builtin: verify's prompts; or a file (one per line, .json, .jsonl)")


def texts(spec: str, n: int | None = None) -> list[str]:
    """The first `n` prompts of the set `spec` (all of them: None)."""
    if spec == "heldout":
        from training.train_eagle3_draft import make_prompts

        if n is not None and n > 48:
            print(f"--num-prompts {n}: the training script holds out 48 prompts; the rest overlap training data",
                  file=sys.stderr)
        return make_prompts(0, 48 if n is None else n, 0)[1]  # held out = the first n_eval unique prompts of seed 0
    if spec in ("mtbench", "mtbench-mix"):
        from training.eval_sets import mtbench_questions

        qs = mtbench_questions()
        if spec == "mtbench-mix":  # (the i-th question of every category, then the (i+1)-th, ...)
            by_cat: dict[str, list] = {}
            for q in qs:
                by_cat.setdefault(q["category"], []).append(q)
            qs = [q for rank in itertools.zip_longest(*by_cat.values()) for q in rank if q is not None]
        out = [q["turns"][0] for q in qs]
    elif spec.endswith(".jsonl"):
        rows = [json.loads(line) for line in Path(spec).read_text().splitlines() if line.strip()]
        out = [r if isinstance(r, str) else r["turns"][0] if "turns" in r else r["prompt"] for r in rows]
    else:
        from eagle3_build.verify import BUILTIN_PROMPTS, load_prompts

        out = list(BUILTIN_PROMPTS) if spec == "builtin" else load_prompts(UNSEEN if spec == "unseen" else spec)
    return out[:n]


def encode(bundle_dir: Path, prompts: list[str], chat: bool) -> tuple[list[list[int]], bool]:
    """Token ids by the bundle's tokenizer, each prompt one user message in its chat template (raw text where
    `chat` is off or the tokenizer has no template); and whether the template was used."""
    from eagle3_runtime.chat import ChatTemplate
    from eagle3_runtime.tokenizer import BundleTokenizer

    tok = BundleTokenizer(bundle_dir)
    template = ChatTemplate.from_bundle(bundle_dir) if chat else None
    if chat and template is None:
        print("the bundle's tokenizer has no chat template: prompts are encoded as raw text", file=sys.stderr)
    if template is None:
        return [tok.encode(t) for t in prompts], False
    with template:
        return [tok.encode(template.render([{"role": "user", "content": t}]), add_special_tokens=False)
                for t in prompts], True


WORDS = (
    "the of and to in is was for that with on as by at from his her it an are were which this be or "
    "had not have one their all but new more when who will about time would there after year other "
    "first also two into what some only over could state city may most such made then people many "
    "out can between these both where any work world under three part school during used since each "
    "well same later found while life name home water house early place small power group great long "
    "north south east west river line family music book light sound game field order point market land "
    "road story green black white blue red gold stone wood tree field garden window table door paper "
    "money child woman man king queen army war peace law court church island village country mountain "
    "summer winter spring morning night day week month hour minute road train ship car horse bird fish "
    "open close read write speak listen walk run build grow learn teach carry bring hold keep start stop "
    "good bad old young high low big little strong quick slow warm cold bright dark clear simple common"
).split()


def random_words(rng: random.Random, n_words: int) -> str:
    """A sentence of `n_words` random common words (serving load prompts, tiny-pair prompts)."""
    words = [rng.choice(WORDS) for _ in range(max(1, n_words))]
    words[0] = words[0].capitalize()
    return " ".join(words) + "."


def random_prompts(seed: int, num: int, n_words: int) -> list[str]:
    rng = random.Random(seed)
    return [random_words(rng, n_words) for _ in range(num)]
