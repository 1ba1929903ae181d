"""Token-tree speculation through the engine and real compiled graphs (tiny pair, export backend).

* (greedy tree speculation == transformers on 20 prompts: tests/test_tree_lossless.py)
* an oracle draft that puts the target's next token at the SECOND child of every node makes every
  round accept a path off the first-child line, so the verified KV of the path must be moved into
  place (Bundle.compact_kv) before the next pass: the output must still be the target's, with the
  acceptance length of the full depth; with the move disabled the output must change (the check can fail);
* a bundle with a tree at batch 1 and a chain at batch 2 serves concurrent requests with each
  request's own tokens.
"""
import pytest
import torch

import eagle3_runtime.engine as engine_mod
from eagle3_runtime.bundle import Bundle
from eagle3_runtime.engine import Engine
from eagle3_runtime.tree import Drafting, Tree

DYNAMIC = {"speculation": {"num_speculative_tokens": 3, "tree": {"topk": 2, "num_draft_tokens": 7}}}
STATIC = {"speculation": {"tree": {"choices": [[0], [1], [0, 0], [1, 0], [0, 0, 0], [1, 0, 0]]}}}
MIXED = {"serving": {"max_num_seqs": 2}, "buckets": {"batch": [1, 2]},
         "speculation": {"num_speculative_tokens": 3, "tree": {"topk": 2, "num_draft_tokens": 7},
                         "per_batch_bucket": {2: {"num_speculative_tokens": 2}}}}
PROMPTS = [[0, 477, 158, 341, 32, 193, 35], [0, 39, 90, 82, 78, 383, 314, 259], [0, 70, 71, 72, 275, 75, 68],
           [0, 5, 17, 301, 44, 402], [0, 260, 261, 262]]


@pytest.fixture(scope="module")
def dynamic(tiny):
    return Bundle(tiny.bundle(recipe=DYNAMIC).path)


def _reference(bundle: Bundle, prompt: list[int], n: int) -> list[int]:
    return Engine(bundle, speculative=False).generate(prompt, n).token_ids


class _Oracle:
    """Replaces the engine's Drafting: every node's first child is a decoy, its second the target's next
    token, so the accepted path is root -> 2 -> 4 -> 6 (node indices), never the first-child line."""

    def __init__(self, truth: dict[int, list[int]]):
        self.truth, self.queue = truth, []

    def __call__(self, shape, root, top_tokens, top_logprobs):
        seq = self.queue.pop(0)
        ref = self.truth[id(seq.req)]
        nxt = ref[seq.pos + 1: seq.pos + 1 + shape.depth]

        class Fixed(Drafting):
            def tree(self) -> Tree:
                tokens, parents, depths = [root], [-1], [0]
                parent = 0
                for d, t in enumerate(nxt):
                    tokens += [(t + 1) % 512, t]  # decoy first, the truth second
                    parents += [parent, parent]
                    depths += [d + 1, d + 1]
                    parent = len(tokens) - 1
                while len(tokens) < shape.num_nodes:  # near the end of the reference: pad with decoys
                    tokens.append(0)
                    parents.append(0)
                    depths.append(1)
                return Tree(tokens, parents, depths)

        return Fixed(shape, root, top_tokens, top_logprobs)


def _oracle_run(bundle: Bundle, prompts, n, monkeypatch, compact: bool = True):
    eng = Engine(bundle)
    refs: dict[int, list[int]] = {}
    outs = []
    oracle = _Oracle(refs)
    real_round = eng._spec_round

    def spec_round(bsz, shape, spec):
        oracle.queue = [s for s, ok in zip(eng.active, spec) if ok]
        return real_round(bsz, shape, spec)

    monkeypatch.setattr(eng, "_spec_round", spec_round)
    monkeypatch.setattr(engine_mod, "Drafting", oracle)
    if not compact:
        monkeypatch.setattr(bundle, "compact_kv", lambda row, src, dst: None)
    real_submit, truth = eng.submit, []

    def submit(req):  # the oracle's truth, by request
        refs[id(req)] = truth[-1]
        return real_submit(req)

    monkeypatch.setattr(eng, "submit", submit)
    for prompt in prompts:
        ref = _reference(bundle, prompt, n)
        truth.append(list(prompt) + ref)
        got = eng.generate(prompt, n)
        outs.append((ref, got))
    return outs


