"""The backend interface (`Backend`) and the SDK preflight.

A backend turns one exported graph (torch.export.ExportedProgram) into a graph file, or, when SPMD
(neuron), a whole model (every role, bucket and rank) into one artifact. `preflight` runs before
anything heavy (no torch import), so a missing SDK fails in well under a second.
"""
from __future__ import annotations

import abc
import importlib.metadata
import importlib.util
from pathlib import Path
from typing import ClassVar

from eagle3_runtime import manifest
from eagle3_runtime.manifest import BACKENDS

from ..errors import UserError

NEURON_SDK = {mod: pip for mod, (_, pip) in manifest.NEURON_SDK.items()}  # import name -> pip name
NEURON_INSTALL_HINT = (
    "install the Neuron SDK from the Neuron pip repository on a trn1/trn2/inf2 or compile host "
    f"(pip install --extra-index-url https://pip.repos.neuron.amazonaws.com {' '.join(NEURON_SDK.values())}, "
    "or `pip install eagle3-build[neuron]` with that index; PyPI only has placeholder packages by those names)")


def missing_neuron_sdk() -> list[str]:
    """The SDK packages that are absent, or are PyPI's "WRONG PACKAGE" placeholders (found, but importing
    them raises); read from the installed metadata, without importing anything."""
    return [dist for mod, dist in NEURON_SDK.items() if importlib.util.find_spec(mod) is None or _placeholder(dist)]


def _placeholder(dist: str) -> bool:
    try:
        meta = importlib.metadata.metadata(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return "WRONG PACKAGE" in f"{meta.get('Summary', '')} {meta.get_payload() or ''}"


def preflight(name: str) -> None:
    if name not in BACKENDS:
        raise UserError(f"backend {name!r}: choose one of {', '.join(BACKENDS)}")
    if name == "neuron":
        missing = missing_neuron_sdk()
        if missing:
            raise UserError(
                f"backend neuron needs the Neuron SDK and {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not installed (or only PyPI's placeholder): "
                f"{NEURON_INSTALL_HINT}. Without the SDK, "
                "`eagle3-build plan RECIPE --backend neuron` lists every NEFF with its exact compiler command")


def output_specs(module, example_args: tuple) -> list[tuple[list[int], object]]:
    """Shapes / torch dtypes of a graph's outputs, from a fake-tensor run (no real compute)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else tuple(mode.from_tensor(t) for t in a)
                for a in example_args]
        outs = module(*fake)
    return [(list(o.shape), o.dtype) for o in outs]


class Backend(abc.ABC):
    """What the build, the compile cache and the scheduler call on a backend."""

    NAME: ClassVar[str]
    SUFFIX: ClassVar[str] = ""  # graph file suffix (per-graph backends)
    JOB_MEMORY_GB: ClassVar[float]  # per parallel compile job, for --jobs and plan
    SPMD: ClassVar[bool] = False  # True: compile_model per model, not compile_exported per graph

    @abc.abstractmethod
    def version(self) -> str:
        """The compiler's version (enters every cache key)."""

    @abc.abstractmethod
    def key_fields(self, role: str) -> dict:
        """What enters a graph's compile-cache key besides the graph itself."""

    def toolchain(self) -> dict[str, str]:
        """Extra entries for the manifest's toolchain record."""
        return {}

    def prepare(self, cache_root: Path) -> None:
        """Once per build (and per compile worker) before the first compile."""

    def pack_format(self, dtype: str) -> str | None:
        """The eagle3_runtime.packing format decode-sized projections take their weights in (None: plain)."""
        return None

    def output_specs(self, module, example_args: tuple) -> list[tuple[list[int], object]]:
        return output_specs(module, example_args)

    def compile_exported(self, ep, out: Path, key: str, role: str) -> dict:
        """Compile one graph to `out`; returns the info recorded in the manifest's graph entry."""
        raise NotImplementedError(f"backend {self.NAME} compiles whole models (compile_model)")

    def compile_model(self, model_graphs, tp: int, out_dir: Path) -> dict:
        """SPMD: compile every role, bucket and rank of one model into one artifact under `out_dir`."""
        raise NotImplementedError(f"backend {self.NAME} compiles one graph at a time (compile_exported)")
