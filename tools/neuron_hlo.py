"""Lower exactly what the neuron backend traces to HLO (torch-xla 2.9, CPU PJRT) and check it.

    make neuron-hlo          # = PJRT_DEVICE=CPU .venv-neuron-stack/bin/python tools/neuron_hlo.py --tp 2
    tools/neuron_hlo.py --tp 1 --out REPORT.json   # what `make test` runs, at TP 1 and TP 2, beside the suite

Runs in .venv-neuron-stack (torch 2.9 + torch-xla 2.9 + transformers 4.57, the Neuron SDK's stack). It makes the tiny
Llama pair (a chain, and a dynamic tree) and the GPT-OSS twin at the TP degree given
(eagle3_build.testing.tiny.make_tiny_pair), loads each as the builder does (load_recipe, load_pair,
build_models, backend neuron) and runs the product's own SPMD path: NeuronBackend.write_graphs builds each
model's ModelGraphs and calls NeuronBackend.compile_model, unchanged. Only the SDK is replaced:

* `neuronx_distributed.parallel_layers.mappings` is tools/hlo_check.py's NxD mappings shim for the TP degree
  (xm.all_reduce / xm.all_gather over [[0, 1]] at TP 2), counting the collectives each graph asks for;
* `neuronx_distributed.trace.model_builder` records what compile_model hands to ModelBuilder (keys,
  BaseModelInstance(module_cls, input_output_aliases), one example tuple per bucket) and, in `trace()`,
  lowers every key and bucket with hlo_check (`lower_detailed(..., xla_alias_evidence=False)`: the text
  of `hlo_check.lower()` plus what each ENTRY parameter is), a fresh module_cls() per bucket;
* NeuronBackend's SDK version probe answers "hlo-check" (no SDK installed).
The rest of the bundle (per-rank weights, output specs, manifest) is written as usual into a temp dir,
so a torch 2.9 / transformers 4.57 failure anywhere on the neuron path shows up here too.

Checks per graph (each failure listed; exit 1 if any): every all-reduce / all-gather the model asked for
is in the HLO, with replica_groups [[0, 1]] (and none for kv_move); the KV state (the `kv` Parameter) is
aliased to the last output, same type; every integer ENTRY parameter is s32 (token / position / index
inputs, the rank weight, d2t, placeholders) - s64 parameters are reported with what they are; no
64-bit integer scatter / gather / dynamic-slice / collective inside; no constant as large as a weight
(more elements than the smallest 2-D weight of the model, or 1024); every output made on the XLA device
(torch_neuronx's xla_trace builds its LoweringContext over all outputs and refuses a CPU tensor, as
`_get_xla_tensors_hlo` does; such outputs are reported, then moved so the rest is still checked).
XLA_IR_DEBUG / XLA_HLO_DEBUG are on, so each finding names the Python line that made the instruction.
Report: benchmarks/results/neuron-hlo.json (or --out); NEURON_HLO_DUMP=DIR also writes each graph's HLO text there.
"""
from __future__ import annotations

import collections
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results" / "neuron-hlo.json"
TP = 2  # (--tp)
PAIRS = {"llama": {}, "llama-tree": {"num_layers": 8}, "gpt-oss": {"arch": "gpt-oss"}}
TREES = {"llama-tree": (3, 2, 7)}  # a dynamic tree (depth, topk, nodes) in every batch bucket

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("HLO_CHECK_XLA_DUMP", "0")  # lower() never syncs: XLA's own dump would stay empty
# source locations (metadata={... source_file source_line}) on every HLO instruction: where an s64 comes from
os.environ.setdefault("XLA_IR_DEBUG", "1")
os.environ.setdefault("XLA_HLO_DEBUG", "1")


def _import_paths() -> None:
    """eagle3_build and eagle3_runtime from the repo, hlo_check from tools/."""
    sys.path[:0] = [str(REPO / "tools"), str(REPO)]


_import_paths()

import hlo_check  # noqa: E402  (imports torch_xla; PJRT_DEVICE first)
import torch  # noqa: E402
from torch import nn  # noqa: E402

