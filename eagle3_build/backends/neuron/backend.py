"""The neuron backend: flags validated once per recipe pair, each model compiled by its ModelBuilder
(model.py), the bundle written per model (bundle.py)."""
from __future__ import annotations

import contextlib
import functools
import os
import shlex
import shutil
from pathlib import Path

import torch

from eagle3_runtime.backends import neuron_sdk
from eagle3_runtime.backends.neuron_sdk import GENERATIONS, NEFF_GENERATION, NEURON_SDK, NXD_GENERATION, NXDI
from eagle3_runtime.backends.neuron import COMPACT_FIELD, KV_COMPACT, KV_MOVE, NXD_FORMAT
from eagle3_runtime.graph_contract import ROLES

from ...errors import UserError
from ...recipe import check_backend_options
from ..base import Backend
from . import bundle, neff
from .releases import SDK_PACKAGES, SdkRelease, identify
from .model import (INDEX_DTYPE, NAME, SUFFIX, ModelGraphs, _no_checkpoint, compiler_args, flag_value, key_instance,
                    key_module, key_role, neuron_devices, neuronx_cc_command, priority_key, sdk_versions,
                    spec_key)
from .memory import JOB_MEMORY_GB, job_memory_gb
from .nxd_internals import bounded_compiles


class NeuronBackend(Backend):
    """Bound to one recipe pair's options (flags are validated once, before any graph)."""

    NAME, SUFFIX = NAME, SUFFIX
    INDEX_DTYPE = INDEX_DTYPE

    def __init__(self, backend_options: dict):
        check_backend_options(NAME, backend_options)
        self.generation = generation(backend_options)
        if self.generation == NEFF_GENERATION:
            self.versions = neff_sdk_versions()
            self.sdk = SdkRelease("unknown")  # (the release table ends with the NxD generation)
        else:
            self.versions = sdk_versions()  # fails fast, before any checkpoint is read
            self.sdk = identify(self.versions)  # (a mixed stack is refused here)
        self.release = self.sdk.name
        self.role_args = {role: compiler_args(backend_options, role, neuronx_cc=self.versions["neuronx-cc"])
                          for role in [*ROLES, KV_MOVE, KV_COMPACT]}
        self.job_memory_gb = job_memory_gb(backend_options)
        first = next(iter(self.role_args.values()))
        self.target = flag_value(first, "--target") or "trn2"
        self.lnc = int(flag_value(first, "--lnc") or 2)
        if any(flag_value(a, "--target") != flag_value(first, "--target") or flag_value(a, "--lnc") !=
               flag_value(first, "--lnc") for a in self.role_args.values()):
            raise UserError("backend_options.role_compiler_args: --target and --lnc must be the same for every role "
                            "(one bundle runs on one instance type)")
        if self.target not in neff.TARGETS:
            raise UserError(f"backend_options: --target {self.target} is not a Neuron target; use one of "
                            f"{', '.join(neff.TARGETS)}")
        self.neff_args = {role: neff.role_flags(args) for role, args in self.role_args.items()}

    def version(self) -> str:
        return self.versions["neuronx-cc" if self.generation == NEFF_GENERATION else "torch-neuronx"]

    def toolchain(self) -> dict[str, str]:
        if self.generation == NEFF_GENERATION:
            versions = {key: self.versions[pip] for key, pip in neuron_sdk.NEFF_SDK.values() if pip in self.versions}
        else:
            versions = {key: self.versions[pip] for key, pip in NEURON_SDK.values()}
        if NXDI in self.versions:  # (not used by the build: it names the release where two share the rest)
            versions[NXDI.replace("-", "_")] = self.versions[NXDI]
        return {**versions, "neuron_generation": self.generation, "neuron_sdk_release": self.release,
                "neuron_target": self.target, "neuron_lnc": str(self.lnc)}

    JOB_MEMORY_GB = JOB_MEMORY_GB  # (memory.py: the build sizes its compiler jobs from the host's memory itself)
    ESTIMATE_S = 600.0  # neuronx-cc for a decode-sized graph

    def key_fields(self, role: str) -> dict:
        if self.generation == NEFF_GENERATION:
            return {"name": NAME, "generation": self.generation, "versions": dict(sorted(self.versions.items())),
                    "compiler_args": self.neff_args[role], "target": self.target}
        return {"name": NAME, "versions": {pip: self.versions[pip] for pip in SDK_PACKAGES},
                "compiler_args": self.role_args[role]}

    def notes(self) -> list[str]:
        return [self.sdk.warning] if self.sdk.warning else []

    def compile_model(self, mg: ModelGraphs, tp: int, out_dir: Path, jobs: int = 1) -> dict:
        """Trace and compile every key of one model with ModelBuilder into out_dir/<model>.pt plus
        out_dir/<graph>.neff, at most `jobs` neuronx-cc jobs at once; returns the per-graph backend info.
        The NEFF generation: each graph lowered to out_dir/<graph>.hlo and compiled by the neuronx-cc CLI (neff.py)."""
        if self.generation == NEFF_GENERATION:
            return neff.compile_model(mg, tp, out_dir, self.target, self.neff_args, jobs)
        from neuronx_distributed.trace.model_builder import BaseModelInstance, ModelBuilder

        mg.check_routing()
        out_dir = Path(out_dir).resolve()  # (the trace runs in its own working directory)
        workdir = out_dir / "nxd-workdir"  # new: ModelBuilder.trace() removes its workdir first
        builder = ModelBuilder(router=None, tp_degree=tp, checkpoint_loader=_no_checkpoint,
                               compiler_workdir=str(workdir), logical_nc_config=self.lnc)
        priority = priority_key(mg, tp)
        for key in mg.keys():  # a fresh module per key, built when ModelBuilder loads the key
            builder.add(key=key, model_instance=key_instance(BaseModelInstance, functools.partial(key_module, mg, key),
                                                             mg.n_out),
                        example_inputs=mg.examples(key),
                        compiler_args=shlex.join(self.role_args[key_role(key)]),
                        priority_model_idx=0 if key == priority else None)
        env = {} if neuron_devices() else {"NEURON_PLATFORM_TARGET_OVERRIDE": self.target}
        scratch = out_dir / "nxd-cwd"  # layout optimisation writes <key>_<bucket>.hlo into the current directory
        scratch.mkdir(parents=True)
        with _environment(env, scratch), bounded_compiles(jobs):
            traced = builder.trace(initialize_model_weights=False)
        shutil.rmtree(scratch, ignore_errors=True)
        torch.jit.save(traced, str(out_dir / f"{mg.name}{SUFFIX}"))
        info, index = {}, {}
        for spec, _ in mg.graphs:
            key = spec_key(spec)
            i = index[key] = index.get(key, -1) + 1
            info[spec.name] = self._keep_neff(workdir, key, i, out_dir / f"{spec.name}.neff") | {
                "format": NXD_FORMAT, "model_file": f"{mg.name}{SUFFIX}", "key": key, "bucket_index": i,
                "arity": mg.arity, "n_out": mg.n_out, "compiler_args": list(self.role_args[spec.role])}
            if mg.compact_pairs:  # the runtime pads kv_compact calls to these pairs (eagle3_runtime/backends/neuron.py)
                info[spec.name][COMPACT_FIELD] = mg.compact_pairs
        info[KV_MOVE] = self._keep_neff(workdir, KV_MOVE, 0, out_dir / f"{mg.name}_{KV_MOVE}.neff")
        if mg.compact_pairs:
            info[KV_COMPACT] = self._keep_neff(workdir, KV_COMPACT, 0, out_dir / f"{mg.name}_{KV_COMPACT}.neff")
        shutil.rmtree(workdir, ignore_errors=True)
        return info

    @staticmethod
    def _keep_neff(workdir: Path, key: str, bucket: int, dest: Path) -> dict:
        src = workdir / key / f"_tp0_bk{bucket}" / "graph.neff"
        if not src.is_file():
            return {}
        shutil.copyfile(src, dest)
        return {"neff": dest.name}

    # ---- the bundle: one artifact per model (all ranks, all keys); weights as NxD checkpoints
    def write_graphs(self, bm, root: Path, cache, jobs: int | None, report, require_cached: bool):
        return bundle.write_graphs(bm, root, self, cache, jobs, report, require_cached)

    def compile_shard(self, pair, index: int, count: int, cache, jobs: int | None, report) -> list:
        raise UserError("compile --shard splits a bundle's graphs across builders; a neuron bundle compiles per "
                        "model through NxD's ModelBuilder (which runs its buckets' neuronx-cc jobs in parallel "
                        "itself): run `eagle3-build compile RECIPE` without --shard")

    # ---- plan (no SDK needed)
    @classmethod
    def plan_compiler_args(cls, pair) -> dict[str, list[str]] | None:
        args = PlanArgs({role: compiler_args(pair.backend_options, role) for role in ROLES})
        args.generation = generation(pair.backend_options)
        if args.generation == NEFF_GENERATION:
            version = neuron_sdk.distribution_version("neuronx-cc") or NEFF_COMPILER
            args.target = flag_value(next(iter(args.values())), "--target") or "trn2"
            args.update({role: neff.role_flags(compiler_args(pair.backend_options, role, neuronx_cc=version))
                         for role in [*ROLES, KV_MOVE, KV_COMPACT]})
        return args

    @classmethod
    def plan_graph(cls, spec, cc_args) -> dict:
        if getattr(cc_args, "generation", None) == NEFF_GENERATION:
            return {"artifact": f"graphs/{spec.name}.neff",
                    "compiler_command": shlex.join(neff.compile_argv(spec.name, cc_args.target, cc_args[spec.role]))}
        return {"artifact": f"graphs/{spec.name}.neff",
                "compiler_command": neuronx_cc_command(spec.name, cc_args[spec.role])}

    @classmethod
    def plan_details(cls, bm, backend, cache, cc_args) -> dict:
        """neuronx-cc's flags per graph role, one NxD ModelBuilder per model (the NxD generation); the HLO and
        compiler command of each model's kv_move / kv_compact NEFFs too (the NEFF generation)."""
        gen = getattr(cc_args, "generation", NXD_GENERATION)
        if gen == NEFF_GENERATION:
            models = bundle.spmd_models(bm)
            extra = [shlex.join(neff.compile_argv(name, cc_args.target, cc_args[key]))
                     for sm in models.values() for name, key, _ in neff.units(sm.graphs) if key in (KV_MOVE, KV_COMPACT)]
            return {"generation": gen, "compiler_args": dict(cc_args), "state_commands": extra}
        return {"generation": gen, "compiler_args": cc_args,
                "builders": bundle.plan_builders(bm, backend, cache, cc_args)}

    @classmethod
    def describe_plan(cls, plan: dict) -> list[str]:
        gen = plan.get("generation", NXD_GENERATION)
        lines = [f"Neuron SDK generation {gen} ({GENERATIONS[gen]})"]
        if gen == NEFF_GENERATION:
            lines.append("neuronx-cc commands (one NEFF per graph, every rank; run in graphs/ on the HLO torch-xla "
                         "lowers on this host):")
            return lines + [f"  {g['compiler_command']}" for g in plan["graphs"]] + [
                f"  {c}" for c in plan.get("state_commands", [])]
        builders = plan.get("builders") or []
        if builders:
            mem = [b["memory"] for b in builders]
            peak, avail = max(m["peak_gb"] for m in mem), mem[0]["host_available_gb"]
            verdict = "fits" if peak <= avail else "does NOT fit: the build refuses it (see --jobs, backend_options."\
                                                   "job_memory_gb)"
            lines.append(f"build host memory: peak ~{peak:.1f} GB at {mem[0]['compile_jobs']} neuronx-cc job(s) of "
                         f"{mem[0]['job_memory_gb']:g} GB; this host has {avail:.1f} GB available: {verdict}")
            lines += [f"  {b['describe_memory']}" for b in builders]
        for b in builders:
            shards = b["shard_files"]
            lines.append(f"ModelBuilder {b['model']} -> {b['artifact']} (TP {b['tp_degree']}, cache {b['cache']}); "
                         f"per-rank checkpoints {shards[0]['path'].rsplit('/', 1)[0]}/tp{{0..{len(shards) - 1}}}_"
                         f"sharded_checkpoint.safetensors, {shards[0]['bytes'] / 1e9:.3f} GB each")
            for k in b["keys"]:
                prio = "" if k["priority_bucket"] is None else f", priority bucket {k['priority_bucket']}"
                lines.append(f"  key {k['key']}: buckets {k['buckets']}{prio}; {shlex.join(k['compiler_args'])}")
        lines.append("neuronx-cc commands (one NEFF per graph, compiled by ModelBuilder.trace):")
        return lines + [f"  {g['compiler_command']}" for g in plan["graphs"]]


