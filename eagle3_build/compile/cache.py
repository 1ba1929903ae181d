"""Content-addressed compile cache.

A graph's key is a hash of what determines its compiled code and nothing incidental:

  * the exported graph's code and signature (op by op; weights are graph *inputs*, so their values
    never enter the key: a fine-tune or a renamed copy of a checkpoint reuses every graph),
  * every input/output shape and dtype, and the bytes of the constants baked into the graph
    (e.g. RoPE frequency tables, which follow the config),
  * the backend, its version, its compiler flags and the target device (for aoti: the CPU ISA the
    code is compiled for), the torch version and the cache format.

Layout under `$EAGLE3_BUILD_CACHE` (default `~/.cache/eagle3-build`):

  graphs/<k[:2]>/<key>/entry.json + graph file(s)   one directory per compiled graph
  traces/<trace key>.json                           trace memo: graph key + output specs of a graph
                                                    whose trace inputs (configs, layout, shapes, the
                                                    toolchain's own source) were seen before, so a warm
                                                    rebuild does not even re-export
  failures/<key>.json + <key>.log                   the last failed compile of a key (never skips a compile)
  tmp/<pid>-<host>-<uuid>/                          entries being written (named after their builder)
  CACHEDIR.TAG                                      the marker (Cache Directory Tagging standard, so backup
                                                    tools skip the cache too) naming eagle3-build

The marker is what makes a directory this tool's cache: it is written when the cache is created, or
first written into while empty; a non-empty directory without it is never adopted (but for the default
cache made before the marker existed, holding nothing but the cache's own directories), and `cache
clear` / `cache prune` remove nothing where it is missing. A cache never resolves to /, the home
directory (or a directory holding it), a bundle (manifest.json), or a directory holding the recipe or
the bundle being built (`check_place`).

Entries are written in `tmp/` and renamed into place (atomic on one filesystem, so several builders
can share one cache directory, e.g. NFS or a CI cache, and readers need no lock). A hit is
re-hashed before use; a corrupt entry (its files, or an entry.json that is not one) is dropped and
recompiled; `cache ls` lists it as corrupt and `cache prune` removes it. A build needs room on the cache's
filesystem for what it compiles: where there is none (a full disk, a quota) it stops with one line
naming the cache (`CacheError`) before the compiler writes there. A build, `cache prune` and `cache
clear` remove only the `tmp/` directories of builders that were killed (see `stale`), never those of a
build still running nor anything in `tmp/` this tool did not name.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import socket
import statistics
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from eagle3_runtime.manifest import MANIFEST, sha256_file

from ..errors import UserError
from ..files import atomic_write, nearest_existing, os_error_line

KEY_FORMAT = 1
ENTRY = "entry.json"
CONTENT = ("graphs", "traces", "failures", "host")  # what `cache clear` removes (tmp/: what builders are writing)
DOWNLOADS = ("wheels", "gguf")  # the demo target's downloads (demo.py), kept by `cache clear`
MARKER = "CACHEDIR.TAG"
SIGNATURE = "Signature: 8a477f597d28d172789f06886806bc55"  # the first line of every cache directory tag
MARKER_TEXT = (f"{SIGNATURE}\n# This file is a cache directory tag created by eagle3-build (its compile cache).\n"
               "# For information about cache directory tags, see https://bford.info/cachedir/\n")
_MARKER_TMP = re.compile(re.escape(f".{MARKER}.") + "[0-9a-f]{32}")  # atomic_write's temporary name
USE_ANOTHER = "point EAGLE3_BUILD_CACHE or --cache-dir at an empty or new directory"
MIN_FREE_BYTES = 64 << 20  # room a compile needs on the cache's filesystem, on top of the largest entry cached
FULL = (errno.ENOSPC, errno.EDQUOT)


class CacheError(UserError):
    """A compile cache directory this tool must not use, or cannot write; the message names the fix."""


def disk_free(path: Path) -> int | None:
    """Bytes free to this user on the filesystem of `path` (or of its nearest existing parent); None: unknown."""
    there = nearest_existing(Path(path))
    try:
        st = os.statvfs(there if there is not None else ".")
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


def default_cache_dir() -> Path:
    env = os.environ.get("EAGLE3_BUILD_CACHE")
    return Path(env).expanduser() if env else _default_root()


def _default_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")).expanduser() / "eagle3-build"


# ------------------------------------------------------------------ scratch directories

# Every temporary directory this tool makes carries its owner in its name, "<pid>-<host>", so that a later
# build can tell a killed build's leftovers from a running build's work. <host> is a short hash of where
# that pid means something: the host name, the machine id and the pid namespace (a container sharing the
# host's name and the cache has pids of its own).


def host_tag(hostname: str, machine_id: str, pid_namespace: str) -> str:
    return hashlib.sha256(f"{hostname}\0{machine_id}\0{pid_namespace}".encode()).hexdigest()[:8]


def _read(path: str, link: bool = False) -> str:
    try:
        return os.readlink(path) if link else Path(path).read_text().strip()
    except OSError:
        return ""


HOST = host_tag(socket.gethostname(), _read("/etc/machine-id"), _read("/proc/self/ns/pid", link=True))


def owner_tag() -> str:
    return f"{os.getpid()}-{HOST}"


def stale(path: Path, pid: int, host: str, before: float) -> bool:
    """Whether a scratch directory owned by (`pid`, `host`) is a dead build's: made on this host by a
    process that is gone, and last changed before `before` (the start of the build that asks). Another
    host's directories are never stale here (its pids mean nothing on this one)."""
    if host != HOST or pid == os.getpid() or not 0 < pid < 2**31:  # (no pid of ours is 0 or that large)
        return False
    try:
        if path.lstat().st_mtime >= before:
            return False
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # the process exists but is another user's, or the path is gone
        return False
    return False


