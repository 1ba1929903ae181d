"""verify_server: the verify gate pointed at a running OpenAI-compatible server (eagle3-serve, vLLM, SGLang)
instead of a bundle. The recipe names the pair the server was started with: its target is the reference
(transformers) and the tokenizer, its draft directory what the diagnosis reads, its ``verify`` section
the settings. Per prompt, one POST /v1/completions with the prompt as token ids, temperature 0 and
``return_token_ids`` (vLLM's field; eagle3-serve always returns them) is compared with transformers' greedy
continuation token for token (near-ties as for a bundle); the acceptance block is the difference of the
server's speculative-decoding counters in /metrics (eagle3_spec_decode_* or vllm:spec_decode_*) around each
request, so the server should serve nothing else meanwhile."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from eagle3_runtime.metrics import SpecStats
from eagle3_runtime.spec_counters import parse_prometheus, spec_counters, stats_between

from ..checkpoints.load import eos_token_ids
from ..errors import UserError, VerifyError
from ..recipe import PairRecipe, load_recipe
from .compare import check_continuation, coarser, compare
from .diagnose import Diagnosis, DraftUnderTest, diagnose_draft, floats
from .prompts import select_prompts
from .reference import Reference, TargetLocation, load_reference, reference_greedy
from .report import VerifyReport
from .run import resolve_settings


def verify_server(
    url: str,
    recipe: str | Path,
    *,
    pair: str | None = None,
    model: str | None = None,
    prompts: Sequence[str] | str | Path | None = None,
    num_prompts: int | None = None,
    max_tokens: int | None = None,
    min_acceptance_length: float | None = None,
    reference_dtype: str | None = None,
    chat: bool | None = None,
    diagnose: bool | None = None,
    progress: Callable[[str], None] | None = None,
    timeout: float = 600.0,
) -> VerifyReport:
    """Verify the server at `url` serving the pair `pair` of `recipe` (the only one when None); `model` the
    served model name (default: the first /v1/models lists). Other settings as verify_bundle's, their
    defaults from the pair's ``verify`` section. Raises VerifyError for bad input or an unusable server."""
    t0 = time.perf_counter()
    say = progress or (lambda msg: None)
    base = base_url(url)
    p = recipe_pair(recipe, pair)
    (num_prompts, max_tokens, chat, min_acceptance_length), ref_dtype = resolve_settings(
        p.verify, p.dtype, num_prompts, max_tokens, chat, min_acceptance_length, reference_dtype)
    location = pair_target(p)
    texts = select_prompts(prompts, num_prompts)
    encoded = encode_with_target(texts, location, chat=chat)

    with httpx.Client(timeout=timeout) as client:
        served = served_model(client, base, model)
        say(f"server {base}: model {served}")
        say("loading the reference target")
        ref_model, ref_desc = load_reference(None, dtype=ref_dtype, location=location)
        first = counters(client, base)
        results, refs, last = _check_prompts(client, base, served, texts, encoded, ref_model, max_tokens,
                                             coarser(p.dtype, ref_dtype), first, say)
    acc = stats_between(first, last)
    note = None
    if acc is None:
        note = (f"{base}/metrics has no speculative-decoding counters (eagle3_spec_decode_* or vllm:spec_decode_*): "
                "is speculative decoding on (vLLM: --speculative-config), and is /metrics this server's?")
        acc = SpecStats(p.speculation.num_speculative_tokens)
    report = VerifyReport(bundle=f"{base} (model {served})", reference=ref_desc, dtype=p.dtype,
                          reference_dtype=ref_dtype, num_speculative_tokens=acc.k, max_tokens=max_tokens,
                          speculation=f"served by {base}, counters {last['metric_prefix'] if last else 'none'}",
                          min_acceptance_length=min_acceptance_length, prompts=results, acceptance=acc,
                          acceptance_note=note, subject="server")
    if (diagnose or (diagnose is None and not report.gate_ok)) and note is None:
        say("diagnosing the draft")
        _diagnose(report, p, ref_model, [(ids, r.ids) for ids, r in zip(encoded, refs)], acc)
    report.seconds = time.perf_counter() - t0
    return report


