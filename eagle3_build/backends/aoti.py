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
import platform
import re
import shutil
import tempfile
from pathlib import Path

import torch
import torch.utils._pytree as pytree

from eagle3_runtime.backends.aoti import CPU_ISA_RANK
from eagle3_runtime.backends.facts import AotiFacts
from eagle3_runtime.manifest import BLOCKED, BLOCKED_FORMATS, dtype_name
from eagle3_runtime.packing import BF16, BF16_FORMATS, BLOCKED_DTYPES, PACK_FORMATS, pack_available
from eagle3_runtime.signature import METADATA_KEY, Signature

from ..errors import UserError
from ..files import save_through_python
from ..pair import graph_plan
from ..recipe import check_backend_options
from .cpu import gemm, inductor_internals as inductor
from .cpu.inductor_internals import host_vec_isa, warm_up  # noqa: F401  (warm_up: backends/worker.py)
from .cpu.packed import ProjectionLayouts, plan_rows
from .per_graph import PerGraphBackend
from .pt2 import set_serialization_id

NAME = AotiFacts.name
SUFFIX = ".pt2"
JOB_MEMORY_GB = 2.0  # Inductor + g++ per compile job (docs/architecture.md)
DEVICES = ("cpu", "cuda")
# backend_options.cpu_isa -> (Inductor's vector width, the x86-64 psABI level g++ compiles for: code any CPU of that
# level runs, where Inductor's default -march=native may use what only the build host's CPU model has)
CPU_ISAS = {"avx2": (256, "x86-64-v3"), "avx512": (512, "x86-64-v4")}