_STAGING = re.compile(r"(?:drop-)?(?P<pid>\d+)-(?P<host>[0-9a-f]{8})-[0-9a-f]{32}")


# ------------------------------------------------------------------ keys

def graph_key(ep, backend_fields: dict) -> str:
    """Key of an ExportedProgram compiled by a backend described by `backend_fields`."""
    import torch

    h = hashlib.sha256()

    def put(tag: str, data: bytes | str) -> None:
        data = data.encode() if isinstance(data, str) else data
        h.update(f"{tag}:{len(data)}:".encode())
        h.update(data)

    put("format", str(KEY_FORMAT))
    put("torch", torch.__version__)
    put("backend", json.dumps(backend_fields, sort_keys=True))
    code = "\n".join(line for line in ep.graph_module.code.splitlines()
                     if line.strip() and not line.lstrip().startswith("#"))
    put("code", code)
    put("signature", str(ep.graph_signature))
    for node in ep.graph.nodes:  # shapes/dtypes of every input and output
        if node.op in ("placeholder", "output"):
            put("node", f"{node.op} {node.name} {_meta(node)}")
    for name, t in sorted({**ep.constants, **ep.state_dict}.items()):
        if isinstance(t, torch.Tensor):
            put("const", f"{name} {list(t.shape)} {t.dtype}")
            if not t.is_meta and t.numel():  # (parameters of the traced module are meta placeholders:
                put("bytes", t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())
                # the graph reads the weights from its inputs, so their values never matter)
    return h.hexdigest()


def trace_key(fields: dict) -> str:
    """Key of everything a graph's trace depends on: `fields` (spec, model configs, layouts, shapes,
    backend) plus the source of this toolchain and the torch version, so any code change re-traces."""
    import torch

    body = json.dumps({"fields": fields, "code": _code_hash(), "torch": torch.__version__}, sort_keys=True,
                      default=str)
    return hashlib.sha256(body.encode()).hexdigest()


_CODE_HASH: str | None = None


def _code_hash() -> str:
    global _CODE_HASH
    if _CODE_HASH is None:
        h = hashlib.sha256()
        pkg = Path(__file__).resolve().parent.parent  # eagle3_build/, its test helpers left out
        for p in sorted(q for q in pkg.rglob("*.py") if q.relative_to(pkg).parts[0] != "testing"):
            h.update(p.relative_to(pkg).as_posix().encode())
            h.update(p.read_bytes())
        _CODE_HASH = h.hexdigest()
    return _CODE_HASH


def _meta(node) -> str:
    val = node.meta.get("val")
    if val is None:
        return ""
    vals = val if isinstance(val, (list, tuple)) else [val]
    return ";".join(f"{list(v.shape)}/{v.dtype}" if hasattr(v, "shape") else repr(v) for v in vals)


# ------------------------------------------------------------------ store