# ------------------------------------------------------------------ the stand-in SDK modules

class CountingMappings(types.ModuleType):
    """neuronx_distributed.parallel_layers.mappings: hlo_check's shim, counting calls per graph."""

    def __init__(self, tp: int):
        super().__init__("neuronx_distributed.parallel_layers.mappings")
        self.shim = hlo_check.nxd_mappings_shim(tp)
        self.calls: collections.Counter = collections.Counter()

    def reduce_from_tensor_model_parallel_region(self, x, process_group=None):
        self.calls["all-reduce"] += 1
        return self.shim.reduce_from_tensor_model_parallel_region(x)

    def gather_from_tensor_model_parallel_region(self, x, process_group=None):
        self.calls["all-gather"] += 1
        return self.shim.gather_from_tensor_model_parallel_region(x)


class Session:
    """What the recording ModelBuilder lowers, and the ModelGraphs compile_model was given."""

    def __init__(self, mappings: CountingMappings):
        self.mappings = mappings
        self.mg = None  # the ModelGraphs being compiled
        self.pair = None
        self.graphs: list[dict] = []


SESSION: Session | None = None


class BaseModelInstance:
    def __init__(self, module_cls, input_output_aliases):
        self.module_cls, self.input_output_aliases, self.module = module_cls, [input_output_aliases], None

    def load_module(self):
        self.module = self.module_cls()

    def get(self, bucket_rank, **kwargs):
        return self.module, self.input_output_aliases[0]


class _Traced(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class ModelBuilder:
    """Records compile_model's calls; trace() lowers every key and bucket to HLO and checks it."""

    def __init__(self, router, tp_degree, checkpoint_loader, compiler_workdir=None, logical_nc_config=1, **kw):
        self.tp, self.keys = tp_degree, []

    def add(self, key, model_instance, example_inputs, compiler_args=None, bucket_config=None,
            priority_model_idx=None):
        self.keys.append((key, model_instance, list(example_inputs), priority_model_idx))
        return self

    def trace(self, initialize_model_weights=True, dry_run=False, disable_fail_fast=False):
        from eagle3_runtime.backends.neuron import KV_COMPACT, KV_MOVE

        mg = SESSION.mg
        for key, inst, examples, priority in self.keys:
            names = [s.name for s, _ in mg.graphs if s.role == key] if key not in (KV_MOVE, KV_COMPACT) \
                else [f"{mg.name}_{key}"]
            for i, example in enumerate(examples):
                name = names[i] if i < len(names) else f"{key}_bucket{i}"
                SESSION.graphs.append(lower_and_check(SESSION, mg, key, i, name, inst, example, self.tp,
                                                      priority=priority))
        return torch.jit.script(_Traced())


def install_sdk(tp: int) -> Session:
    global SESSION
    mappings = CountingMappings(tp)
    mb = types.ModuleType("neuronx_distributed.trace.model_builder")
    mb.ModelBuilder, mb.BaseModelInstance = ModelBuilder, BaseModelInstance
    mb.neuron_xla_compile = lambda **kw: b""  # (what the build bounds; nothing is compiled here)
    mods = {"neuronx_distributed": types.ModuleType("neuronx_distributed"),
            "neuronx_distributed.parallel_layers": types.ModuleType("neuronx_distributed.parallel_layers"),
            "neuronx_distributed.parallel_layers.mappings": mappings,
            "neuronx_distributed.trace": types.ModuleType("neuronx_distributed.trace"),
            "neuronx_distributed.trace.model_builder": mb}
    mods["neuronx_distributed"].parallel_layers = mods["neuronx_distributed.parallel_layers"]
    mods["neuronx_distributed"].trace = mods["neuronx_distributed.trace"]
    mods["neuronx_distributed.parallel_layers"].mappings = mappings
    mods["neuronx_distributed.trace"].model_builder = mb
    sys.modules.update(mods)
    SESSION = Session(mappings)
    return SESSION


# ------------------------------------------------------------------ one graph

def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


_SOURCE = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = .*source_file="([^"]*)" source_line=(\d+)')


