"""The bundle's tokenizer through the `tokenizers` library alone (the builder proved at build time
that it encodes exactly like the target's transformers tokenizer, special tokens included)."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

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


def load_text(bundle_root: Path):
    """(tokenizer, chat template or None) of a bundle, both checked: the template compiled and probed in a
    render worker (chat.py). Raises BundleError."""
    from .chat import ChatTemplate

    return BundleTokenizer(bundle_root), ChatTemplate.from_bundle(bundle_root)
