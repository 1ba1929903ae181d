"""The backend interface (`Backend`).

A backend owns its whole path from the pair's models to its part of the bundle (`write_graphs`: graph
files, weight files, their manifest entries): the per-graph backends (per_graph.py: export, aoti) compile
one torch.export graph per (role, bucket); neuron compiles each model whole (neuron/). `plan` asks the
backend class what it would build, SDK or not.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar


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
    def plan_details(cls, bm, backend: "Backend | None", cache, cc_args) -> dict:
        """The backend's own fields of a pair's plan (its build units, its compiler flags): keys of the plan's
        JSON beside the generic ones, which describe_plan renders."""
        return {}

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

    def projection_layouts(self, bm, cache, report=None) -> Any:
        """How the pair's projection weights are laid out in this backend's graphs: an object with `record` (the
        build record's "gemm") and `for_graph(spec)` -> a graph's layout (key_fields(), recorder(), plan(...):
        backends/cpu/packed.py); None: the weights as they are. What it measures meanwhile goes to `report`
        ({"event": "progress", "message": ...})."""
        return None

    def output_specs(self, module, example_args: tuple) -> list[tuple[list[int], object]]:
        return output_specs(module, example_args)

