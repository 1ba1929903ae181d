"""The target's tokenizer, exported for the runtime (plain `tokenizers`, no transformers) and proven to
encode like transformers does."""
from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from .load import TargetCheckpoint

def export_tokenizer(t: TargetCheckpoint, out: Path) -> list[Path]:
    """Save the target's tokenizer as transformers configures it, and prove the runtime's plain
    `tokenizers` load encodes exactly like it (special tokens included)."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    src = t.source
    try:
        if src.gguf_file:
            tok = AutoTokenizer.from_pretrained(src.directory, gguf_file=src.gguf_file)
        else:
            tok = AutoTokenizer.from_pretrained(src.directory)
    except Exception as e:
        raise UserError(f"target {src.spec.uri}: cannot load its tokenizer with transformers: {e}") from e
    if not getattr(tok, "is_fast", False):
        raise UserError(f"target {src.spec.uri}: only a slow tokenizer is available; the runtime needs "
                        "tokenizer.json (a fast tokenizer)")
    out.mkdir(parents=True)
    tok.save_pretrained(out)
    plain = Tokenizer.from_file(str(out / "tokenizer.json"))
    for s in TOKENIZER_PROBES:
        if plain.encode(s).ids != tok(s)["input_ids"]:
            raise UserError(f"target {src.spec.uri}: tokenizer.json encodes {s!r} differently from transformers; "
                            "the runtime could not reproduce the target's tokenization")
    return sorted(p for p in out.rglob("*") if p.is_file())


TOKENIZER_PROBES = ["Hello, world!", "  The quick brown fox\njumps over 12345 lazy dogs.", "ünïcödé ✓ 中文"]
