"""Backend `export`: torch.export archives, read as data (safe_pt2.py: nothing unpickled) and run by
torch's interpreter on any host torch runs on."""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from ..manifest import BundleError, GraphEntry, Manifest
from ..signature import Signature, read_zip_signature, export_signature
from ..torch_internals import fast_export_load
from .base import Check, GraphFn
from .facts import ExportFacts
from .host import HostBackend


class ExportBackend(ExportFacts, HostBackend):
    graph_kind = "a torch.export archive (models/model.json)"

    @classmethod
    def host_checks(cls, m: Manifest, environ) -> list[Check]:
        return [Check("backend", True, f"export graphs, built with torch {m.toolchain.get('torch')}, running "
                                       f"{torch.__version__}")]

    @classmethod
    def read_signature(cls, path: Path) -> Signature | None:
        return read_zip_signature(path, export_signature, cls.name, cls.graph_kind)

    @classmethod
    def check_graph_file(cls, data: bytes, name: str) -> None:
        from ..safe_pt2 import UnsafeArchive, check_archive

        try:
            check_archive(data, name)
        except UnsafeArchive as e:
            raise BundleError(f"{e}; refusing to load it") from e

    def load_graph(self, path: Path, entry: GraphEntry, weights: tuple[torch.Tensor, ...]) -> GraphFn:
        """Read once, check those bytes (sha256, archive contents), deserialize those same bytes."""
        from ..safe_pt2 import UnsafeArchive, load_exported

        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != entry.file.sha256:
            raise BundleError(f"{path}: does not match its sha256 in the manifest; rebuild or re-download the bundle")
        try:
            with fast_export_load():
                ep = load_exported(data, str(path))
        except UnsafeArchive as e:
            raise BundleError(f"{e}; refusing to load it") from e
        except Exception as e:  # torch's deserializer on a well-formed but broken program
            raise BundleError(f"{path}: cannot load this export graph ({type(e).__name__}: {e}); rebuild the "
                              "bundle") from e
        return ep.module()