class AotiBackend(PerGraphBackend):
    NAME, SUFFIX, JOB_MEMORY_GB = NAME, SUFFIX, JOB_MEMORY_GB
    ESTIMATE_S = 40.0  # Inductor + g++ for a decode-sized graph

    def __init__(self, backend_options: dict):
        check_backend_options(NAME, backend_options)
        opts = dict(backend_options or {})
        self.device = opts.pop("device", "cpu")
        if self.device not in DEVICES:
            raise UserError(f"backend_options.device {self.device!r}: choose one of {', '.join(DEVICES)}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise UserError("backend_options.device cuda: this machine has no CUDA device (or torch is a CPU "
                            "build); build on a GPU host or use device: cpu")
        cpu_isa = opts.pop("cpu_isa", "host")
        if self.device != "cpu" and cpu_isa != "host":
            raise UserError("backend_options.cpu_isa names the vector ISA of CPU graphs; with device: cuda leave it "
                            "out")
        self.cpu_isa = self._cpu_isa(cpu_isa) if self.device == "cpu" else None  # (None: Inductor's own flags)
        self.inductor_configs = dict(opts.pop("inductor_configs", {}) or {})
        self.pack_weights = opts.pop("pack_weights", True)
        if not (isinstance(self.pack_weights, bool) or self.pack_weights in PACK_FORMATS
                or (isinstance(self.pack_weights, str) and re.fullmatch(rf"{BLOCKED}:\d+x\d+", self.pack_weights))):
            raise UserError(f"backend_options.pack_weights {self.pack_weights!r}: must be true (the fastest packing "
                            f"per row count, measured on this host), false, one of {', '.join(PACK_FORMATS)}, or "
                            f"{BLOCKED}:BMxBN (Inductor's template with that register blocking, e.g. {BLOCKED}:8x8)")
        if isinstance(self.pack_weights, str) and not buildable(gemm.format_parts(self.pack_weights)[0]):
            raise UserError(f"backend_options.pack_weights {self.pack_weights}: this torch cannot make such packed "
                            "weights; use true (the fastest available, measured) or false")
        if isinstance(self.pack_weights, str) and gemm.format_parts(self.pack_weights)[1] is not None:
            with self.codegen():
                have = inductor.register_blockings()
            if gemm.format_parts(self.pack_weights)[1] not in have:
                raise UserError(f"backend_options.pack_weights {self.pack_weights}: Inductor has no such float32 "
                                f"register blocking for {self.target()}; name one of "
                                f"{', '.join(gemm.blocked_format(BLOCKED, b) for b in have)}, or {BLOCKED} (its own choice)")
        self.draft_bfloat16 = opts.pop("draft_bfloat16", "auto")
        if self.draft_bfloat16 not in ("auto", True, False):
            raise UserError(f"backend_options.draft_bfloat16 {self.draft_bfloat16!r}: must be auto (a candidate GEMM "
                            "for the draft's projections, measured, when its checkpoint stores bfloat16), true "
                            "(always) or false (never)")
        if self.draft_bfloat16 is True and not self.pack_weights:
            raise UserError("backend_options.draft_bfloat16: true needs packed weights: set pack_weights to true "
                            "(or a format), or draft_bfloat16 to auto or false")
        if self.draft_bfloat16 is True and not self.bf16_formats():
            raise UserError("backend_options.draft_bfloat16: true: no bfloat16 GEMM is available to these graphs "
                            "(oneDNN's needs x86 torch with oneDNN and AVX-512 CPUs, Inductor's template a vector ISA "
                            "it has a bfloat16 micro-kernel for); use auto or false")
        self.vec_isa_ok: bool | None = None  # set by prepare(): Inductor's ISA probe already proven

    @staticmethod
    def _cpu_isa(cpu_isa) -> str | None:
        """The key of CPU_ISAS the graphs are compiled for: backend_options.cpu_isa, or with "host" the build
        host's own vector ISA; None off x86 (Inductor's flags for the host). Refused where the build host
        cannot run the code (the build times GEMMs and verifies the graphs here)."""
        host = torch.backends.cpu.get_cpu_capability()
        x86 = platform.machine() in ("x86_64", "AMD64")
        if cpu_isa == "host":
            return host.lower() if x86 and host.lower() in CPU_ISAS else None
        if not isinstance(cpu_isa, str) or cpu_isa not in CPU_ISAS:
            raise UserError(f"backend_options.cpu_isa {cpu_isa!r}: choose host (this build host's widest vector ISA, "
                            f"the default) or one of {', '.join(CPU_ISAS)} (x86: the ISA every serving host has)")
        if not x86 or CPU_ISA_RANK.get(host, 0) < CPU_ISA_RANK[cpu_isa.upper()]:
            raise UserError(f"backend_options.cpu_isa {cpu_isa}: this build host runs {host} code, and the build "
                            f"times GEMMs and verifies the graphs here; build on a host with {cpu_isa.upper()}, or "
                            "use cpu_isa: host")
        return cpu_isa

    def bf16_formats(self) -> list[str]:
        """The bfloat16 GEMMs that can serve the draft, made here and run on the CPUs the graphs are for: oneDNN's
        (it has no bfloat16 path on AVX2 CPUs), and Inductor's template where it has a bfloat16 micro-kernel for
        the graphs' ISA."""
        with self.codegen():
            return [f for f in BF16_FORMATS if buildable(f) and (f != BF16 or self.cpu_isa != "avx2")]

    def codegen(self):
        """Inductor set to compile for the graphs' ISA and psABI level (tuned for this host: -mtune=native)."""
        if self.cpu_isa is None:
            return contextlib.nullcontext()
        return inductor.compile_for(*CPU_ISAS[self.cpu_isa])

    def version(self) -> str:
        return torch.__version__

    def target(self) -> str:
        if self.device == "cuda":
            major, minor = torch.cuda.get_device_capability()
            return f"cuda:sm_{major}{minor}"
        return f"cpu:{self.cpu_isa.upper() if self.cpu_isa else torch.backends.cpu.get_cpu_capability()}"

    def key_fields(self, role: str) -> dict:
        fields = {"name": NAME, "version": self.version(), "target": self.target(),
                  "inductor_configs": self.inductor_configs, "metadata": METADATA_KEY,
                  "collectives": "no locality reorder",  # (compile_exported: graphs built before it raced)
                  "line_tables": False, **({"input_checks": "none written"} if inductor.lean_wrapper_available() else {}),
                  **({"march": CPU_ISAS[self.cpu_isa][1]} if self.cpu_isa else {})}
        if not self.pack_weights:
            return fields  # (unpacked: the old keys)
        kernel = {"blocked_kernel": inductor.kernel_tag()} if self.device == "cpu" else {}
        return {**fields, "pack_weights": True, **kernel}

    def projection_layouts(self, bm, cache, report=None) -> ProjectionLayouts | None:
        """Packed weights for the pair's float32 CPU graphs (gemm_choice), over the row counts of the whole plan
        (every shard of a build gets the same); the measurement says what it measures through `report`."""
        pair = bm.lp.pair
        note = (lambda m: report({"event": "progress", "message": m})) if report else None
        record = self.gemm_choice(pair.dtype, gemm.projection_shapes(bm.models["target"][0]),
                                  plan_rows(pair, graph_plan(pair)), cache.root,
                                  gemm.projection_shapes(bm.models["draft"][0]),
                                  bm.lp.draft.stored_dtype() == torch.bfloat16, note)
        return self.layouts_of(record, pair)

    def layouts_of(self, record: dict | None, pair) -> ProjectionLayouts | None:
        """The graphs' layouts under a GEMM choice record (a bundle's build record "gemm", or gemm_choice's)."""
        return ProjectionLayouts(record, pair, self.codegen) if record else None

    def gemm_choice(self, dtype: str, shapes: list[tuple[int, int]], rows: list[int], cache_dir: Path | None,
                    draft_shapes: list[tuple[int, int]] | None = None, draft_bf16: bool = False,
                    note=None) -> dict | None:
        """float32 projections of decode-sized graphs on CPU take packed weights (made by the runtime at
        load: eagle3_runtime.packing): per row count the fastest of plain and every format this torch can
        make, measured here (gemm.choose), or the format pack_weights names; none with pack_weights: false.
        The draft's projections are measured apart, over its own shapes, with bfloat16 among the candidates
        where draft_bfloat16 allows it (auto: its checkpoint stores bfloat16); true names bfloat16."""
        if not self.pack_weights or self.device != "cpu" or dtype != "float32":
            return None
        exact = [f for f in PACK_FORMATS if buildable(f)]

        def record(shapes_, bf16, model):
            if bf16 and self.draft_bfloat16 is True:
                return gemm.named_choice(self.bf16_formats()[0], rows)
            if self.pack_weights is True:
                said = (lambda m: note(f"{model}: {m}")) if note else None
                return gemm.choose(shapes_, rows, exact + (self.bf16_formats() if bf16 else []), cache_dir, said)
            return gemm.named_choice(self.pack_weights, rows)

        with self.codegen():  # (blocked formats are compiled for the bundle's ISA, and timed here)
            out = record(shapes, False, "target")
            if draft_shapes is not None:
                bf16 = self.draft_bfloat16 is True or (self.draft_bfloat16 == "auto" and draft_bf16)
                out["draft"] = record(draft_shapes, bf16, "draft")
        return out

    def toolchain(self) -> dict[str, str]:
        off = sorted(n for n, state in inductor.report()["hooks"].items() if state != "on")
        return {"aoti_device": self.device, "aoti_target": self.target(),
                **({"aoti_march": CPU_ISAS[self.cpu_isa][1]} if self.cpu_isa else {}),
                **({"aoti_torch_hooks_off": ", ".join(off)} if off else {})}  # (inductor_internals)

    def prepare(self, cache_root: Path) -> None:
        """Once per build (and per worker) before compiling: skip Inductor's per-process CPU ISA
        probe when the memoised probe of this host proved every ISA the CPU flags list."""
        try:
            isa = host_vec_isa(Path(cache_root))
        except Exception:  # an optimisation only: Inductor then probes by itself
            return
        self.vec_isa_ok = True if isa["verified"] == isa["cpuinfo"] and isa["cpuinfo"] else None

    def compile_exported(self, ep, out: Path, key: str, role: str) -> dict:
        if ep.example_inputs is None:  # after a save/load round trip: uninitialised stand-ins (no memory touched)
            ep.example_inputs = example_inputs(ep, self.device)
        work = Path(tempfile.gettempdir()) / "eagle3-inductor" / key[:32]
        shutil.rmtree(work, ignore_errors=True)
        try:
            # one compile thread: AOTI emits one kernel file, and Inductor's worker pool only slows
            # start-up and can hold the interpreter at exit; parallelism comes from our own jobs
            # no -g1 line tables in the wrapper (profilers' aid): its g++ compile takes ~25% less time
            patch = {"compile_threads": 1, "aot_inductor.metadata": {METADATA_KEY: signature(ep).to_json()},
                     "aot_inductor.enable_line_tables": False, **(inductor.skip_vec_isa_probe() if self.vec_isa_ok else {}),
                     **(inductor.tp_graph_configs() if any(str(n.target).startswith("_c10d_functional.")
                                                          for n in ep.graph.nodes) else {})}
            with inductor.inductor_cache(work), self.codegen(), inductor.config_patch(patch), \
                    inductor.packed_input_lowering(), inductor.lean_wrapper():
                save_through_python(lambda f: inductor.compile_and_package(ep, f, self.inductor_configs), out)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        set_serialization_id(out, key)
        return {"format": AotiFacts.graph_format, "torch": torch.__version__, "device": self.device, "target": self.target()}


def buildable(fmt: str) -> bool:
    """Whether graphs built here can take `fmt`-packed weights: this torch makes the copies and Inductor lowers
    their GEMM (the blocked ones: it has a vectorised micro-kernel for this CPU)."""
    if fmt in BLOCKED_FORMATS:
        return pack_available(fmt) and inductor.blocked_available(BLOCKED_DTYPES[fmt])
    return pack_available(fmt) and inductor.extern_lowering_available()


def signature(ep) -> Signature:
    """What the compiled graph takes and returns (user inputs and outputs, in call order), which the
    package states in its metadata so that the runtime can check a manifest against it as data."""
    user = set(ep.graph_signature.user_inputs)
    ins = [n.meta["val"] for n in ep.graph.nodes if n.op == "placeholder" and n.name in user]
    (out_node,) = [n for n in ep.graph.nodes if n.op == "output"]
    outs = [a.meta["val"] for a in pytree.tree_leaves(out_node.args)]
    return Signature([(list(v.shape), dtype_name(v.dtype)) for v in ins], [(list(v.shape), dtype_name(v.dtype)) for v in outs])


def example_inputs(ep, device: str = "cpu"):
    user = set(ep.graph_signature.user_inputs)
    vals = [n.meta["val"] for n in ep.graph.nodes if n.op == "placeholder" and n.name in user]
    flat = [torch.empty(v.shape, dtype=v.dtype, device=device) if isinstance(v, torch.Tensor) else v for v in vals]
    return pytree.tree_unflatten(flat, ep.call_spec.in_spec)
