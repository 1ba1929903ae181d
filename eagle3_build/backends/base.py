"""The backend interface (`Backend`) and the SDK preflight.

A backend owns its whole path from the pair's models to its part of the bundle (`write_graphs`: graph
files, weight files, their manifest entries): the per-graph backends (per_graph.py: export, aoti) compile
one torch.export graph per (role, bucket); neuron compiles each model whole (neuron/). `plan` asks the
backend class what it would build, SDK or not. `preflight` runs before anything heavy (no torch import),
so a missing SDK fails in well under a second.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from eagle3_runtime import neuron_sdk
from eagle3_runtime.manifest import BACKENDS

from ..errors import UserError
from .neuron.releases import NEWEST, OLDEST, install_hint

NEURON_SDK = {mod: pip for mod, (_, pip) in neuron_sdk.NEURON_SDK.items()}  # import name -> pip name
NEURON_INSTALL_HINT = (
    "install the Neuron SDK from the Neuron pip repository on a trn1/trn2/inf2 or compile host, one release's "
    f"stack whole: {install_hint(NEWEST)} (an extra per release {OLDEST} to {NEWEST}, "
    "eagle3_build/backends/neuron/release_table.py; PyPI only has placeholder packages by those names)")


def missing_neuron_sdk() -> list[str]:
    """The SDK packages that are absent, or are PyPI's "WRONG PACKAGE" placeholders (found, but importing
    them raises); read from the installed metadata, without importing anything."""
    return neuron_sdk.missing()


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


@dataclass
class Written:
    """A backend's part of a bundle: graph entries, model entries (weights), other files, build record."""

    graphs: list
    models: dict
    files: list[Path]
    build: dict


class Backend(abc.ABC):
    """What the build, `plan`, the compile cache and the scheduler call on a backend."""

    NAME: ClassVar[str]
    SUFFIX: ClassVar[str] = ""  # graph file suffix
    JOB_MEMORY_GB: ClassVar[float]  # per parallel compile job, for --jobs and plan
    MAX_JOBS: ClassVar[int | None] = None  # parallel compile jobs worth running at most
    ESTIMATE_S: ClassVar[float] = 60.0  # compile seconds of a decode-sized graph (static_estimate)

    @abc.abstractmethod
    def write_graphs(self, bm, root: Path, cache, jobs: int | None, report, require_cached: bool) -> Written:
        """Compile (or fetch from `cache`) the pair's graphs (`bm`: pair.BuildModels) and write them and the
        weights under `root`."""

    @abc.abstractmethod
    def compile_shard(self, pair, index: int, count: int, cache, jobs: int | None, report) -> list:
        """`compile --shard index/count`: this builder's share of the graphs into the cache, no bundle."""

    # ---- plan: what the backend would build (class methods: no SDK needed)
    @classmethod
    def plan_keys(cls, bm, backend: "Backend | None", cache) -> dict[str, str]:
        """Graph name -> compile-cache key, where the plan can compute it (`backend`: an instance, or None)."""
        return {}

    @classmethod
    def plan_compiler_args(cls, pair) -> dict[str, list[str]] | None:
        """The compiler's flags per graph role, where the backend has a command-line compiler."""
        return None

    @classmethod
    def plan_graph(cls, spec, cc_args) -> dict:
        """Extra fields of one planned graph (its artifact, its compiler command)."""
        return {}

    @classmethod
    def plan_models(cls, bm, backend: "Backend | None", cache, cc_args) -> list[dict] | None:
        """Per-model build units, where the backend compiles models whole."""
        return None

    @classmethod
    def describe_plan(cls, plan: dict) -> list[str]:
        """Lines `eagle3-build plan` prints under a pair's table (its build units, its compiler commands)."""
        return []

    @abc.abstractmethod
    def version(self) -> str:
        """The compiler's version (enters every cache key)."""

    @abc.abstractmethod
    def key_fields(self, role: str) -> dict:
        """What enters a graph's compile-cache key besides the graph itself."""

    def toolchain(self) -> dict[str, str]:
        """Extra entries for the manifest's toolchain record."""
        return {}

    def notes(self) -> list[str]:
        """What the build must say about this toolchain (each a warning) and record in the manifest's notes."""
        return []

    def prepare(self, cache_root: Path) -> None:
        """Once per build (and per compile worker) before the first compile."""

    def pack_choice(self, dtype: str, shapes: list[tuple[int, int]], rows: list[int], cache_dir: Path | None,
                    draft_shapes: list[tuple[int, int]] | None = None, draft_bf16: bool = False) -> dict | None:
        """Which eagle3_runtime.packing format decode-sized projections take their weights in, per token row
        count (a backends/gemm.py `choose` record for the target's `shapes`, the draft's under "draft";
        `draft_bf16`: the draft checkpoint stores bfloat16); None: plain weights only."""
        return None

    def output_specs(self, module, example_args: tuple) -> list[tuple[list[int], object]]:
        return output_specs(module, example_args)