def _sources(hlo: str) -> dict[str, str]:
    """instruction name -> 'file:line' of the Python that made it (XLA_HLO_DEBUG metadata)."""
    out = {}
    for line in hlo.splitlines():
        m = _SOURCE.match(line)
        if m:
            f = m.group(2)
            f = os.path.relpath(f, REPO) if f.startswith(str(REPO)) and ".venv" not in f else f.rsplit("site-packages/", 1)[-1]
            out[m.group(1)] = f"{f}:{m.group(3)}"
    return out


_INST = re.compile(r"\b[a-z][\w\-]*\.\d+\b")


def _with_source(msg: str, src: dict[str, str]) -> str:
    """A check() issue naming an HLO instruction, with the Python line that made it."""
    where = [src[n] for n in _INST.findall(msg) if n in src]
    return f"{msg} [{', '.join(dict.fromkeys(where))}]" if where else msg


def _grouped(failures: list[tuple[str, str]]) -> list[str]:
    """(graph, message) -> one line per message with the HLO names and numbers taken out, naming its graphs."""
    groups: dict[str, list[str]] = {}
    for graph, msg in failures:
        key = re.sub(r"parameter \d+ \([^)]*\)", "parameter", _INST.sub("", msg)).replace("  ", " ")
        groups.setdefault(key, []).append(graph)
    out = []
    for msg, graphs in groups.items():
        counts = collections.Counter(graphs)
        names = ", ".join(f"{g} x{n}" if n > 1 else g for g, n in counts.items())
        out.append(f"{msg} -- {names}")
    return out


def _outputs_on_device(module: nn.Module, cpu_outputs: list[int]) -> None:
    """An output the module creates off the XLA device (torch.zeros(...) without device=) cannot be lowered:
    torch_neuronx's xla_trace builds its LoweringContext over every output, which raises as
    `_get_xla_tensors_hlo` does here. Record such outputs and move them to the device, so that the rest of
    the graph is still checked."""
    forward = module.forward

    def on_device(*xs):
        outs = forward(*xs)
        dev = next(x.device for x in xs if isinstance(x, torch.Tensor))
        cpu_outputs[:] = [i for i, o in enumerate(outs) if o.device.type != dev.type]
        return tuple(o.to(dev) if i in cpu_outputs else o for i, o in enumerate(outs))

    module.forward = on_device


