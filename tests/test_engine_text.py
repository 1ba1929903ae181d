"""The engine's text path: streamed deltas add up to the tokenizer's decode of the whole generation (cut at
the first stop string, never streaming a stop string's beginning), and a long generation costs linear
detokenization work (the engine once re-decoded everything after every token: quadratic)."""
import random
import types

import pytest

from eagle3_runtime.engine import Engine, Event, Request, Sequence, SpecStats
from eagle3_runtime.reader import read_manifest
from eagle3_runtime.tokenizer import BundleTokenizer


class CountingTokenizer(BundleTokenizer):
    """Counts the token ids every full decode goes through."""

    decoded = 0

    def decode(self, ids):
        self.decoded += len(ids)
        return super().decode(ids)


@pytest.fixture(scope="module")
def text_engine(built_bundle):
    """An Engine over the session bundle's manifest alone (no graph runs here), max_model_len lifted."""
    path = built_bundle().path
    tok = CountingTokenizer(path)
    engine = Engine(types.SimpleNamespace(manifest=read_manifest(path), timings={}, seconds={}), tokenizer=tok)
    engine.max_len = 1 << 20
    return engine, tok


def stream(engine, ids: list[int], stop=(), chunks=1, max_tokens=None) -> tuple[list[Event], Sequence]:
    """Emit `ids` through the engine `chunks` tokens at a time (a speculative round emits several)."""
    events: list[Event] = []
    req = Request([1], max_tokens or len(ids), stop=tuple(stop), on_event=events.append)
    seq = Sequence(req, [1], 1, 0, None, SpecStats(1))
    i = 0
    while seq.finish_reason is None and i < len(ids):
        engine._emit(seq, ids[i:i + chunks])
        i += chunks
    return events, seq


def test_900_tokens_cost_linear_detokenization(text_engine):
    engine, tok = text_engine
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 100)[:900]
    assert len(ids) == 900
    tok.decoded = 0
    events, seq = stream(engine, ids)
    assert seq.finish_reason == "length" and events[-1].finish_reason == "length"
    assert "".join(e.text for e in events) == tok.decode(ids)
    assert tok.decoded <= 2 * 2 * len(ids), tok.decoded  # (the check above decodes once more; quadratic: ~405,000)


@pytest.mark.parametrize("seed", range(6))
def test_streamed_text_is_the_decode_cut_at_the_first_stop(text_engine, seed):
    """Random ids (broken UTF-8 pieces included), random chunking, stop strings taken from the text."""
    engine, tok = text_engine
    rng = random.Random(seed)
    vocab = engine.bundle.manifest.vocab_size
    ids = [t for t in (rng.randrange(vocab) for _ in range(rng.randrange(20, 120))) if t not in engine.eos]
    full = tok.decode(ids)
    stops = ()
    if seed % 2 and len(full) > 10:
        at = rng.randrange(len(full) - 4)
        stops = (full[at:at + rng.randrange(2, 5)], "no such stop")
    events, seq = stream(engine, ids, stop=stops, chunks=rng.randrange(1, 5))
    sent = "".join(e.text for e in events)
    cut = min((i for i in (full.find(s) for s in stops) if i >= 0), default=len(full))
    assert sent == full[:cut] and seq.text_stream.text == sent
    assert seq.finish_reason == ("stop" if cut < len(full) else "length")
    for s in stops:  # no delta ever started a stop string that the text did not end with
        assert s not in sent
