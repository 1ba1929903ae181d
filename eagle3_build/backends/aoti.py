"""Backend `aoti`: AOTInductor `.pt2` per graph — native code (C++/OpenMP on CPU, CUDA when
`backend_options.device: cuda`), loaded by the runtime without any compiler or Python graph.

Weights stay graph inputs, so nothing is packaged but code: one package serves every rank and any
fine-tune of the same architecture. TP collectives (functional all_reduce/all_gather on group "0")
are compiled into calls on the named process group. Each compile runs with a private Inductor cache
directory at a path derived from the graph key, so the package is byte-reproducible (Inductor's own
warm cache appends compile commands to the packaged sources; paths enter debug info).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.utils._pytree as pytree

from ..errors import UserError
from .pt2 import set_serialization_id

NAME = "aoti"
SUFFIX = ".pt2"
JOB_MEMORY_GB = 2.0  # Inductor + g++ per compile job (measured ~1.2 GB peak for a tiny graph)
DEVICES = ("cpu", "cuda")


class AotiBackend:
    NAME, SUFFIX, JOB_MEMORY_GB = NAME, SUFFIX, JOB_MEMORY_GB

    def __init__(self, backend_options: dict):
        opts = dict(backend_options or {})
        self.device = opts.pop("device", "cpu")
        if self.device not in DEVICES:
            raise UserError(f"backend_options.device {self.device!r}: choose one of {', '.join(DEVICES)}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise UserError("backend_options.device cuda: this machine has no CUDA device (or torch is a CPU "
                            "build); build on a GPU host or use device: cpu")
        self.inductor_configs = dict(opts.pop("inductor_configs", {}) or {})
        if opts:
            raise UserError(f"backend_options {sorted(opts)} are not understood by backend aoti "
                            "(it takes device and inductor_configs)")

    def version(self) -> str:
        return torch.__version__

    def target(self) -> str:
        if self.device == "cuda":
            major, minor = torch.cuda.get_device_capability()
            return f"cuda:sm_{major}{minor}"
        return f"cpu:{torch.backends.cpu.get_cpu_capability()}"

    def key_fields(self) -> dict:
        return {"name": NAME, "version": self.version(), "target": self.target(),
                "inductor_configs": self.inductor_configs}

    def toolchain(self) -> dict[str, str]:
        return {"aoti_device": self.device, "aoti_target": self.target()}

    def output_specs(self, module, example_args):
        from .export import output_specs

        return output_specs(module, example_args)

    def compile_exported(self, ep, out: Path, key: str) -> dict:
        if ep.example_inputs is None:  # after a save/load round trip: uninitialised stand-ins (no memory touched)
            ep.example_inputs = example_inputs(ep, self.device)
        work = Path(tempfile.gettempdir()) / "eagle3-inductor" / key[:32]
        shutil.rmtree(work, ignore_errors=True)
        try:
            # one compile thread: AOTI emits one kernel file, and Inductor's worker pool only slows
            # start-up and can hold the interpreter at exit; parallelism comes from our own jobs
            with _env("TORCHINDUCTOR_CACHE_DIR", str(work)), torch._inductor.config.patch(compile_threads=1):
                torch._inductor.aoti_compile_and_package(ep, package_path=str(out),
                                                         inductor_configs=self.inductor_configs)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        set_serialization_id(out, key)
        return {"format": "aotinductor", "torch": torch.__version__, "device": self.device, "target": self.target()}


def example_inputs(ep, device: str = "cpu"):
    user = set(ep.graph_signature.user_inputs)
    vals = [n.meta["val"] for n in ep.graph.nodes if n.op == "placeholder" and n.name in user]
    flat = [torch.empty(v.shape, dtype=v.dtype, device=device) if isinstance(v, torch.Tensor) else v for v in vals]
    return pytree.tree_unflatten(flat, ep.call_spec.in_spec)


@contextlib.contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