def lower_and_check(session: Session, mg, key: str, bucket: int, name: str, inst, example, tp: int,
                    priority=None) -> dict:
    from eagle3_runtime.backends.neuron import KV_COMPACT, KV_MOVE

    inst.load_module()  # fresh per bucket: lowering moves the module's Parameters to the XLA device
    module, aliases = inst.get(bucket)  # (ModelBuilder: the alias dict of this bucket, from get())
    cpu_outputs: list[int] = []
    _outputs_on_device(module, cpu_outputs)
    n_out = mg.n_out
    rec: dict = {"pair": session.pair, "name": name, "model": mg.name, "key": key, "bucket_index": bucket,
                 "priority": priority == 0, "inputs": [[list(x.shape), str(x.dtype).removeprefix("torch.")]
                                                       for x in example]}
    failures: list[str] = []
    session.mappings.calls.clear()
    t0 = time.perf_counter()
    try:
        res = hlo_check.lower_detailed(module, example, aliases, tp, xla_alias_evidence=False)
    except Exception as e:  # noqa: BLE001 - reported per graph
        rec.update(ok=False, failures=[f"lowering failed: {type(e).__name__}: {e}"],
                   traceback=traceback.format_exc(limit=8))
        return rec
    rec["lower_seconds"] = round(time.perf_counter() - t0, 2)
    if os.environ.get("NEURON_HLO_DUMP"):  # each graph's HLO text, for reading
        d = Path(os.environ["NEURON_HLO_DUMP"])
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{session.pair}-{name}.hlo.txt").write_text(res["hlo"])
    calls = dict(session.mappings.calls)
    for i in cpu_outputs:
        failures.append(f"output {i} is created on the CPU, not on the XLA device (a tensor made in forward "
                        "without device=): torch_neuronx cannot lower it")
    weight_elems = [_numel(s) for s, _ in mg.weights.values() if len(s) >= 2]
    max_const = min([1024] + [n - 1 for n in weight_elems])
    f = hlo_check.check(res["hlo"], tp=tp, max_constant_elems=max_const,
                        expect_collectives=(key not in (KV_MOVE, KV_COMPACT) and tp > 1))
    failures += f["issues"]  # replica groups, s64 parameters, s64 indexed/collective ops, big constants, alias types

    # collectives: everything the model asked for reached the HLO
    ops = collections.Counter(c["op"] for c in f["collectives"])
    for op in ("all-reduce", "all-gather"):
        if ops.get(op, 0) != calls.get(op, 0):
            failures.append(f"{op}: {calls.get(op, 0)} traced through NxD's mappings, {ops.get(op, 0)} in the HLO")
    if key not in (KV_MOVE, KV_COMPACT) and tp > 1 and not calls.get("all-reduce"):
        failures.append(f"no all-reduce traced (tp {tp}: every role reduces its row-parallel matmuls)")

    # the KV state aliased to the last output
    roles = {p["number"]: p["role"] for p in res["parameters"]}
    alias = [dict(a, parameter_role=roles.get(a["parameter"])) for a in f["input_output_alias"]]
    n_outputs = len(f["outputs"])
    if len(alias) != 1:
        failures.append(f"{len(alias)} input_output_alias entries, expected 1 (kv -> output {n_out})")
    for a in alias:
        if a["output"] != n_out or a["output"] != n_outputs - 1:
            failures.append(f"alias on output {a['output']}, expected the last output {n_out} of {n_outputs}")
        if a["parameter_role"] != "state:kv":
            failures.append(f"aliased parameter {a['parameter']} is {a['parameter_role']}, expected state:kv")

    # integer parameters: what each one is
    int_params = [{"number": p["number"], "role": roles.get(p["number"]), "dtype": p["dtype"], "shape": p["shape"]}
                  for p in f["int_parameters"]]
    s64_params = [p for p in int_params if p["dtype"] in ("s64", "u64")]
    inputs_int = [p for p in int_params if (p["role"] or "").startswith("input[")]
    for p in inputs_int:
        if p["dtype"] != "s32":
            failures.append(f"input {p['role']} is {p['dtype']}{p['shape']}, expected s32")

    src = _sources(res["hlo"])
    hlo_names = {p["number"]: p["name"] for p in f["parameters"]}
    for p in int_params:
        p["source"] = src.get(hlo_names.get(p["number"]))
    s64_ops = [dict(o, source=src.get(o["name"])) for o in f["s64_critical_ops"]]
    s64_found: collections.Counter = collections.Counter()  # every int64 tensor, by kind, op and Python line
    for t in hlo_check.s64_tensors(res["hlo"]):
        s64_found[f"{t['kind'] or 'UNCLASSIFIED'}: {t['op']} ({t['torch_op']}) @ {src.get(t['name'])}"] += 1
        if t["kind"] is None:
            failures.append(f"{t['name']} is {t['type']} ({t['torch_op']}), where int32 serves")
    failures = [_with_source(m, src) for m in dict.fromkeys(failures)]
    rec.update({
        "n_params": len(f["parameters"]),
        "n_outputs": n_outputs,
        "collective_calls_traced": calls,
        "collectives": [{k: c.get(k) for k in ("op", "name", "result", "replica_groups", "dimensions",
                                                 "constrain_layout")} for c in f["collectives"]],
        "alias": alias,
        "int_parameters": int_params,
        "input_int_dtypes": sorted({p["dtype"] for p in inputs_int}),
        "s64_parameters": s64_params,
        "s64_critical_ops": s64_ops,
        "s64_tensors": dict(s64_found.most_common()),
        "outputs_created_off_device": cpu_outputs,
        "constants_nonscalar": f["constants_nonscalar"],
        "max_constant_elems": max_const,
        "custom_calls": f["custom_calls"],
        "ok": not failures,
        "failures": failures,
    })
    return rec