def test_oracle_tree_moves_the_accepted_kv_into_place(dynamic, monkeypatch):
    moves = []
    real = dynamic.compact_kv
    monkeypatch.setattr(dynamic, "compact_kv", lambda row, src, dst: (moves.append((src, dst)), real(row, src, dst)))
    for ref, got in _oracle_run(dynamic, PROMPTS[:3], 33, monkeypatch):
        assert got.token_ids == ref
        # every round accepts the full depth: 33 tokens = 1 (prefill) + 8 rounds x 4
        assert got.stats.mean_acceptance_length == pytest.approx(4.0) and got.target_passes == 1 + 8
    assert moves and all(src != dst for src, dst in moves)
    assert all(len(src) == 3 for src, _ in moves)  # nodes 2, 4, 6 -> p+1, p+2, p+3


def test_oracle_tree_without_the_move_goes_wrong(dynamic, monkeypatch):
    """Negative control: skipping the KV move leaves the decoys' KV at p+1..p+3, and the target's
    tokens change."""
    outs = _oracle_run(dynamic, PROMPTS[:3], 33, monkeypatch, compact=False)
    assert any(got.token_ids != ref for ref, got in outs)


@pytest.mark.slow  # (the default run serves chain@1 + none@2 over HTTP below)
def test_tree_at_batch_1_chain_at_batch_2_serves_concurrent_requests(tiny):
    import threading

    bundle = Bundle(tiny.bundle(recipe=MIXED).path)
    shapes = bundle.manifest.speculation
    assert shapes[1].kind == "dynamic" and shapes[2].describe() == "chain K 2"
    alone = {i: Engine(bundle).generate(p, 30).token_ids for i, p in enumerate(PROMPTS[:4])}
    eng = Engine(bundle)
    results, done = {}, threading.Event()
    from eagle3_runtime.engine import Request
    from eagle3_runtime.sampling import SamplingParams

    pending = len(alone)

    def finished(i):
        def cb(ev):
            nonlocal pending
            results.setdefault(i, []).extend(ev.token_ids)
            if ev.finish_reason:
                pending -= 1
                if not pending:
                    done.set()
        return cb

    for i, p in enumerate(PROMPTS[:4]):
        eng.submit(Request(list(p), 30, SamplingParams(temperature=0.0), on_event=finished(i)))
    with torch.inference_mode():
        while not done.is_set():
            eng.step()
    assert results == alone
    metrics = eng.metrics.render().decode()  # per-shape counters: both shapes ran
    for name in ("tree depth 3 topk 2 nodes 7", "chain K 2"):
        assert f'eagle3_spec_decode_shape_num_drafts_total{{shape="{name}"}}' in metrics, name


CHAIN_THEN_NONE = {"serving": {"max_num_seqs": 2}, "buckets": {"batch": [1, 2]},
                   "speculation": {"num_speculative_tokens": 3, "per_batch_bucket": {2: {"num_speculative_tokens": 0}}}}
TEXT_PROMPTS = ["The quick brown fox", "Explain why the sky is blue.", "def fibonacci(n):", "Once upon a time"]


def test_generate_many_batches_like_one_at_a_time(tiny):
    """Engine.generate_many (offline batching, two rows at a time, the rest queued): every request's tokens
    == its own generate(); rows move between the chain at batch 1 and plain decoding at batch 2."""
    bundle = Bundle(tiny.bundle(recipe=CHAIN_THEN_NONE).path)
    lengths = [24, 7, 16, 30, 11]  # rows finish at different steps
    alone = [Engine(bundle).generate(p, n).token_ids for p, n in zip(PROMPTS, lengths)]
    eng = Engine(bundle)
    passes = eng.target_passes
    gens = [eng.generate_many([p], n)[0] for p, n in zip(PROMPTS[:1], lengths[:1])]  # (warm, one request)
    assert gens[0].token_ids == alone[0] and gens[0].target_passes == eng.target_passes - passes
    many = eng.generate_many(PROMPTS, max(lengths))
    assert [g.token_ids[:n] for g, n in zip(many, lengths)] == alone
    assert [g.prompt_ids for g in many] == PROMPTS
    assert all(g.finish_reason in ("length", "stop") and g.seconds > 0 for g in many)
    with pytest.raises(ValueError, match="sampling parameters"):
        eng.generate_many(PROMPTS, 4, sampling=[None])