def _intact(d: Path, meta: dict) -> bool:
    """Whether every file an entry lists is there with its size and sha256."""
    for name, f in meta["files"].items():
        p = d / name
        if not p.is_file() or p.stat().st_size != f["size"] or sha256_file(p) != f["sha256"]:
            return False
    return True


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _number(v, kind=(int, float)) -> bool:
    return isinstance(v, kind) and not isinstance(v, bool) and 0 <= v < float("inf")


def meta_problem(meta) -> str | None:
    """Why an entry.json's data is not an entry (None: it is one), as `put` writes it."""
    if not isinstance(meta, dict):
        return f"entry.json holds {type(meta).__name__ if meta is not None else 'null'}, not an object"
    files = meta.get("files")
    if not isinstance(files, dict) or not files:
        return "entry.json lists no files"
    for name, f in files.items():
        if not name or name in (".", "..", ENTRY) or "/" in name or "\\" in name or "\0" in name:
            return f"entry.json lists the file name {name!r}"
        if not (isinstance(f, dict) and isinstance(f.get("sha256"), str) and _SHA256.fullmatch(f["sha256"])
                and _number(f.get("size"), int)):
            return f"entry.json has no size and sha256 for {name!r}"
    if not isinstance(meta.get("info", {}), dict):
        return "entry.json's info is not an object"
    for k in ("graph", "backend", "role"):
        if not isinstance(meta.get(k, ""), str):
            return f"entry.json's {k} is not a string"
    if not _number(meta.get("compile_seconds", 0)) or not _number(meta.get("tokens", 0), int):
        return "entry.json's compile_seconds or tokens is not a number"
    return None


@dataclass
class Entry:
    key: str
    path: Path  # the entry directory
    meta: dict  # ({} where `problem` says why entry.json is not an entry)
    problem: str | None = None  # a corrupt entry: a miss, listed by `cache ls`, removed by `cache prune`

    @property
    def files(self) -> list[str]:
        return list(self.meta["files"])

    @property
    def compile_seconds(self) -> float:
        return float(self.meta.get("compile_seconds", 0.0))

    @property
    def size(self) -> int:
        if self.problem is None:
            return sum(int(f["size"]) for f in self.meta["files"].values())
        try:  # (what its directory holds)
            return sum(p.lstat().st_size for p in self.path.iterdir())
        except OSError:
            return 0