# ------------------------------------------------------------------ one pair

def run_pair(label: str, kw: dict, work: Path, session: Session) -> dict:
    from eagle3_build import pair as pairs
    from eagle3_build.backends.neuron import backend as neuron
    from eagle3_build.backends.neuron.release_table import NEWEST, RELEASES
    from eagle3_build.backends.neuron.releases import SDK_PACKAGES
    from eagle3_build.compile.cache import CompileCache
    from eagle3_build.recipe import load_recipe
    from eagle3_build.testing.tiny import make_tiny_pair

    class HloBackend(neuron.NeuronBackend):
        """The real backend; compile_model is the product's, run against the recording ModelBuilder."""

        def compile_model(self, mg, tp, out_dir, jobs=1):
            session.mg = mg
            return super().compile_model(mg, tp, out_dir, jobs)

    t0 = time.perf_counter()
    n_before = len(session.graphs)
    session.pair = label
    info: dict = {"pair": label}
    try:
        recipe = make_tiny_pair(work / label / "pair", tp_degree=TP, **kw)
        pair = load_recipe(recipe).pairs[0].model_copy(update={  # (no neuronx-cc job runs here)
            "backend": "neuron", "backend_options": {"job_memory_gb": 1}})
        if label in TREES:
            from eagle3_build.recipe import Speculation
            from eagle3_runtime.speculation import dynamic_tree

            pair = pair.model_copy(update={"speculation": Speculation(
                num_speculative_tokens=TREES[label][0], shapes={b: dynamic_tree(*TREES[label]) for b in pair.buckets.batch})})
        info.update(recipe=pair.name, dtype=pair.dtype, tp=pair.parallel.tp_degree, K=pair.speculation.num_speculative_tokens,
                    prefill_buckets=list(pair.buckets.prefill), batch_buckets=list(pair.buckets.batch))
        newest = {pip: RELEASES[NEWEST][pip][-1] for pip in SDK_PACKAGES}  # (no SDK here: the newest release's)
        with mock.patch.object(neuron, "sdk_versions", lambda: newest):
            backend = HloBackend(pair.backend_options)
        lp = pairs.load_pair(pair)
        bm = pairs.build_models(lp)
        root = work / label / "bundle"
        (root / "graphs").mkdir(parents=True)
        backend.write_graphs(bm, root, CompileCache(work / label / "cache"), None, lambda ev: None, False)
        info["bundle"] = "written"
    except Exception as e:  # noqa: BLE001 - reported, the graphs lowered so far still count
        info["bundle"] = f"FAILED: {type(e).__name__}: {e}"
        info["traceback"] = traceback.format_exc(limit=12)
    info["graphs"] = [g["name"] for g in session.graphs[n_before:]]
    info["seconds"] = round(time.perf_counter() - t0, 1)
    return info