def _check_prompts(client: httpx.Client, base: str, served: str, texts: Sequence[str], encoded: list[list[int]],
                   ref_model, max_tokens: int, tie_dtype: str, before: dict | None, say: Callable[[str], None]):
    """Each prompt served once and compared with the reference; its acceptance from the counters around it
    (`before`: the counters before the first). Returns the results, the reference continuations and the
    counters after the last prompt."""
    gen = ref_model.generation_config
    eos = eos_token_ids(ref_model.config.to_dict(), {"eos_token_id": gen.eos_token_id} if gen else None)
    results, refs = [], []
    for i, (text, ids) in enumerate(zip(texts, encoded)):
        say(f"prompt {i + 1}/{len(texts)}")
        ref = reference_greedy(ref_model, ids, max_tokens, eos)
        got = complete(client, base, served, ids, max_tokens)
        after = counters(client, base)
        r = compare(text, ids, *same_ending(ref, got, eos), tie_dtype)
        one = stats_between(before, after)
        r.acceptance_length = one.mean_acceptance_length if one is not None and one.num_drafts else 1.0
        before = after
        if r.near_tie:
            check_continuation(ref_model, r, tie_dtype)
        results.append(r)
        refs.append(ref)
    return results, refs, before


def _diagnose(report: VerifyReport, p: PairRecipe, ref_model, pairs: list, acc: SpecStats) -> None:
    """The draft directory of the recipe checked against the reference (best effort: a crash here is
    reported beside the verdict, never instead of it)."""
    try:
        found = checkpoint_draft(p, ref_model)
        report.diagnoses = found if isinstance(found, list) else diagnose_draft(
            found, ref_model, pairs, acc.per_position[0] if acc.num_drafts else None)
    except Exception as e:  # noqa: BLE001 - best effort: never hide the verdict behind a diagnosis crash
        report.diagnosis_error = f"{type(e).__name__}: {e}"


def recipe_pair(recipe: str | Path, name: str | None) -> PairRecipe:
    try:
        pairs = load_recipe(recipe).pairs
    except UserError as e:
        raise VerifyError(str(e)) from e
    if name is None:
        if len(pairs) != 1:
            raise VerifyError(f"{recipe}: has {len(pairs)} pairs ({', '.join(q.name for q in pairs)}); name the one "
                              "the server serves with --pair")
        return pairs[0]
    for q in pairs:
        if q.name == name:
            return q
    raise VerifyError(f"{recipe}: no pair named {name!r} (it has {', '.join(q.name for q in pairs)})")


def base_url(url: str) -> str:
    """http(s)://host[:port][/prefix] without a trailing / or /v1."""
    u = urlsplit(url.strip())
    if u.scheme not in ("http", "https") or not u.hostname:
        raise VerifyError(f"--server {url!r}: give the server's base URL, e.g. http://127.0.0.1:8000")
    path = u.path.rstrip("/").removesuffix("/v1")
    return f"{u.scheme}://{u.netloc}{path}"


def pair_target(p: PairRecipe) -> TargetLocation:
    from ..checkpoints.sources import resolve

    try:
        src = resolve(p.target, "target")
    except UserError as e:
        raise VerifyError(f"pair {p.name}: its target is the reference and cannot be read here: {e}") from e
    if not src.directory.exists():
        raise VerifyError(f"pair {p.name}: its target {p.target.uri} is not on this machine ({src.directory})")
    return TargetLocation(src.directory, src.gguf_file, p.target.uri)


def encode_with_target(texts: list[str], loc: TargetLocation, *, chat: bool) -> list[list[int]]:
    """Token ids of each prompt with the target's own tokenizer; ``chat``: one user message in its chat
    template (what the server's chat endpoint would render)."""
    from transformers import AutoTokenizer

    kw = {"gguf_file": loc.gguf_file} if loc.gguf_file else {}
    try:
        tok = AutoTokenizer.from_pretrained(loc.directory, **kw)
    except Exception as e:  # noqa: BLE001 - transformers raises many types
        raise VerifyError(f"target {loc.description}: cannot load its tokenizer ({type(e).__name__}: {e})") from e
    if not chat:
        return [tok.encode(t) for t in texts]
    if not getattr(tok, "chat_template", None):
        raise VerifyError(f"target {loc.description}: --chat needs a chat template and its tokenizer has none")
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                               add_generation_prompt=True), add_special_tokens=False) for t in texts]


