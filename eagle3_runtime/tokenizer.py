"""The bundle's tokenizer through the `tokenizers` library alone (the builder proved at build time
that it encodes exactly like the target's transformers tokenizer, special tokens included)."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


class BundleTokenizer:
    def __init__(self, bundle_root: Path):
        self.tok = Tokenizer.from_file(str(Path(bundle_root) / "tokenizer" / "tokenizer.json"))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL (encode does not), so a long prompt never stalls other threads
        return self.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)
