"""Small file-system rules shared by the stages."""
from __future__ import annotations

import os
import uuid
from pathlib import Path


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    tmp.write_text(text)
    os.replace(tmp, path)