def _get(client: httpx.Client, url: str) -> httpx.Response:
    try:
        return client.get(url)
    except httpx.HTTPError as e:
        raise VerifyError(f"cannot reach {url} ({type(e).__name__}: {e}); is the server running there?") from e


def served_model(client: httpx.Client, base: str, model: str | None) -> str:
    r = _get(client, base + "/v1/models")
    try:
        ids = [m["id"] for m in r.json()["data"]] if r.status_code == 200 else None
    except (ValueError, KeyError, TypeError):
        ids = None
    if not ids:
        raise VerifyError(f"{base}/v1/models answered HTTP {r.status_code} without a model list; is {base} an "
                          "OpenAI-compatible server?")
    if model is not None and model not in ids:
        raise VerifyError(f"--model {model!r}: {base} serves {', '.join(ids)}")
    return model or ids[0]


def counters(client: httpx.Client, base: str) -> dict | None:
    r = _get(client, base + "/metrics")
    return spec_counters(parse_prometheus(r.text)) if r.status_code == 200 else None


def complete(client: httpx.Client, base: str, model: str, ids: list[int], max_tokens: int) -> list[int]:
    """The server's greedy continuation of `ids` as token ids."""
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "return_token_ids": True}
    try:
        r = client.post(base + "/v1/completions", json=body)
    except httpx.HTTPError as e:
        raise VerifyError(f"POST {base}/v1/completions failed ({type(e).__name__}: {e})") from e
    if r.status_code != 200:
        raise VerifyError(f"POST {base}/v1/completions answered HTTP {r.status_code}: {r.text[:300]}")
    try:
        out = r.json()["choices"][0]["token_ids"]
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise VerifyError(f"{base}/v1/completions returned no choices[0].token_ids; verify --server needs a server "
                          "that returns token ids (vLLM >= 0.10.2 with return_token_ids, eagle3-serve)") from e
    if not isinstance(out, list) or not all(isinstance(t, int) for t in out):
        raise VerifyError(f"{base}/v1/completions: choices[0].token_ids is not a list of token ids")
    return out


def same_ending(ref: Reference, got: list[int], eos: list[int]) -> tuple[Reference, list[int]]:
    """Both sides without a final end-of-sequence token: servers differ in whether they return it."""
    if ref.ids and ref.ids[-1] in eos:
        ref = Reference(ref.ids[:-1], ref.logits[:-1])
    return ref, got[:-1] if got and got[-1] in eos else got


def checkpoint_draft(p: PairRecipe, model) -> DraftUnderTest | list[Diagnosis]:
    """The recipe's draft directory as the diagnosis reads it, or what the builder's pair check finds wrong
    with it (a missing d2t, shapes that do not fit the target: a certain cause, nothing more to run)."""
    from ..checkpoints.load import load_draft, load_target
    from ..checkpoints.pair_checks import check_pair
    from ..checkpoints.sources import resolve

    try:
        target = load_target(resolve(p.target, "target"))
        draft = load_draft(resolve(p.draft, "draft"), target)
    except UserError as e:
        return [Diagnosis("draft", f"the draft {p.draft.uri} cannot be read as an EAGLE3 draft: {e}")]
    try:
        check_pair(target, draft)
    except UserError as e:
        cause = "d2t" if "d2t" in str(e) else "draft"
        return [Diagnosis(cause, f"the draft {p.draft.uri} (the directory the server was given) fails the pair "
                                 f"check: {e}")]
    weights = {n: draft.tensors.get(n) for n in draft.tensors.names()}
    if not draft.has_embed:
        weights["embed_tokens.weight"] = model.get_input_embeddings().weight.detach()
    lm = model.get_output_embeddings()
    return DraftUnderTest(draft.args, floats(weights), target.args.vocab_size,
                          None if lm is None else lm.weight.detach().float(), engine="server")