class CompileCache:
    def __init__(self, root: Path | str | None = None):
        self.root = Path(root) if root is not None else default_cache_dir()
        self._timings: list[tuple[str, str, float]] | None = None  # (backend, role, s / sqrt(tokens))
        self._open = False  # the root was checked and marked (`open`): once per cache object
        self._largest: int | None = None  # bytes of the largest entry (what a compile may need again)

    # ---- the directory: which one may be a cache (see the module docstring)
    def check_place(self, keep: Iterable[tuple[str, Path]] = ()) -> None:
        """Refuse (CacheError) a root that resolves to /, the home directory or a directory holding it, a
        bundle, or a directory holding a (what, path) of `keep` (the recipe, the bundle being built); or whose
        path runs through a file."""
        real = Path(os.path.realpath(self.root))
        name = f"compile cache {self.root}" + ("" if real == Path(os.path.abspath(self.root)) else f" (that is {real})")
        for what, path in [("the root directory", Path(real.anchor)), ("your home directory", Path.home()), *keep]:
            inside = Path(os.path.realpath(path))
            if real == inside or real in inside.parents:
                raise CacheError(f"{name} {'is' if real == inside else 'holds'} {what} ({inside}); `cache clear` "
                                 f"would empty it: {USE_ANOTHER}")
        if (real / MANIFEST).exists():
            raise CacheError(f"{name} is a bundle (it holds {MANIFEST}), not a compile cache; {USE_ANOTHER}")
        there = nearest_existing(self.root)
        if there is not None and not there.is_dir():
            raise CacheError(f"compile cache {self.root}: {there} is a file, not a directory; {USE_ANOTHER}")

    def is_marked(self) -> bool:
        """Whether the root holds this tool's cache directory tag."""
        try:
            with open(self.root / MARKER, encoding="utf-8", errors="replace") as f:
                head = f.read(4096)
        except OSError:
            return False
        return head.startswith(SIGNATURE + "\n") and "eagle3-build" in head

    def _state(self, keep: Iterable[tuple[str, Path]] = ()) -> str:
        """"absent" (nothing at the root), "empty" (an empty directory: marked on the first write) or "cache"
        (marked, or the default cache made before the marker: nothing in it but the cache's own names);
        CacheError for a place `check_place` refuses and for a directory with content but no marker."""
        self.check_place(keep)
        if not self.root.exists():
            return "absent"
        names = {p.name for p in self.root.iterdir()}
        names = {n for n in names if not _MARKER_TMP.fullmatch(n)}  # (another builder marking it right now)
        if self.is_marked() or (names and names <= {*CONTENT, *DOWNLOADS, "tmp"} and self.root == _default_root()):
            return "cache"  # (the marker is read after the listing: what a marking builder wrote follows it)
        if not names:
            return "empty"
        raise CacheError(f"compile cache {self.root} is not empty and is not an eagle3-build cache (no {MARKER} "
                         f"written by eagle3-build); nothing there was touched: {USE_ANOTHER}")

    def open(self, keep: Iterable[tuple[str, Path]] = (), *, removing: bool = False) -> CompileCache:
        """Make the root this tool's cache, ready to be written: created and marked when new or empty, refused
        (CacheError) as `_state` says or when a real write fails there. Every write goes through it. `removing`
        (`cache prune`, `cache clear`): a full disk is no reason to refuse, freeing it is the fix."""
        if not self._open:
            self._state(keep)
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                if not self.is_marked():
                    atomic_write(self.root / MARKER, MARKER_TEXT)
                self._new_staging().rmdir()  # a real write: permissions, a read-only mount, a full disk
            except OSError as e:
                if not (removing and e.errno in FULL and self.is_marked()):
                    raise self._unwritable(e) from e
            self._open = True
        return self

    def existing(self) -> bool:
        """Whether the root holds a cache to list or clean (False: nothing there, or an empty directory);
        CacheError as `_state` says, or when it cannot be written."""
        state = self._state()
        if state != "absent" and not os.access(self.root, os.W_OK | os.X_OK):  # (a read-only mount: root too)
            raise self._unwritable(OSError(errno.EACCES, "not writable (permissions, or a read-only filesystem)",
                                           str(self.root)))
        return state == "cache"

    def _unwritable(self, e: OSError) -> CacheError:
        if e.errno in FULL:
            return self._full(f"{os.fsdecode(e.filename) + ': ' if e.filename else ''}{e.strerror or e} "
                              f"({errno.errorcode.get(e.errno, e.errno)})")
        return CacheError(f"compile cache {self.root} cannot be written: {os_error_line(e)}")

    def _full(self, detail: str) -> CacheError:
        return CacheError(f"compile cache {self.root} is full ({detail}); free space on its filesystem (`eagle3-build "
                          "cache prune --max-size GB` drops the least recently used graphs), or point "
                          "EAGLE3_BUILD_CACHE or --cache-dir at a directory on a filesystem with room")

    def check_room(self) -> None:
        """Refuse (CacheError) to compile into a cache whose filesystem has no room for the result: the
        compilers' writers fail on a full disk in ways that are not an OSError (torch aborts the process)."""
        if self._largest is None:
            self._largest = max((e.size for e in self.entries() if e.problem is None), default=0)
        need, free = MIN_FREE_BYTES + self._largest, disk_free(self.root)
        if free is not None and free < need:
            raise self._full(f"{free / 1e6:.1f} MB free on its filesystem, a compile needs about {need / 1e6:.0f} MB")

    def _dir(self, key: str) -> Path:
        return self.root / "graphs" / key[:2] / key

    # ---- read
    def get(self, key: str, *, check: bool = True) -> Entry | None:
        d = self._dir(key)
        try:
            meta = _read_json(d / ENTRY)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (OSError, ValueError):
            meta = None
        if meta_problem(meta) is not None:  # unreadable, truncated, or not an entry: a miss, compiled again
            self._drop(d)
            return None
        try:
            if check and not _intact(d, meta):
                self._drop(d)  # corrupt or partially deleted: recompile
                return None
        except (FileNotFoundError, NotADirectoryError):  # removed meanwhile (a concurrent prune): a miss
            return None
        return Entry(key, d, meta)

    def entries(self) -> list[Entry]:
        """Every entry, a corrupt one (entry.json unreadable or not an entry) with its `problem`."""
        out = []
        for p in sorted((self.root / "graphs").glob("*/*/" + ENTRY)):
            try:
                meta = _read_json(p)
            except FileNotFoundError:  # (removed meanwhile)
                continue
            except (OSError, ValueError) as e:
                out.append(Entry(p.parent.name, p.parent, {}, f"entry.json is unreadable ({_why(e)})"))
                continue
            problem = meta_problem(meta)
            out.append(Entry(p.parent.name, p.parent, {} if problem else meta, problem))
        return out

    def estimate(self, backend: str, role: str, tokens: int) -> float | None:
        """Learned compile time: the median of cached compiles of the same backend and role, scaled
        by tokens per call (None when nothing comparable was ever compiled)."""
        if self._timings is None:  # read the entries once per cache object (one build), not per graph
            self._timings = []
            for e in self.entries():
                if e.problem is None:
                    self._note_timing(e.meta)
        per_token = [t for b, r, t in self._timings if b == backend and r == role]
        if not per_token:
            return None
        return statistics.median(per_token) * max(1, tokens) ** 0.5

    def _note_timing(self, meta: dict) -> None:
        if self._timings is not None and meta.get("role"):
            self._timings.append((meta.get("backend"), meta["role"],
                                  float(meta.get("compile_seconds", 0.0)) / max(1, int(meta.get("tokens", 1))) ** 0.5))

    # ---- write
    def staging_dir(self) -> Path:
        """A new directory to compile into (CacheError where the cache's filesystem has no room)."""
        self.open().check_room()
        try:
            return self._new_staging()
        except OSError as e:
            raise self._unwritable(e) from e

    def _new_staging(self) -> Path:
        d = self.root / "tmp" / f"{owner_tag()}-{uuid.uuid4().hex}"
        d.mkdir(parents=True)
        return d

    def clean_tmp(self, before: float) -> None:
        """Remove the `tmp/` directories of builders that died (killed mid-compile), see `stale`."""
        if not self.is_marked():  # (not this tool's cache, or not yet: nothing to clean)
            return
        try:
            entries = list((self.root / "tmp").iterdir())
        except OSError:
            return
        for d in entries:
            m = _STAGING.fullmatch(d.name)
            if m and d.is_dir() and not d.is_symlink() and stale(d, int(m["pid"]), m["host"], before):
                shutil.rmtree(d, ignore_errors=True)

    def put(self, key: str, staged: Path, meta: dict) -> Entry:
        """Move a directory of compiled files into the cache (atomically; the first writer wins)."""
        files = {p.name: {"sha256": sha256_file(p), "size": p.stat().st_size}
                 for p in sorted(staged.iterdir()) if p.is_file()}
        meta = {**meta, "key": key, "files": files, "created": time.time()}
        try:
            (staged / ENTRY).write_text(json.dumps(meta, indent=2, sort_keys=True))
        except OSError as e:
            raise self._unwritable(e) from e
        final = self._dir(key)
        try:
            for attempt in (0, 1):  # (a concurrent `cache clear` may remove graphs/<k[:2]>/ in between)
                final.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.rename(staged, final)
                    break
                except FileNotFoundError:
                    if attempt or not staged.is_dir():
                        raise
        except OSError:  # another builder stored the same key meanwhile: keep theirs
            shutil.rmtree(staged, ignore_errors=True)
            existing = self.get(key)
            if existing is None:
                raise
            return existing
        self.clear_failure(key)
        self._note_timing(meta)
        if self._largest is not None:
            self._largest = max(self._largest, sum(f["size"] for f in files.values()))
        return Entry(key, final, meta)

    # ---- trace memo
    def get_trace(self, trace_key: str) -> dict | None:
        try:
            memo = _read_json(self.root / "traces" / f"{trace_key}.json")
        except (OSError, ValueError):
            return None
        ok = isinstance(memo, dict) and isinstance(memo.get("key"), str) and _SHA256.fullmatch(memo["key"])
        return memo if ok else None  # (anything else: a miss, traced again and rewritten)

    def put_trace(self, trace_key: str, record: dict) -> None:
        self._write(self.root / "traces" / f"{trace_key}.json", json.dumps(record, sort_keys=True))

    def _write(self, path: Path, text: str) -> None:
        """Write a memo or failure record in the cache (again, when a concurrent `cache clear` removed its
        directory in between)."""
        self.open()
        try:
            for attempt in (0, 1):
                path.parent.mkdir(parents=True, exist_ok=True)
                try:
                    return atomic_write(path, text)
                except FileNotFoundError:
                    if attempt:
                        raise
        except OSError as e:  # (a full disk: the cache named, with the fix)
            raise self._unwritable(e) from e

    # ---- failures (recorded with their log; never used to skip a compile)
    def record_failure(self, key: str, meta: dict, log: str) -> Path:
        self.check_room()  # (a compile that failed where the cache has no room failed for that: the cache named)
        log_path = self.root / "failures" / f"{key}.log"
        self._write(log_path, log)
        self._write(log_path.with_suffix(".json"), json.dumps({**meta, "key": key, "time": time.time()}, indent=2))
        return log_path

    def failure(self, key: str) -> dict | None:
        try:
            record = _read_json(self.root / "failures" / f"{key}.json")
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def failures(self) -> list[dict]:
        """The failure records (each with its "key" and "log" path); records that are not one are left out."""
        out = []
        for p in sorted((self.root / "failures").glob("*.json")) if (self.root / "failures").is_dir() else []:
            record = self.failure(p.stem)
            if record is not None:
                out.append({**record, "key": p.stem, "log": str(p.with_suffix(".log"))})
        return out

    def clear_failure(self, key: str) -> None:
        for suffix in (".json", ".log"):
            (self.root / "failures" / f"{key}{suffix}").unlink(missing_ok=True)

    # ---- maintenance
    def _drop(self, d: Path) -> None:
        trash = self.open().root / "tmp" / f"drop-{owner_tag()}-{uuid.uuid4().hex}"
        try:
            trash.parent.mkdir(parents=True, exist_ok=True)
            os.rename(d, trash)
        except OSError as e:
            if e.errno in FULL:  # (no room for the rename on a full disk: removed where it is)
                shutil.rmtree(d, ignore_errors=True)
            return
        shutil.rmtree(trash, ignore_errors=True)

    def prune(self, *, older_than_days: float | None = None, max_bytes: int | None = None) -> list[Entry]:
        """Drop entries not used for `older_than_days`, then the least recently used ones until the
        cache fits in `max_bytes`. Returns what was removed (nothing where `existing` finds no cache)."""
        self._timings = None
        if not self.existing():
            return []
        self.open(removing=True)
        entries = sorted(self.entries(), key=lambda e: self.last_used(e))
        removed = [e for e in entries if e.problem is not None]  # corrupt: never a hit, always removed
        for e in removed:
            self._drop(e.path)
            entries.remove(e)
        now = time.time()
        if older_than_days is not None:
            for e in list(entries):
                if now - self.last_used(e) > older_than_days * 86400:
                    self._drop(e.path)
                    removed.append(e)
                    entries.remove(e)
        if max_bytes is not None:
            total = sum(e.size for e in entries)
            for e in list(entries):
                if total <= max_bytes:
                    break
                self._drop(e.path)
                removed.append(e)
                total -= e.size
        self.clean_tmp(time.time())  # (a running build's staging directories stay)
        return removed

    def touch(self, entry: Entry) -> None:
        try:
            os.utime(entry.path / ENTRY)
        except OSError:
            pass

    @staticmethod
    def last_used(entry: Entry) -> float:
        try:
            return (entry.path / ENTRY).stat().st_mtime
        except OSError:
            return 0.0

    def clear(self) -> int:
        """Remove every entry, trace memo and failure record; of `tmp/`, only what `clean_tmp` removes
        (another build's staging directories stay: it is still writing into them). Removes nothing where
        `existing` finds no cache."""
        self._timings = None
        if not self.existing():
            return 0
        self.open(removing=True)
        n = len(self.entries())
        for sub in CONTENT:
            shutil.rmtree(self.root / sub, ignore_errors=True)
        self.clean_tmp(time.time())
        try:
            (self.root / "tmp").rmdir()  # (only when empty)
        except OSError:
            pass
        return n


def _read_json(path: Path):
    """The JSON in `path` (ValueError: not JSON, or nested too deep to read)."""
    try:
        return json.loads(path.read_bytes())
    except RecursionError as e:
        raise ValueError("nested too deep") from e


def _why(e: Exception) -> str:
    return e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__


FETCH_TRIES = 3  # a cache entry removed (`cache prune`, `cache clear`) before its copy is fetched again


def vanishing(cache: CompileCache, names: list[str]) -> UserError:
    return UserError(f"compile cache {cache.root}: the entries of {', '.join(names)} were removed {FETCH_TRIES} "
                     "times while this build copied them; stop the `cache prune` / `cache clear` running on that "
                     "cache and build again")
