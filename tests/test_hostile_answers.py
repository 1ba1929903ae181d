"""The same request gets the same answer whatever the server speculates with: real eagle3-serve processes on
one tiny bundle (a chain K 3 and a tree of depth 2 in its menu, two sequence slots), one per --speculation
mode, asked the same things.

* Stop strings: a round that accepts tokens past the one completing a stop string keeps none of them (text,
  finish_reason, usage and the streamed tokens equal plain decoding's).
* Seeds: a seeded sampled request emits the same tokens with no speculation, a chain, a tree or `auto`,
  alone or beside another request (sampling.py: one uniform per output position, keyed by the seed).
* The OpenAI chat forms the `openai` Python package sends (content parts, stream_options), through it.
"""
import concurrent.futures
import json

import httpx
import pytest
from test_server import ServerProc

ANSWERS = {"serving": {"max_num_seqs": 2}, "buckets": {"batch": [1, 2]},
           "speculation": {"num_speculative_tokens": 3,
                           "menu": [{"num_speculative_tokens": 2, "tree": {"topk": 2, "num_draft_tokens": 4}}]}}
MODES = ("none", "chain3", "tree2x2x4", "auto")
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away", "def main():\n    print(", "1, 2, 3, 4,",
           "Speculative decoding lets", "In the beginning", "Roses are red,", "The capital of France is"]


@pytest.fixture(scope="module")
def servers(tiny):
    """{mode: ServerProc}, every mode's server started at once."""
    path = tiny.bundle(recipe=ANSWERS).path
    with concurrent.futures.ThreadPoolExecutor(len(MODES)) as pool:
        started = dict(zip(MODES, pool.map(lambda m: ServerProc(path, "--speculation", m), MODES)))
    yield started
    for s in started.values():
        s.stop()


def post(server, **body) -> dict:
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def streamed(server, **body) -> tuple[list[int], str, dict]:
    """(token ids, text, usage) of a streamed completion."""
    toks, text, usage = [], "", None
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                for c in chunk["choices"]:
                    toks += c.get("token_ids") or []
                    text += c["text"]
                usage = chunk.get("usage") or usage
    return toks, text, usage


def answer(server, body) -> tuple:
    r = post(server, **body)
    c = r["choices"][0]
    return c["text"], c["finish_reason"], r["usage"]["completion_tokens"], c.get("token_ids")


def stop_requests(plain) -> list[dict]:
    """Stop strings cut from the plain answers at several places (inside a speculative round's tokens)."""
    out = []
    for prompt in PROMPTS[:5]:
        text = answer(plain, {"prompt": prompt, "max_tokens": 40, "temperature": 0})[0]
        for at in (3, 9, 17, 26):
            stop = text[at:at + 2]
            if stop.strip():
                out.append({"prompt": prompt, "max_tokens": 40, "temperature": 0, "stop": stop})
    return out


@pytest.mark.parametrize("mode", ["chain3", "tree2x2x4", "auto"])
def test_a_stop_string_ends_the_answer_where_plain_decoding_does(servers, mode):
    """Text, finish_reason, usage and streamed tokens equal --speculation none's for every stop request."""
    plain, spec = servers["none"], servers[mode]
    requests = stop_requests(plain)
    assert len(requests) >= 12
    differ = []
    for body in requests:
        want, got = answer(plain, body), answer(spec, body)
        if want != got or streamed(plain, **body) != streamed(spec, **body):
            differ.append((body["prompt"], body["stop"], want[1:3], got[1:3]))
    assert not differ, differ
    if mode != "auto":  # (auto serves what it expects fastest on this host: plain decoding, often, here)
        metrics = httpx.get(spec.url + "/metrics", timeout=10).text.splitlines()
        accepted = next(float(x.split()[-1]) for x in metrics
                        if x.startswith("eagle3_spec_decode_num_accepted_tokens_total"))
        assert accepted > len(requests)  # it speculated, and its rounds accepted several tokens


def seeded(server, prompt: str, seed: int) -> list[int]:
    r = post(server, prompt=prompt, max_tokens=24, temperature=0.8, top_p=0.95, seed=seed)
    return r["choices"][0]["token_ids"]


def test_a_seeded_request_is_the_same_with_any_speculation_alone_or_batched(servers):
    """Each seeded request alone on every server, then two at a time on the `auto` one: the same tokens."""
    cases = [(PROMPTS[i % len(PROMPTS)], 1000 + i) for i in range(12)]
    alone = {mode: [seeded(servers[mode], p, s) for p, s in cases] for mode in MODES}
    for mode in MODES[1:]:
        assert alone[mode] == alone["none"], mode
    assert len({tuple(t) for t in alone["none"]}) > len(cases) // 2  # (sampled: different seeds, mostly other answers)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two sequences at a time, as they arrive
        paired = list(pool.map(lambda c: seeded(servers["auto"], *c), cases))
    assert paired == alone["none"]


def test_the_openai_client_sends_what_the_server_takes(servers):
    """The shapes the `openai` package builds: chat content as text parts, stream_options with stream, seeds,
    max_completion_tokens; its own response models parse every answer. A part of another type is a 400
    naming it; stream_options without stream is a 400."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=servers["chain3"].url + "/v1", api_key="none", max_retries=0)
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    a = client.chat.completions.create(model=client.models.list().data[0].id, seed=3, temperature=0.8,
                                       max_completion_tokens=8, messages=[{"role": "user", "content": parts}])
    b = client.chat.completions.create(model=a.model, seed=3, temperature=0.8, max_completion_tokens=8,
                                       messages=[{"role": "user", "content": "Hello\nthere"}])
    assert a.choices[0].message.content == b.choices[0].message.content and a.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(model=a.model, messages=[{"role": "user", "content": parts}],
                                                 max_tokens=8, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    c = client.completions.create(model=a.model, prompt="Once upon a time", max_tokens=6, seed=5, temperature=0.5)
    assert c.usage.completion_tokens == 6 and c.choices[0].text
    with pytest.raises(openai.BadRequestError, match=r"messages\.0\.content\.1: content part type \"image_url\""):
        client.chat.completions.create(model=a.model, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    with pytest.raises(openai.BadRequestError, match="stream_options is only allowed with"):
        client.chat.completions.create(model=a.model, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                                       stream_options={"include_usage": True})
