"""Small file-system rules shared by the stages, and the one line an OSError becomes on the command line."""
from __future__ import annotations

import errno
import io
import os
import uuid
from pathlib import Path
from typing import Callable


def atomic_write(path: Path, text: str) -> None:
    """`text` in `path`, whole or not at all: written beside it, renamed into place; the temporary file is
    removed when the write fails (a full disk)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise


def save_through_python(save: Callable[[io.BytesIO], object], path: Path) -> None:
    """`save` serialises into memory, then Python writes the bytes: torch's C++ file writer aborts the whole
    process when the disk fills (its destructor throws after ENOSPC), Python's write raises OSError."""
    buf = io.BytesIO()
    save(buf)
    Path(path).write_bytes(buf.getbuffer())


_ELSEWHERE = "or write somewhere else (--out, EAGLE3_BUILD_CACHE / --cache-dir)"
_DENIED = f"fix the permissions there, {_ELSEWHERE}"
ERRNO_FIX = {  # what to do about the errors a build meets writing its bundle and the compile cache
    errno.ENOSPC: f"free space on that filesystem, {_ELSEWHERE}",
    errno.EDQUOT: f"free space within your disk quota, {_ELSEWHERE}",
    errno.EFBIG: f"a file outgrew the file size limit (`ulimit -f`) or the filesystem's largest file: raise the "
                 f"limit, {_ELSEWHERE}",
    errno.ENAMETOOLONG: "a name in that path is longer than the filesystem allows (usually 255 bytes): choose a "
                        "shorter path or name",
    errno.EROFS: f"the filesystem is mounted read-only: {_ELSEWHERE.removeprefix('or ')}",
    errno.EACCES: _DENIED,
    errno.EPERM: _DENIED,
    errno.ENOTDIR: "a part of that path is a file, not a directory: choose another path",
    errno.EISDIR: "that path is a directory where a file is expected: choose another path",
    errno.ELOOP: "that path loops through symbolic links: choose another path",
    errno.EMFILE: "too many open files: raise the limit (`ulimit -n`) and run the command again",
    errno.ENOMEM: "the host ran out of memory: free some (or use fewer --jobs) and run the command again",
}


def os_error_line(e: OSError) -> str:
    """One line for an OSError: the path(s), the error and its errno name, and what to do."""
    paths = [str(os.fsdecode(p)) for p in (e.filename, e.filename2) if p is not None]
    where = f"{' -> '.join(paths)}: " if paths else ""
    name = errno.errorcode.get(e.errno or 0, "")
    what = f"{e.strerror or e} ({name})" if name else str(e.strerror or e)
    return f"{where}{what}; {ERRNO_FIX.get(e.errno, 'check that path and run the command again')}"


def nearest_existing(path: Path) -> Path | None:
    """`path` if it exists, else its nearest existing ancestor (links followed; None: none exists)."""
    return next((p for p in (path, *path.parents) if p.exists()), None)


def default_dir_mode() -> int:
    """The mode a plain mkdir gives a new directory here (0777 less the umask)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o777 & ~mask
