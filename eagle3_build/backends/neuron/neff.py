"""The NEFF generation of backend neuron (Neuron SDK 2.32 +: no torch-neuronx, no NxD; docs/neuron.md).

Each graph (role x bucket, and each model's kv_move / kv_compact) is the same module the NxD generation traces
(model.key_module), lowered to an HloModuleProto by torch-xla on CPU with NxD's collectives over the TP mesh
(xla_internals.lower_graph), written as <graph>.hlo and compiled by the neuronx-cc CLI into <graph>.neff: one
NEFF per graph, run by every rank (SPMD: the rank is a per-rank weight, weights are per-rank inputs, the KV
state an input aliased to the last output). What the bundle records per graph (GraphEntry.backend): the NEFF,
its HLO, the exact compiler argv, and what each NEFF input and output binds to (`neff_inputs`, `neff_outputs`:
NEFF tensor names input<i> / output<j> [inferred: neuronx-cc's XLA frontend names them by position]).
"""
from __future__ import annotations

import shlex
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eagle3_runtime.backends.neuron import KV_COMPACT, KV_MOVE
from eagle3_runtime.backends.neuron_sdk import NEFF_FORMAT, NEFF_GENERATION

from ...errors import UserError
from .model import key_module, key_role, spec_key

COMPILER = "neuronx-cc"
TARGETS = ("trn1", "trn2", "trn3", "inf2")
LOG_TAIL = 2000  # characters of a failed compile's output kept in its error


def role_flags(args: list[str]) -> list[str]:
    """A role's neuronx-cc flags (model.compiler_args: NxDI's per-role defaults, -O level included, the integer pins
    of this compiler version, the recipe's) without --target, which compile_argv places."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--target":
            skip = True
        elif not a.startswith("--target="):
            out.append(a)
    return out


def compile_argv(name: str, target: str, args: list[str]) -> list[str]:
    """One graph's compiler command, run in the directory holding <name>.hlo."""
    return [COMPILER, "compile", f"{name}.hlo", "--framework", "XLA", "--target", target, "--output",
            f"{name}.neff", *args]


def units(mg) -> list[tuple[str, str, int]]:
    """(graph name, key, bucket index) of every NEFF one model's graphs compile to."""
    out, index = [], {}
    for spec, _ in mg.graphs:
        key = spec_key(spec)
        index[key] = index.get(key, -1) + 1
        out.append((spec.name, key, index[key]))
    out.append((f"{mg.name}_{KV_MOVE}", KV_MOVE, 0))
    if mg.compact_pairs:
        out.append((f"{mg.name}_{KV_COMPACT}", KV_COMPACT, 0))
    return out


def compile_model(mg, tp: int, out_dir: Path, target: str, args: dict[str, list[str]], jobs: int = 1) -> dict:
    """Lower every graph of one model to out_dir/<graph>.hlo and compile each with neuronx-cc (`args`: role ->
    role_flags) into out_dir/<graph>.neff (at most `jobs` compiler processes at once); returns the per-graph
    backend info (graph name, or kv_move / kv_compact, -> fields)."""
    from .xla_internals import XlaCollectives, lower_graph

    if shutil.which(COMPILER) is None:
        raise UserError(f"the NEFF generation of backend neuron compiles with the `{COMPILER}` command, which is not "
                        "on PATH; install the Neuron SDK's neuronx-cc (2.32 +) into this environment")
    out_dir = Path(out_dir)
    comm, info, commands = XlaCollectives(tp), {}, []
    for name, key, i in units(mg):
        lowered = lower_graph(key_module(mg, key, comm=comm), mg.examples(key)[i], tp)
        (out_dir / f"{name}.hlo").write_bytes(lowered.proto)
        argv = compile_argv(name, target, args[key_role(key)])
        commands.append((name, argv))
        info[key if key in (KV_MOVE, KV_COMPACT) else name] = {
            "format": NEFF_FORMAT, "generation": NEFF_GENERATION, "neff": f"{name}.neff", "hlo": f"{name}.hlo",
            "compiler_command": argv, "key": key, "bucket_index": i, "neff_inputs": [
                {"name": f"input{k}", **p} for k, p in enumerate(lowered.parameters)],
            "neff_outputs": [{"name": f"output{j}", "index": j} for j in range(lowered.n_outputs)],
            "state_output": f"output{lowered.n_outputs - 1}"}
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        list(pool.map(lambda c: _run(c[0], c[1], out_dir), commands))
    return info


def _run(name: str, argv: list[str], cwd: Path) -> None:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0 or not (cwd / f"{name}.neff").is_file():
        out = (done.stdout + done.stderr).strip()[-LOG_TAIL:]
        raise RuntimeError(f"{shlex.join(argv)} exited {done.returncode} for graph {name}: {out or 'no output'}")



def _bound(fields: dict, inputs: list[str], outputs: list[str], prefix: str) -> dict:
    """One NEFF's manifest fields: paths inside the bundle, each step input named (`inputs`, after the rank),
    each output named (`outputs`; the last NEFF output is the KV state, any between them unused)."""
    out = dict(fields, neff=prefix + fields["neff"], hlo=prefix + fields["hlo"])
    out["neff_inputs"] = [dict({k: v for k, v in p.items() if k != "index"}, input=inputs[p["index"]])
                          if p["binds"] == "input" else p for p in fields["neff_inputs"]]
    last = len(fields["neff_outputs"]) - 1
    out["neff_outputs"] = [{"name": o["name"], "binds": "state"} if o["index"] == last else
                           {"name": o["name"], "binds": "output", "output": outputs[o["index"]]}
                           if o["index"] < len(outputs) else {"name": o["name"], "binds": "unused"}
                           for o in fields["neff_outputs"]]
    return out


STATE_OP_INPUTS = {KV_MOVE: "src_dst", KV_COMPACT: "row_src_dst"}  # (eagle3_runtime/backends/neuron.py)


def entry_fields(info: dict, graph: str, inputs, outputs, prefix: str) -> dict:
    """GraphEntry.backend of one NEFF-generation graph (`inputs`, `outputs`: its manifest TensorSpecs, the rank
    first): its NEFF's fields, and its model's kv_move (and kv_compact) NEFFs' under `state_ops`."""
    ops = {op: _bound(info[op], [arg], [], prefix) for op, arg in STATE_OP_INPUTS.items() if op in info}
    return {**_bound(info[graph], [s.name for s in inputs[1:]], [s.name for s in outputs], prefix), "state_ops": ops}