NEFF_COMPILER = "2.27.5334.0"  # neuronx-cc of SDK 2.32, the first of the NEFF generation (plan without the SDK)


class PlanArgs(dict):
    """plan_compiler_args' role -> flags, with the generation (and, for NEFF, the target) the plan is for."""

    generation: str = NXD_GENERATION
    target: str = "trn2"


def generation(backend_options: dict) -> str:
    """The SDK generation to build for: backend_options.generation, else the one this host's SDK packages are,
    else the NxD generation (whose checks name what to install); UserError for a name that is none."""
    gen = backend_options.get("generation") or neuron_sdk.host_generation() or NXD_GENERATION
    if gen not in GENERATIONS:
        raise UserError(f"backend_options.generation: {gen!r} is not a Neuron SDK generation; use "
                        + " or ".join(f"{g!r} ({d})" for g, d in GENERATIONS.items()))
    return gen


def neff_sdk_versions() -> dict[str, str]:
    """pip name -> version of the NEFF generation's packages here (neuronx-cc needed; libneuronxla and nrtpy
    recorded where installed); UserError naming what is missing."""
    found = neuron_sdk.generation_versions()
    if "neuronx-cc" not in found:
        raise UserError("the NEFF generation of backend neuron (Neuron SDK 2.32 +) needs neuronx-cc, which is not "
                        "installed (or only PyPI's placeholder): install the Neuron SDK's neuronx-cc from "
                        "pip.repos.neuron.amazonaws.com, or build with backend_options.generation: nxd on an SDK "
                        "2.27 - 2.31 host")
    return found


@contextlib.contextmanager
def _environment(env: dict[str, str], cwd: Path):
    """`env` set and `cwd` the working directory for one trace, both restored after."""
    saved, here = {k: os.environ.get(k) for k in env}, os.getcwd()
    os.environ.update(env)
    os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(here)
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
