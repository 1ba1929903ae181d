"""The bundle directory: what a build may replace and how it replaces it.

Everything is written into a temporary sibling directory that is swapped into place only when complete,
so a failed build never leaves a half-written bundle and the old bundle stays until the new one is whole.
The destination must be new, empty or a bundle this tool wrote (`check_out`): a build never replaces
anything else. Temporary siblings carry their builder's pid (`.NAME.tmp-<owner>-*`, `.NAME.old-<owner>`);
a later build removes those of a killed one.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterable

from eagle3_runtime.manifest import MANIFEST

from .compile.cache import owner_tag, stale
from .errors import UserError
from .files import nearest_existing
from .recipe import PairRecipe

NAME_MAX = 255  # bytes in one file name (Linux filesystems)

def is_bundle(d: Path) -> bool:
    """A bundle this tool wrote: a directory whose manifest.json is a JSON object with the manifest's keys."""
    try:
        raw = json.loads((d / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and {"schema_version", "digest", "graphs", "files"} <= raw.keys()


def check_out(out: Path, pair: PairRecipe, keep: Iterable[tuple[str, Path]] = ()) -> None:
    """Refuse (UserError) a bundle directory this build must not replace, before any work: one that is
    or contains the current directory, the home directory, the pair's checkpoints or a (what, path) in
    `keep` (the recipe, the cache), and anything that exists but is neither an empty directory nor a bundle."""
    real = out.resolve()
    sources = [(f"the {role} checkpoint", Path(s.path)) for role, s in (("target", pair.target), ("draft", pair.draft))
               if s.path]
    guarded = [("the current directory", Path.cwd()), ("your home directory", Path(os.path.expanduser("~"))),
               *sources, *keep]
    for what, path in guarded:
        path = Path(path).resolve()
        if real == path or real in path.parents:
            raise UserError(f"bundle directory {out} is or contains {what} ({path}); a build replaces its bundle "
                            f"directory as a whole: choose a new one (e.g. --out artifacts/{pair.name})")
    parent = nearest_existing(out.parent)
    if parent is not None and not parent.is_dir():
        raise UserError(f"bundle directory {out}: {parent} is a file, not a directory; choose another --out path")
    if len(os.fsencode(f".{out.name}.tmp-{owner_tag()}-abcd1234")) > NAME_MAX:  # (its temporary sibling's name)
        raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG), str(out))
    check_replaceable(out)


def check_replaceable(out: Path) -> None:
    """Refuse (UserError) to replace anything at `out` but an empty directory or a bundle this tool wrote."""
    if out.is_symlink():
        raise UserError(f"bundle directory {out} is a symbolic link; give the directory it points to, "
                        "or remove the link yourself")
    if not out.exists():
        return
    if not out.is_dir():
        raise UserError(f"bundle directory {out} is an existing file; choose another --out path or remove "
                        "the file yourself")
    if any(out.iterdir()) and not is_bundle(out):
        raise UserError(f"bundle directory {out} exists and is not a bundle written by eagle3-build (no valid "
                        f"{MANIFEST}); nothing was touched: choose another --out path or remove it yourself")


def replace_staged(dest: Path, fill: Callable[[Path], None]) -> None:
    """Fill a new sibling of `dest` named after this builder (`.NAME.tmp-<owner>-*`), then swap it in
    (`replace_dir`); on any failure the sibling goes (after the swap: the old tree) and `dest` stays."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-{owner_tag()}-", dir=dest.parent))
    try:
        fill(tmp)
        replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_dir(tmp: Path, out: Path) -> None:
    """Put the finished bundle `tmp` at `out`. Every state in between has the old or the new bundle at
    `out` (an atomic swap), or, where the filesystem cannot swap, the old one at `.NAME.old-<owner>`
    for the instant between two renames (`clean_leftovers` puts it back if the build dies there)."""
    check_replaceable(out)  # (again: it may have changed during the build)
    try:
        _exchange(tmp, out)  # out: the new bundle; tmp: the old one, removed by the caller or a later build
    except FileNotFoundError:  # nothing at out
        os.rename(tmp, out)
        return
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
            raise
        old = out.with_name(f".{out.name}.old-{owner_tag()}")
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(old, out)  # the old bundle goes back
            raise
        tmp = old
    shutil.rmtree(tmp, ignore_errors=True)


def _exchange(a: Path, b: Path) -> None:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); OSError ENOSYS where unavailable."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a), None, str(b))


_LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)-(?P<host>[0-9a-f]{8})(?:-[a-z0-9_]+)?")

def clean_leftovers(parent: Path, before: float) -> None:
    """Remove what killed builds left next to their bundles in `parent` (see `stale`): `.NAME.tmp-*` (an
    unfinished bundle, or an old one after the swap) and `.NAME.old-*` (an old bundle between two
    renames: put back at NAME when nothing is there, else removed). Nothing else is touched."""
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for d in entries:
        m = _LEFTOVER.fullmatch(d.name)
        if m is None or d.is_symlink() or not d.is_dir() or not stale(d, int(m["pid"]), m["host"], before):
            continue
        if m["kind"] == "old" and not os.path.lexists(d.with_name(m["name"])):
            with contextlib.suppress(OSError):  # (another build may have put it back first)
                os.rename(d, d.with_name(m["name"]))
            continue
        shutil.rmtree(d, ignore_errors=True)
