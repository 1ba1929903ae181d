"""Backend `aoti`: AOTInductor packages, native code for one torch ABI and one ISA (or CUDA device),
weights passed as inputs on every call (nothing copied), some packed at load for the host's GEMMs."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from ..manifest import BundleError, GraphEntry, Manifest
from ..packing import BF16, ELEMENT_BYTES, copy_key, describe_choice, pack_weight
from ..signature import Signature, aoti_signature, read_zip_signature
from ..torch_internals import load_aoti_package, onednn_bf16_available
from .base import BACKEND, DEVICE, Check, GraphFn
from .facts import AotiFacts
from .host import HostBackend

CPU_ISA_RANK = {"DEFAULT": 0, "VSX": 1, "ZVECTOR": 1, "SVE256": 1, "AVX2": 1, "AVX512": 2}


class AotiBackend(AotiFacts, HostBackend):
    native_code = True
    graph_kind = "an AOTInductor package (a wrapper .so with its metadata)"

    @classmethod
    def host_checks(cls, m: Manifest, environ) -> list[Check]:
        tc = m.toolchain
        if tc.get("torch") != torch.__version__:
            return [Check("backend", False, f"aoti graphs were compiled against torch {tc.get('torch')}, this host "
                                            f"has {torch.__version__}; install torch=={tc.get('torch')} or rebuild "
                                            "the bundle here", BACKEND)]
        out = [Check("backend", True, f"aoti, torch {torch.__version__}")]
        target = tc.get("aoti_target", "cpu:DEFAULT")
        kind, _, isa = target.partition(":")
        if kind == "cuda":
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            ok = n >= m.tp_degree
            out.append(Check("device", ok, f"{target}: {n} CUDA device(s) for tp {m.tp_degree}" if ok else
                             f"aoti graphs were compiled for {target}; this host has {n} CUDA device(s), the bundle "
                             f"needs {m.tp_degree}; use a GPU host or rebuild with device: cpu", DEVICE))
        else:
            host = torch.backends.cpu.get_cpu_capability()
            ok = CPU_ISA_RANK.get(host, 0) >= CPU_ISA_RANK.get(isa, 0)
            fix = f", or build it for such hosts with backend_options.cpu_isa: {host.lower()}" \
                if host in ("AVX2", "AVX512") else ""
            level = f" ({str(tc['aoti_march'])[:32]})" if tc.get("aoti_march") else ""
            out.append(Check("device", ok, f"compiled for {isa} CPUs{level}, host supports {host}" if ok else
                             f"aoti graphs were compiled for {isa} CPUs, this host supports {host}; rebuild the "
                             f"bundle on this host{fix}", DEVICE))
            gemm = describe_choice(m.build.get("gemm"))
            if gemm:
                out.append(Check("kernels", True, gemm))
            if ok and any(p.format == BF16 for g in m.graphs for p in g.packed) and not onednn_bf16_available():
                out.append(Check("kernels", False, "the draft's graphs call oneDNN's bfloat16 GEMM, which oneDNN "
                                 "does not run on this CPU (it needs AVX-512 or AVX-NE-CONVERT); rebuild the bundle "
                                 "with backend_options.draft_bfloat16: false", DEVICE))
        return out

    @classmethod
    def describe_bundle(cls, m: Manifest) -> list[str]:
        """The weight copies packed at load (memory on top of the weights) and the GEMM choice they follow."""
        out = []
        copies = {copy_key(p): p for g in m.graphs for p in g.packed}
        if copies:
            mb = sum(math.prod(m.models[w.split("/")[0]].tensors[w.split("/", 1)[1]].shape) * ELEMENT_BYTES[p.format]
                     for p in copies.values() for w in (p.weight, *p.fused)) / 1e6
            rows = sorted({p.rows for g in m.graphs for p in g.packed})
            out.append(f"packed at load: {len(copies)} weight copies "
                       f"({', '.join(sorted({p.format for p in copies.values()}))}) for token rows {rows}, "
                       f"~{mb:.0f} MB per rank")
        gemm = describe_choice(m.build.get("gemm"))
        return out + ([gemm] if gemm else [])

    @classmethod
    def read_signature(cls, path: Path) -> Signature | None:
        return read_zip_signature(path, aoti_signature, cls.name, cls.graph_kind)

    def __init__(self, root: Path, m: Manifest, rank: int):
        for c in self.host_checks(m, {}):  # native code: refuse before loading any of it
            if not c.ok:
                raise BundleError(c.detail)
        self.packed: dict[tuple, torch.Tensor] = {}
        super().__init__(root, m, rank)

    def inputs_after_weights(self, g: GraphEntry) -> tuple[torch.Tensor, ...]:
        """The graph's packed copies, each made once (packing.copy_key) and shared by every graph that takes it;
        fused weights are concatenated along the output dim first."""
        out = []
        for p in g.packed:
            key = copy_key(p)
            if key not in self.packed:
                w = torch.cat([self.weights[n] for n in (p.weight, *p.fused)]) if p.fused else self.weights[p.weight]
                self.packed[key] = pack_weight(w, p.rows, p.format, p.block_n)
            out.append(self.packed[key])
        return tuple(out)

    def load_graph(self, path: Path, entry: GraphEntry, weights: tuple[torch.Tensor, ...]) -> GraphFn:
        return load_aoti_package(str(path))
