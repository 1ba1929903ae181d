"""What a neuron build asks of its host's memory: `plan` prints it, the build refuses a host it does not fit.

One ModelBuilder per model, one after the other. Inside one (ModelBuilder.trace, NxD 0.16-0.18):
  * each key's module is built when its HLO is generated and stays referenced by its model instance until
    the trace ends; eagle3-build's modules hold untouched zeros (model.untouched_zeros): nothing resident;
  * generate_hlo moves a key's module to the XLA device and back (torch-neuronx's revert_device_placement,
    read in its public 1.13 source; today's is closed): a copy of the key's weights and state while its HLO
    is made, written CPU copies after, which ModelBuilder keeps for a key with more than one bucket
    (preserve_parameters) and drops for a one-bucket key [inferred; counted, so the estimate is an upper bound];
  * then neuronx-cc: the priority bucket alone, the rest `jobs` at a time (nxd_internals.bounded_compiles),
    each job about `job_memory_gb` (backend_options; JOB_MEMORY_GB when not given).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ...host import host_cores
from ...errors import UserError

BASELINE_GB = 3.0  # the build process itself: python, torch, torch-xla, the SDK's modules, checkpoints' headers
JOB_MEMORY_GB = 16.0  # one neuronx-cc job on an 8B-class graph (REFERENCE §6: "[F137] neuronx-cc was forcibly killed")
GB = 1e9


def job_memory_gb(backend_options: dict) -> float:
    value = backend_options.get("job_memory_gb", JOB_MEMORY_GB)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 4096:
        raise UserError(f"backend_options.job_memory_gb: {value!r} is not a size in GB (0 < x <= 4096): the memory "
                        "one neuronx-cc job takes on these graphs, e.g. 16")
    return float(value)


@dataclass(frozen=True)
class BuilderMemory:
    """One model's ModelBuilder, as far as memory goes."""

    model: str
    weight_bytes: int  # one rank's weights (every key's module has a set, untouched)
    state_bytes: int  # one rank's KV cache (every key's module has one, untouched)
    keys: int
    kept: int  # keys with more than one bucket: their traced weights and state stay resident
    buckets: int  # NEFFs to compile

    @property
    def copy_gb(self) -> float:
        return (self.weight_bytes + self.state_bytes) / GB

    def compile_jobs(self, jobs: int) -> int:
        """neuronx-cc jobs at once: the priority bucket alone, then up to `jobs` of the rest."""
        return max(1, min(jobs, self.buckets - 1))

    def peak_gb(self, jobs: int, job_gb: float) -> float:
        """Tracing (the kept copies and the key being traced) or compiling (the kept copies and the jobs)."""
        return BASELINE_GB + self.kept * self.copy_gb + max(self.copy_gb, self.compile_jobs(jobs) * job_gb)

    def jobs_that_fit(self, available_gb: float, job_gb: float) -> int:
        """The most compiler jobs at once that fit `available_gb` (0: not even one)."""
        if BASELINE_GB + (self.kept + 1) * self.copy_gb > available_gb:
            return 0
        return max(0, math.floor((available_gb - BASELINE_GB - self.kept * self.copy_gb) / job_gb))

    def describe(self, jobs: int, job_gb: float) -> str:
        return (f"ModelBuilder {self.model}: {self.keys} keys, {self.kept} keep their traced weights + KV cache "
                f"({self.copy_gb:.2f} GB a key), {self.compile_jobs(jobs)} neuronx-cc job(s) x {job_gb:g} GB: "
                f"peak ~{self.peak_gb(jobs, job_gb):.1f} GB")

    def to_dict(self, jobs: int, job_gb: float) -> dict:
        return {**asdict(self), "compile_jobs": self.compile_jobs(jobs), "peak_gb": round(self.peak_gb(jobs, job_gb), 2)}


def build_jobs(builders: list[BuilderMemory], jobs: int | None, available_gb: float, job_gb: float, pair: str) -> int:
    """The compiler jobs the build runs: `jobs` (--jobs) or what the cores and the memory allow; UserError
    when the build does not fit this host's memory, naming what it needs and the fix."""
    if not builders:
        return jobs or 1
    fit = min(b.jobs_that_fit(available_gb, job_gb) for b in builders)
    use = jobs or max(1, min(host_cores(), fit))
    worst = max(builders, key=lambda b: b.peak_gb(use, job_gb))
    need = worst.peak_gb(use, job_gb)
    if need <= available_gb:
        return use
    if fit >= 1:
        fix = f"run with --jobs {fit} (peak ~{max(b.peak_gb(fit, job_gb) for b in builders):.1f} GB)"
    else:
        fix = (f"build on a host with at least {math.ceil(round(worst.peak_gb(1, job_gb), 1))} GB free, or set "
               "backend_options.job_memory_gb to what one neuronx-cc job measurably takes on these graphs")
    raise UserError(f"backend neuron: building {pair} needs about {need:.1f} GB of memory at --jobs {use} "
                    f"({worst.describe(use, job_gb)}) and this host has {available_gb:.1f} GB available; {fix}")
