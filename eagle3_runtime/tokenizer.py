"""The bundle's tokenizer through the `tokenizers` library alone (the builder proved at build time
that it encodes exactly like the target's transformers tokenizer, special tokens included)."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from .manifest import BundleError


class BundleTokenizer:
    def __init__(self, bundle_root: Path):
        path = Path(bundle_root) / "tokenizer" / "tokenizer.json"
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises its own Exception on any malformed file
            raise BundleError(f"{path}: not a tokenizer the `tokenizers` library can load ({e}); rebuild the "
                              "bundle") from e

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL (encode does not), so a long prompt never stalls other threads
        return self.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def stream(self, stop: tuple[str, ...] = ()) -> "TextStream":
        return TextStream(self, stop)


class TextStream:
    """The text of one generation, token by token, in constant amortised work per token (vLLM's incremental
    detokenization): tokenizers' DecodeStream decodes each new token against a short window of the previous
    ones and holds an incomplete UTF-8 character back; stop strings are searched only in the text not yet
    sent, which holds the last len(longest stop) - 1 characters back (a match ends in new text, so it starts
    there); once the generation ends, the full decode (once) supplies what DecodeStream still held (a
    trailing partial character, decoded as U+FFFD as `decode` does), so the text sent adds up to
    decode(all ids) cut at the first stop string."""

    def __init__(self, tok: BundleTokenizer, stop: tuple[str, ...] = ()):
        self.tok, self.stop = tok, tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self._stream = DecodeStream(skip_special_tokens=True)
        self._sent: list[str] = []
        self._sent_chars = 0
        self.pending = ""  # decoded, not sent yet

    def add(self, ids: list[int], finished_ids: list[int] | None = None) -> tuple[str, bool]:
        """Decode the new token `ids` -> (text to send now, whether a stop string ended the text). Pass
        `finished_ids` (every generated id) with the last call: everything left is sent."""
        for t in ids:
            chunk = self._stream.step(self.tok.tok, t)
            if chunk:
                self.pending += chunk
        if finished_ids is not None:
            full = self.tok.decode(finished_ids)
            self.pending += full[self._sent_chars + len(self.pending):]
        hit = min((i for i in (self.pending.find(s) for s in self.stop) if i >= 0), default=-1)
        if hit >= 0:
            self.pending = self.pending[:hit]
        done = finished_ids is not None or hit >= 0
        keep = 0 if done else min(self.hold, len(self.pending))
        delta, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        self._sent.append(delta)
        self._sent_chars += len(delta)
        return delta, hit >= 0

    @property
    def text(self) -> str:
        """All of the text so far (sent and held)."""
        return "".join(self._sent) + self.pending


def load_text(bundle_root: Path):
    """(tokenizer, chat template or None) of a bundle, both checked: the template compiled and probed in a
    render worker (chat.py). Raises BundleError."""
    from .chat import ChatTemplate

    return BundleTokenizer(bundle_root), ChatTemplate.from_bundle(bundle_root)
