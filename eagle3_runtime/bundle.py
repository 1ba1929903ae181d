"""Load and validate a bundle: manifest as data, digest, pins, paths confined, every file's sha256 and
what each file says it holds, then the bundle's backend (backends/) loads its graphs bound to their
weights and KV caches. The engine calls the bundle; the bundle calls its backend."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from .backends.base import DTYPES, Graph, GraphRunner, RuntimeBackend, call_by_name  # noqa: F401 (re-exported)
from .backends.registry import backend_for
from .errors import Eagle3Error
from .manifest import BundleError, Manifest
from .reader import bundle_file, check_file, check_weight_header, read_manifest
from .signature import check_signature
from .trust import Pins


def _other_ranks(manifest: Manifest, rank: int | None) -> set[str]:
    if rank is None:
        return set()
    return {f.path for m in manifest.models.values() for r, f in enumerate(m.weight_files) if r != rank}


def verify_files(root: Path, manifest: Manifest, rank: int | None = None) -> None:
    """Every file (of one rank's weights only, when `rank` is given) against the manifest: present, its
    sha256, graph files holding nothing but a graph (the backend's check_graph_file); then check_contents."""
    backend = backend_for(manifest)
    others = _other_ranks(manifest, rank)
    graphs = {g.file.path for g in manifest.graphs}
    for entry in manifest.all_files():
        if entry.path in others:
            continue
        path = check_file(root, entry)
        if entry.path in graphs:
            backend.check_graph_file(path.read_bytes(), f"{root}/{entry.path}")
    check_contents(root, manifest, rank)


def check_contents(root: Path, manifest: Manifest, rank: int | None = None) -> None:
    """What the files say they are against what the manifest says: every graph file's own signature
    (signature.py, read by the backend) and every weight file's header, read as data."""
    backend = backend_for(manifest)
    for g in manifest.graphs:
        path = bundle_file(root, g.file.path)
        sig = backend.read_signature(path)
        if sig is not None:
            check_signature(manifest, g, sig, path)
    if not backend.checks_weight_headers():
        return
    others = _other_ranks(manifest, rank)
    for name, model in manifest.models.items():
        for r, f in enumerate(model.weight_files):
            if f.path not in others:
                check_weight_header(bundle_file(root, f.path), model.tensors, f"models.{name}.weight_files[{r}]")


def check_memory(root: Path, m: Manifest) -> None:
    """KV caches held in host memory must fit in it."""
    if not backend_for(m).state_on_host:
        return
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if m.state_bytes() > memory:
        raise BundleError(f"{root}: the KV caches need {m.state_bytes() / 2**30:.1f} GiB, more than this host's "
                          f"{memory / 2**30:.1f} GiB; rebuild with a smaller max_model_len / max_num_seqs")


class Bundle:
    """A validated bundle, its backend loaded (this process's rank, or every rank where one process drives
    them all). `backend` is what runs the graphs; tensor parallelism replaces it with a wrapper (tp.py)."""

    text: tuple | None = None  # (BundleTokenizer, ChatTemplate | None) when opened to serve (tp.open_bundle)

    def __init__(self, root: str | Path, *, rank: int = 0, verify: bool = True, pins: Pins = Pins()):
        self.root = Path(root)
        if not self.root.is_dir():
            raise BundleError(f"{self.root}: no such bundle directory")
        self.manifest = m = read_manifest(self.root, pins)
        if not 0 <= rank < m.tp_degree:
            raise BundleError(f"{self.root}: rank {rank} outside this bundle's tp_degree {m.tp_degree}")
        cls = backend_for(m)
        check_memory(self.root, m)
        held = cls.ranks_held(rank)
        if verify:
            verify_files(self.root, m, held)
        else:  # (a remote bundle: every file's sha256 was verified when it was fetched)
            check_contents(self.root, m, held)
        self.rank = rank
        try:
            self.loaded: RuntimeBackend = cls(self.root, m, rank)
        except Eagle3Error:
            raise
        except Exception as e:  # whatever a loader raises on a file it cannot take: one line, the cause kept
            raise BundleError(f"{self.root}: cannot load this bundle ({type(e).__name__}: {e}); rebuild it with "
                              "this runtime's eagle3-build") from e
        self.backend: GraphRunner = self.loaded

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """This rank's weights as host tensors, "model/tensor" (empty where they live on a device)."""
        return self.loaded.weights

    @property
    def timings(self) -> dict[str, float]:
        """Graph name -> seconds of its first call on this host (warm_up)."""
        return self.backend.timings

    @property
    def costs(self) -> dict[str, float]:
        """Graph name -> seconds per call once warm, the decode loop's graphs (warm_up)."""
        return self.backend.costs

    @property
    def seconds(self) -> dict[str, float]:
        """Graph name -> seconds per call on this host: `costs` where warm calls were timed, else `timings`."""
        return {**self.timings, **self.costs}

    @property
    def thread_ratio(self) -> float | None:
        """One thread's decode time over all threads' on this host (warm_up; None before it or with one thread)."""
        return getattr(self.backend, "thread_ratio", None)

    def warm_up(self) -> dict[str, float]:
        return self.backend.warm_up()

    def graph(self, role: str, bucket: int, shape=None, slots: int | None = None):
        return self.backend.graph(role, bucket, shape, slots)

    def copy_kv_row(self, src: int, dst: int) -> None:
        self.backend.copy_kv_row(src, dst)

    def compact_kv(self, row: int, src: list[int], dst: list[int]) -> None:
        self.backend.compact_kv(row, src, dst)