def summary(report: dict) -> str:
    lines = [f"neuron-hlo: torch {report['versions']['torch']}, torch-xla {report['versions']['torch_xla']}, "
             f"transformers {report['versions']['transformers']}, tp {TP}, {report['seconds']} s"]
    for p in report["pairs"]:
        lines.append(f"  pair {p['pair']}: {len(p['graphs'])} graphs, bundle {p['bundle']} ({p['seconds']} s)")
    lines.append(f"  {'pair/graph':<28} {'par':>4} {'AR':>3} {'AG':>3} {'alias':>6} {'int in':>8} {'s64 par':>7} "
                 f"{'s64 ops':>7} {'const':>5}  ok")
    for g in report["graphs"]:
        gname = f"{g['pair']}/{g['name']}"
        if "n_params" not in g:
            lines.append(f"  {gname:<28} LOWERING FAILED")
            continue
        ops = collections.Counter(c["op"] for c in g["collectives"])
        al = ",".join(f"{a['output']}<-{a['parameter']}" for a in g["alias"]) or "-"
        big = sum(1 for c in g["constants_nonscalar"] if c["elems"] > g["max_constant_elems"])
        lines.append(f"  {gname:<28} {g['n_params']:>4} {ops.get('all-reduce', 0):>3} {ops.get('all-gather', 0):>3} "
                     f"{al:>6} {'/'.join(g['input_int_dtypes']) or '-':>8} {len(g['s64_parameters']):>7} "
                     f"{len(g['s64_critical_ops']):>7} {big:>5}  {'ok' if g['ok'] else 'FAIL'}")
    fails = report["failures"]
    lines.append(f"  {sum(g.get('ok', False) for g in report['graphs'])}/{len(report['graphs'])} graphs ok; "
                 f"{len(fails)} failure(s){', grouped (each one is in the report):' if fails else ''}")
    lines += [f"    - {x}" for x in _grouped(report["failure_list"])]
    lines.append(f"  int64 tensors: {report['int64']['tensors_by_kind'] or 'none'}")
    lines += [f"    {k}: {v}" for k, v in report["int64"]["kinds"].items()]
    lines += [f"    covered by, {k}: {v}" for k, v in report["int64"]["covered_by"].items()]
    lines.append(f"  report: {report['path']}")
    return "\n".join(lines)


def main() -> int:
    import argparse

    import torch_xla
    import transformers

    global TP
    ap = argparse.ArgumentParser(description="Lower the neuron backend's graphs of tiny pairs to HLO and check them")
    ap.add_argument("--tp", type=int, default=TP, choices=(1, 2), help="TP degree of the pairs (default 2)")
    ap.add_argument("--out", type=Path, default=OUT, help=f"report path (default {OUT.relative_to(REPO)})")
    args = ap.parse_args()
    TP = args.tp

    t0 = time.perf_counter()
    session = install_sdk(TP)
    work = Path(tempfile.mkdtemp(prefix="neuron_hlo_"))
    try:
        pairs = [run_pair(label, kw, work, session) for label, kw in PAIRS.items()]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    failure_list = []  # (where, message)
    for p in pairs:
        if p["bundle"] != "written":
            failure_list.append((p["pair"], f"bundle {p['bundle']}"))
        if not p["graphs"]:
            failure_list.append((p["pair"], "no graph lowered"))
    for g in session.graphs:
        failure_list += [(f"{g['pair']}/{g['name']}", x) for x in g["failures"]]
    failures = [f"{w}: {m}" for w, m in failure_list]
    from eagle3_build.backends.neuron.release_table import RELEASES
    from eagle3_build.backends.neuron.releases import INTEGER_FLAGS, INTEGER_FLAGS_SINCE

    kinds = collections.Counter(k.split(":")[0] for g in session.graphs for k, n in g.get("s64_tensors", {}).items()
                                for _ in range(n))
    since = ".".join(map(str, INTEGER_FLAGS_SINCE))
    report = {
        "tool": "tools/neuron_hlo.py",
        "versions": {"torch": torch.__version__, "torch_xla": torch_xla.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
        "tp": TP,
        "seconds": round(time.perf_counter() - t0, 1),
        "ok": not failures,
        "failures": failures,
        "pairs": pairs,
        "int64": {"tensors_by_kind": dict(kinds), "kinds": hlo_check.S64_KINDS, "covered_by": {
            f"neuronx-cc < {since} (SDK {next(iter(RELEASES))} to {list(RELEASES)[-1]})":
                "no integer flags exist; the compiler downcasts every int64 to int32 (exact for both kinds)",
            f"neuronx-cc >= {since} (SDK 2.32 on)": f"{' '.join(INTEGER_FLAGS)}, pinned per compiler version by "
                                                   "the build (eagle3_build/backends/neuron/releases.py integer_flags)"}},
        "graphs": session.graphs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(summary({**report, "failure_list": failure_list, "path": args.out}))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