def test_the_serving_loop_runs_every_graph_in_inference_mode(tiny, monkeypatch):
    """run_forever (the server's engine thread) steps in inference mode as generate does: autograd's bookkeeping
    on a round's eager tensors cost the served speculative rounds ~2% (grad mode is on in a fresh thread)."""
    import threading

    from eagle3_runtime.engine import Request
    from eagle3_runtime.sampling import SamplingParams

    eng = Engine(Bundle(tiny.bundle(recipe=CHAIN_THEN_NONE).path))
    modes, run, done = [], eng._run, threading.Event()
    monkeypatch.setattr(eng, "_run", lambda *a, **kw: modes.append(torch.is_inference_mode_enabled()) or run(*a, **kw))
    tokens = []

    def on_event(ev):
        tokens.extend(ev.token_ids)
        if ev.finish_reason:
            done.set()

    loop = threading.Thread(target=eng.run_forever, daemon=True)
    loop.start()
    eng.submit(Request(list(PROMPTS[0]), 20, SamplingParams(temperature=0.0), on_event=on_event))
    assert done.wait(120)
    eng.shutdown()
    loop.join(10)
    assert tokens == Engine(eng.bundle).generate(PROMPTS[0], 20).token_ids
    assert modes and all(modes), f"{modes.count(False)} of {len(modes)} graph calls ran with grad mode on"


def test_chain_at_batch_1_none_at_batch_2_serves_4_concurrent_clients(tiny):
    """A real eagle3-serve on loopback: each client's tokens alone == with the others in flight (rows
    move between the chain at batch 1 and plain decoding at batch 2, and the draft catches up on the
    positions it missed before it drafts again)."""
    import threading

    from test_server import ServerProc, complete, stream_tokens

    built = tiny.bundle(recipe=CHAIN_THEN_NONE)
    m = Bundle(built.path).manifest
    assert m.speculation[1].describe() == "chain K 3" and m.speculation[2].kind == "none"
    assert {g.name for g in m.graphs if g.bucket == 2} == {"target_decode_b2"}
    server = ServerProc(built.path)
    try:
        solo = {p: complete(server.url, prompt=p, max_tokens=40)["choices"][0]["token_ids"] for p in TEXT_PROMPTS}
        out: dict = {}
        threads = [threading.Thread(target=stream_tokens, args=(server.url, p, 40, out, p)) for p in TEXT_PROMPTS]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert {p: out[p][0] for p in TEXT_PROMPTS} == solo
        import httpx

        metrics = httpx.get(server.url + "/metrics").text
        assert 'eagle3_step_latency_seconds_count{kind="decode"}' in metrics  # batch 2 ran plain
        assert 'eagle3_spec_decode_shape_num_drafts_total{shape="chain K 3"}' in metrics  # batch 1 speculated
    finally:
        server.stop()


def test_draft_catches_up_after_plain_rounds(tiny):
    """In-process: a row that decoded at batch 2 (no speculation) feeds the draft the positions it missed
    (draft_catchup over the gap) before it drafts again at batch 1, and keeps its tokens."""
    built = tiny.bundle(recipe=CHAIN_THEN_NONE)
    bundle = Bundle(built.path)
    alone = Engine(bundle).generate(PROMPTS[0], 60)
    from eagle3_runtime.engine import Request
    from eagle3_runtime.sampling import SamplingParams

    eng = Engine(bundle)
    got: dict[int, list[int]] = {}
    reqs = [Request(list(PROMPTS[0]), 60, SamplingParams(temperature=0.0),
                    on_event=lambda ev: got.setdefault(0, []).extend(ev.token_ids)),
            Request(list(PROMPTS[1]), 8, SamplingParams(temperature=0.0),
                    on_event=lambda ev: got.setdefault(1, []).extend(ev.token_ids))]
    catchups = []
    real = eng._catch_up_gaps
    eng._catch_up_gaps = lambda bsz: (catchups.append(bsz), real(bsz))
    for r in reqs:
        eng.submit(r)
    with torch.inference_mode():
        while eng.has_work():
            eng.step()
    assert got[0] == alone.token_ids and catchups  # the long row went back to batch 1 and caught up


def test_a_shape_that_disagrees_with_the_graphs_is_refused(tiny, tmp_path):
    """A manifest (digest recomputed) whose speculation shape does not match its graphs' inputs: one
    BundleError at load, not a shape error in the middle of a decode."""
    import json
    import shutil

    from eagle3_runtime.manifest import BundleError, digest_of

    b = tmp_path / "b"
    shutil.copytree(tiny.bundle(recipe=DYNAMIC).path, b)
    raw = json.loads((b / "manifest.json").read_text())
    raw["speculation"] = {"1": {"depth": 3, "topk": 2, "width": 2, "num_nodes": 6}}  # the graphs verify 7 nodes
    raw["digest"] = digest_of(raw)
    (b / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(BundleError, match=r"target_verify_b1: inputs \('tokens', \[1, 7\], 'int64'\) where .* takes "
                                          r"\('tokens', \[1, 6\]"):
        Bundle(b)
