"""A stand-in Neuron SDK for tests, written from the real signatures and behaviour (docs/neuron-sdk-facts.md).

`neuronx_distributed.trace.model_builder.ModelBuilder(router, tp_degree, checkpoint_loader, ...,
logical_nc_config)`, `.add(key, model_instance, example_inputs, compiler_args, bucket_config,
priority_model_idx)`, `.trace(initialize_model_weights, dry_run, disable_fail_fast)` -> an executor with
`.nxd_model.initialize(per-rank weight dicts, start_rank int32)`, routed by input shapes, returning rank
0's outputs; `BaseModelInstance(module_cls, input_output_aliases)`;
`neuronx_distributed.parallel_layers.mappings` (reduce_from / gather_from_tensor_model_parallel_region);
`torch_neuronx.trace(func, example_inputs, *, input_output_aliases, compiler_workdir, compiler_args,
partitioner_config, inline_weights_to_neff, cpu_backend)` and `replace_weights`.

It refuses what the real stack refuses, or silently breaks on: alias keys that are not Parameters of
the traced module, a state passed as an input, a Parameter mutated in place, weights, states or output
counts that differ between keys, forward with *args, keys of different arity, two buckets with the
same input shapes, functional collectives (c10d_functional), checkpoints that lack a weight or have
the wrong shape, a NeuronCore already held by another process. It SIMULATES SPMD: every key is traced
once (rank 0: any Python-level rank is 0 there), then each rank replays that same graph with its own
weights and states in its own thread, collectives summing / gathering across the simulated ranks;
states stay with the model (never returned), updated from the aliased outputs.

The traced executor goes through the real `torch.jit.save` / `torch.jit.load` calls (patched for
this object only: a zip of TorchScript graphs without weights plus the routing table).
"""
from __future__ import annotations

import fcntl
import inspect
import io
import json
import os
import shutil
import sys
import threading
import types
import zipfile
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from eagle3_runtime.backends.neuron import routing_signature, visible_cores

VERSION = "0.0.0-standin"
CHECKS = ("aliases", "collectives", "weights")  # the old per-graph torch_neuronx.trace path (strict=...)

# ------------------------------------------------------------------ simulated collectives

_ctx = threading.local()  # .spmd: the running Rendezvous (replay), .rank
_TP = {"size": None}  # the NxD parallel state while ModelBuilder traces


class Rendezvous:
    """One SPMD call across `n` rank threads: each collective waits for every rank's tensor."""

    def __init__(self, n: int):
        self.n, self.cv, self.slots, self.gen, self.result = n, threading.Condition(), {}, 0, None
        self.failed = False

    def exchange(self, rank: int, x: torch.Tensor, combine) -> torch.Tensor:
        with self.cv:
            gen = self.gen
            self.slots[rank] = x
            if len(self.slots) == self.n:
                self.result = combine([self.slots[r] for r in range(self.n)])
                self.slots, self.gen = {}, self.gen + 1
                self.cv.notify_all()
            elif not self.cv.wait_for(lambda: self.gen != gen or self.failed, timeout=60):
                raise RuntimeError("stand-in SPMD: a collective timed out (ranks diverged)")
            if self.failed:
                raise RuntimeError("stand-in SPMD: another rank failed")
            return self.result.clone()


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    rv = getattr(_ctx, "spmd", None)
    return x.clone() if rv is None else rv.exchange(_ctx.rank, x, lambda xs: torch.stack(xs).sum(0).to(x.dtype))


def _all_gather_last(x: torch.Tensor, tp: int) -> torch.Tensor:
    rv = getattr(_ctx, "spmd", None)
    if rv is None:
        return torch.cat([x] * tp, dim=-1)
    return rv.exchange(_ctx.rank, x, lambda xs: torch.cat(xs, dim=-1))


_LIB = None


def _register_ops() -> None:
    global _LIB
    if _LIB is not None:
        return
    _LIB = torch.library.Library("nxd_standin", "DEF")
    _LIB.define("all_reduce(Tensor x) -> Tensor")
    _LIB.define("all_gather_last(Tensor x, int tp) -> Tensor")
    _LIB.impl("all_reduce", _all_reduce, "CPU")
    _LIB.impl("all_gather_last", _all_gather_last, "CPU")


def _tp_size() -> int:
    if _TP["size"] is None:
        raise AssertionError("tensor model parallel group is not initialized (NxD parallel_state): collectives "
                             "only exist inside ModelBuilder.trace()")
    return _TP["size"]


def reduce_from_tensor_model_parallel_region(input_, process_group=None):
    return input_ if _tp_size() == 1 else torch.ops.nxd_standin.all_reduce(input_)


def gather_from_tensor_model_parallel_region(input_, process_group=None):
    tp = _tp_size()
    return input_ if tp == 1 else torch.ops.nxd_standin.all_gather_last(input_, tp)


# ------------------------------------------------------------------ the Neuron runtime's cores

_HELD: dict[int, int] = {}  # core -> fd, this process


def claim_cores(n: int) -> list[int]:
    """The Neuron runtime gives every visible NeuronCore to the first process that loads a model."""
    total = int(os.environ.get("NEURON_RT_NUM_CORES", "8"))
    spec = os.environ.get("NEURON_RT_VISIBLE_CORES")
    if spec:
        visible = visible_cores(spec)
    else:
        visible = list(range(total))
    if n > len(visible):
        raise RuntimeError(f"NRT: {n} NeuronCores requested, {len(visible)} visible")
    devdir = Path(os.environ.get("NEURON_STANDIN_DEVICE_DIR", "/tmp/neuron-standin-cores"))
    devdir.mkdir(parents=True, exist_ok=True)
    for core in visible:
        if core in _HELD:
            continue
        fd = os.open(devdir / f"nc{core}.lock", os.O_CREAT | os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(f"NRT: NeuronCore {core} is in use by another process (pid holding "
                               f"{devdir}/nc{core}.lock); the Neuron runtime gives every visible core to one process")
        _HELD[core] = fd
    return visible[:n]


# ------------------------------------------------------------------ checks

class _OpRecorder(TorchDispatchMode):
    """The ops a call runs and the tensors they read (by identity: which Parameters a graph uses)."""

    def __init__(self):
        super().__init__()
        self.ops, self.tensors = set(), set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func))
        self.tensors.update(id(a) for a in torch.utils._pytree.tree_leaves((args, kwargs or {}))
                            if isinstance(a, torch.Tensor))
        return func(*args, **(kwargs or {}))


COMPILES = {"running": 0, "most": 0, "calls": 0}  # neuronx-cc jobs at once in this process (the stand-in's)
_COMPILES_LOCK = threading.Lock()


def neuron_xla_compile(module_bytes, compiler_flags, input_format="hlo", platform_target=None, cache_key=None,
                       retry_failed_compilation=False, lazy=True, use_cache=True, cache_dir=None, work_dir=None,
                       create_subdir=True):
    """libneuronxla.neuron_xla_compile: one neuronx-cc job; returns the NEFF's bytes."""
    import time

    with _COMPILES_LOCK:
        COMPILES["running"] += 1
        COMPILES["calls"] += 1
        COMPILES["most"] = max(COMPILES["most"], COMPILES["running"])
    try:
        time.sleep(0.02)  # a job takes time: concurrent ones overlap
        return b"NEFF stand-in " + module_bytes
    finally:
        with _COMPILES_LOCK:
            COMPILES["running"] -= 1


def check_aliases(func, example_inputs, aliases) -> None:
    if not aliases:
        return
    if not isinstance(func, torch.nn.Module):
        raise ValueError("input_output_aliases needs func to be a torch.nn.Module (its Parameters are the state)")
    params = list(func.parameters())
    for key, index in aliases.items():
        if any(key is x for x in example_inputs):
            raise ValueError(f"input_output_aliases: the state tensor {list(key.shape)} is also an example input; "
                             "Neuron state lives on the device as a module Parameter and is never a call argument")
        if not any(key is p for p in params):
            raise ValueError(f"input_output_aliases: key {list(key.shape)} is not a Parameter of the traced module "
                             "(generate_hlo moves the module to the XLA device and back, which makes every Parameter a "
                             "new object: a dict made for an earlier bucket names Parameters the module no longer has; "
                             "build it in get(), once per bucket, as NxDI's DecoderModelInstance.get does)")
        if not isinstance(index, int):
            raise ValueError(f"input_output_aliases: output index {index!r} is not an int")


def check_no_functional_collectives(ops: set[str]) -> None:
    bad = sorted(op for op in ops if "c10d_functional" in op)
    if bad:
        raise ValueError(f"the graph calls {', '.join(bad)}: torch-xla lowers functional collectives without their "
                         "process group; reduce through NxD's parallel_layers.mappings (xm.all_reduce with the TP "
                         "replica groups)")


def check_collectives(func) -> None:
    """(old per-graph path) Read from the FX graphs inside `func`."""
    ops = {str(n.target) for m in func.modules() if isinstance(m, torch.fx.GraphModule)
           for n in m.graph.nodes if n.op == "call_function"}
    check_no_functional_collectives(ops)


def check_no_weights(func, aliases) -> None:
    states = {id(k) for k in aliases}
    weights = [p for p in func.parameters() if id(p) not in states] if isinstance(func, torch.nn.Module) else []
    if weights:
        nbytes = sum(p.numel() * p.element_size() for p in weights)
        raise ValueError(f"the traced function holds {len(weights)} weight tensors ({nbytes} bytes) of its own: every "
                         "graph file would carry a copy and, without move_trace_to_device, send it host->device on "
                         "every call; share one weight set across a model's graphs (ModelBuilder + nxd_model)")


def _signature_ok(module: torch.nn.Module) -> int:
    params = inspect.signature(module.forward).parameters.values()
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        raise NotImplementedError("Methods with *args or **kwargs are not supported. Please explicitly specify all "
                                  "parameters.")
    return len(params)


def _specs(named) -> dict[str, tuple[list[int], str]]:
    return {n: (list(t.shape), str(t.dtype)) for n, t in named}


# ------------------------------------------------------------------ torch_neuronx (old per-graph API)

class StandInNeuronx:
    """torch_neuronx: `trace` 'compiles' one graph with torch.jit.trace on CPU (placeholder NEFF in the
    workdir); with `strict`, it runs the named contract checks (CHECKS) one by one."""

    __version__ = VERSION

    def __init__(self, strict=()):
        self.calls = []
        self.strict = set(strict)
        assert self.strict <= set(CHECKS), self.strict

    def trace(self, func, example_inputs, *_, input_output_aliases={}, compiler_workdir=None, compiler_args=None,
              partitioner_config=None, inline_weights_to_neff=True, cpu_backend=False):
        if "aliases" in self.strict:
            check_aliases(func, example_inputs, input_output_aliases)
        if "collectives" in self.strict:
            check_collectives(func)
        if "weights" in self.strict:
            check_no_weights(func, input_output_aliases)
        outs = func(*[x.clone() for x in example_inputs])
        self.calls.append({"func": func, "inputs": example_inputs, "aliases": input_output_aliases,
                           "workdir": compiler_workdir, "args": compiler_args, "inline": inline_weights_to_neff,
                           "cpu_backend": cpu_backend, "n_outputs": len(outs)})
        traced = torch.jit.trace(func, tuple(x.clone() for x in example_inputs), check_trace=False, strict=False)
        Path(compiler_workdir, "graph.neff").write_bytes(b"NEFF stand-in")
        return traced

    @staticmethod
    def replace_weights(model, weights):
        claim_cores(1)  # loading a NEFF onto a core
        sd = model.state_dict()
        assert set(weights) <= set(sd), sorted(set(weights) - set(sd))[:3]
        with torch.no_grad():
            for k, v in weights.items():
                sd[k].copy_(v)


# ------------------------------------------------------------------ neuronx_distributed ModelBuilder

class BaseModelInstance:
    def __init__(self, module_cls, input_output_aliases):
        self.module_cls = module_cls
        self.module = None
        self.input_output_aliases = [input_output_aliases]

    def load_module(self):
        self.module = self.module_cls()

    def get(self, bucket_rank, **kwargs):
        return self.module, self.input_output_aliases[0]


class StandInModelBuilder:
    """neuronx_distributed.trace.model_builder.ModelBuilder (legacy, what NxDI builds with)."""

    instances: list = []  # every builder made in this process (tests read what was added)

    def __init__(self, router, tp_degree, checkpoint_loader, start_rank_id=0, pp_degree=1, ep_degree=1,
                 local_ranks_size=None, world_size=None, compiler_workdir=None, master_proc_env_vars=None,
                 debug=False, num_cores_per_group=1, init_custom_process_group_fn=None, logical_nc_config=1,
                 weights_to_skip_layout_optimization=set(), compiler_flag_hook=None):
        if world_size is None:
            world_size = tp_degree * pp_degree * ep_degree
        elif local_ranks_size is None:
            raise ValueError("`world_size` is specified, but `local_ranks_size` is None. Cannot determine "
                             "local_ranks_size.")
        self.tp_degree, self.world_size = int(tp_degree), world_size
        self.local_ranks_size = local_ranks_size or world_size
        self.start_rank_id, self.checkpoint_loader = start_rank_id, checkpoint_loader
        self.compiler_workdir = compiler_workdir or "/tmp/nxd_model/"
        self.logical_nc_config = logical_nc_config
        self.model_collection: dict[str, dict] = {}
        StandInModelBuilder.instances.append(self)

    def add(self, key, model_instance, example_inputs, compiler_args=None, bucket_config=None,
            priority_model_idx=None):
        if compiler_args is not None and not isinstance(compiler_args, str):
            raise TypeError(f"compiler_args must be a str (ModelBuilder appends default flags to it), got "
                            f"{type(compiler_args).__name__}")
        if not isinstance(example_inputs, list) or not all(isinstance(e, tuple) and e and
                                                           all(isinstance(t, torch.Tensor) for t in e)
                                                           for e in example_inputs):
            raise TypeError(f"{key}: example_inputs must be a list with one tuple of tensors per bucket")
        if priority_model_idx is not None and not 0 <= priority_model_idx < len(example_inputs):
            raise ValueError(f"{key}: priority_model_idx {priority_model_idx} outside its {len(example_inputs)} buckets")
        args = compiler_args or "--enable-saturate-infinity --auto-cast=none --model-type=transformer -O1"
        if "--verbose" not in args:
            args += " --verbose=35"
        self.model_collection[key] = {"instance": model_instance, "examples": example_inputs, "compiler_args": args,
                                      "priority": priority_model_idx}
        return self

    def trace(self, initialize_model_weights=True, dry_run=False, disable_fail_fast=False):
        if initialize_model_weights and self.local_ranks_size < self.world_size:
            raise RuntimeError("initialize_model_weights argument must be False when tracing for multi-node")
        if sum(c["priority"] is not None for c in self.model_collection.values()) > 1:
            raise ValueError("more than one key has a priority_model_idx: NxD optimises the weight layout for one "
                             "priority model")
        if os.path.exists(self.compiler_workdir):
            shutil.rmtree(self.compiler_workdir)  # (the real ModelBuilder does this)
        _register_ops()
        self.cwd = os.getcwd()  # where the layout step writes its temporary HLO files
        self.hlos, self.first, self.routes, self.arity = {}, None, {}, None
        _TP["size"] = self.tp_degree
        try:
            for key, c in self.model_collection.items():  # _generate_hlo: load_module once, get() per bucket
                c["instance"].load_module()
                for i, example in enumerate(c["examples"]):
                    module, aliases = c["instance"].get(i)
                    self.hlos[(key, i)] = self._generate_hlo(key, i, module, aliases, example)
                    _device_round_trip(module)
                if len(c["examples"]) == 1:  # generate_hlo(preserve_parameters=False): the weights are dropped
                    _throw_away_parameters(c["instance"].get(0)[0])
        finally:
            _TP["size"] = None
        self._optimize_layout()
        if dry_run:
            return None
        self._compile()
        return StandInExecutor(StandInNxDModel(self.hlos, self.first, self.tp_degree))

    def _generate_hlo(self, key: str, i: int, module, aliases: dict, example: tuple) -> dict:
        """torch_neuronx.xla_impl.trace.generate_hlo of one bucket, with the checks the real stack makes (or
        silently needs): one arity, aliases naming the module's own Parameters, no state passed as an input,
        one route per input-shape list, no in-place state update, key #1's weights / states / outputs."""
        n_args = _signature_ok(module)
        if self.arity is None:
            self.arity = n_args
        if n_args != self.arity or len(example) != self.arity:
            raise ValueError(f"{key} bucket {i}: {len(example)} inputs, key #1 takes {self.arity}: NxD's executor "
                             "is traced with one example tuple, every key must take the same inputs")
        check_aliases(module, example, aliases)
        for x in example:
            if any(x.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() and p.numel()
                   for p in module.parameters()):
                raise ValueError(f"{key} bucket {i}: an example input shares storage with a module "
                                 "Parameter; state and weights live on the device, never as inputs")
        sig = routing_signature(example)
        if sig in self.routes:
            raise ValueError(f"{key} bucket {i} has the same input shapes {sig} as {self.routes[sig]}: NxD routes "
                             "by input shapes alone and the later one would silently replace it")
        self.routes[sig] = f"{key} bucket {i}"
        states = {id(k) for k in aliases}
        named = list(module.named_parameters())
        weights = _specs((n, p) for n, p in named if id(p) not in states)
        state_specs = _specs((n, p) for n, p in named if id(p) in states)
        versions = {n: p._version for n, p in named}
        rec = _OpRecorder()
        with torch.no_grad(), rec:
            outs = module(*example)
        check_no_functional_collectives(rec.ops)
        mutated = [n for n, p in named if p._version != versions[n]]
        if mutated:
            raise ValueError(f"{key} bucket {i}: Parameter(s) {mutated[:3]} mutated in place; a Neuron "
                             "state is updated functionally and returned as its aliased output")
        outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
        if any(not 0 <= idx < len(outs) for idx in aliases.values()):
            raise ValueError(f"{key} bucket {i}: an alias points past the {len(outs)} outputs")
        for p, idx in aliases.items():
            if list(outs[idx].shape) != list(p.shape) or outs[idx].dtype != p.dtype:
                raise ValueError(f"{key} bucket {i}: output {idx} {list(outs[idx].shape)} {outs[idx].dtype} "
                                 f"cannot update state {list(p.shape)} {p.dtype}")
        this = {"weights": weights, "states": state_specs, "n_user": len(outs) - len(aliases)}
        self.first = self.first or this
        for what in ("weights", "states", "n_user"):
            if this[what] != self.first[what]:
                raise ValueError(f"{key} bucket {i}: its {what} differ from key #1 bucket 0's; NxD shards, "
                                 "initialises states and packs outputs with key #1's")
        with torch.no_grad():
            traced = torch.jit.trace(module, example, check_trace=False, strict=False)
        names = {id(p): n for n, p in named}
        return {"traced": traced, "route": sig, "dtypes": [str(x.dtype) for x in example],
                "aliases": {names[id(p)]: idx for p, idx in aliases.items()},
                "reads": {n for n, p in named if id(p) in rec.tensors and id(p) not in states}}

    def _optimize_layout(self) -> None:
        """Weight-layout optimisation (WLO): the priority bucket's HLO marks the weights it reads, their
        suggested layout is applied to every other HLO and a layout-transform NEFF changes them at load. A
        weight the priority HLO does not read keeps its checkpoint layout everywhere (`unoptimized`). The real
        step writes `<key>_<bucket>.hlo` / `_optimized.hlo` into the CURRENT directory and removes them
        (model_builder.py _add_layout_optimization_to_remaining_hlo): a second builder in the same directory
        would overwrite or delete the first one's files, so this refuses a file that is already there."""
        prio = [(key, c["priority"]) for key, c in self.model_collection.items() if c["priority"] is not None]
        self.layout_weights, self.unoptimized = set(), {}
        if not prio:
            return
        self.layout_weights = self.hlos[prio[0]]["reads"]
        for (key, i), h in self.hlos.items():
            for w in sorted(h["reads"] - self.layout_weights):
                self.unoptimized.setdefault(w, []).append(f"{key} bucket {i}")
        for (key, i) in self.hlos:
            if (key, i) == prio[0]:
                continue
            files = [Path(f"{key}_{i}.hlo"), Path(f"{key}_{i}_optimized.hlo")]
            for f in files:
                if f.exists():
                    raise RuntimeError(f"{Path.cwd() / f} already exists: another ModelBuilder optimises weight layout "
                                       "in this working directory and one would overwrite or remove the other's HLO")
                f.write_bytes(b"HLO stand-in")
            for f in files:
                f.unlink()

    def _compile(self) -> None:
        """The priority bucket first, then every other bucket through an unbounded ThreadPoolExecutor calling
        the module-level `neuron_xla_compile` (model_builder.py trace(), NxD 0.16-0.18)."""
        import concurrent.futures

        compile_fn = sys.modules["neuronx_distributed.trace.model_builder"].neuron_xla_compile
        jobs = {}
        with concurrent.futures.ThreadPoolExecutor() as pool:
            for key, c in self.model_collection.items():
                for i in range(len(c["examples"])):
                    bucket_dir = Path(self.compiler_workdir, key, f"_tp0_bk{i}")
                    bucket_dir.mkdir(parents=True, exist_ok=True)
                    args = c["compiler_args"] + f" --logfile={bucket_dir / 'log-neuron-cc.txt'}"
                    c.setdefault("bucket_args", []).append(args)
                    if i == c["priority"]:
                        (bucket_dir / "graph.neff").write_bytes(f"NEFF stand-in {key} {i}".encode())
                        continue
                    jobs[pool.submit(compile_fn, module_bytes=f"{key} {i}".encode(), compiler_flags=args,
                                     input_format="hlo", platform_target="trn2", cache_key=f"{key}_{i}",
                                     retry_failed_compilation=False, lazy=True, use_cache=True, cache_dir=None,
                                     work_dir=bucket_dir.absolute(), create_subdir=False)] = bucket_dir
            for fut in concurrent.futures.as_completed(jobs):
                (jobs[fut] / "graph.neff").write_bytes(fut.result())

    def shard_checkpoint(self, serialize_path=None):
        raise NotImplementedError("stand-in: ModelBuilder.shard_checkpoint is not used by eagle3-build")


class StandInNxDModel:
    """The scripted NxDModel: per-rank weights and states, routing, SPMD replay."""

    def __init__(self, graphs: dict, first: dict, tp: int):
        self.graphs, self.spec, self.tp = graphs, first, tp
        self.initialized = False
        self.weights: list[dict] = []
        self.state: list[dict] = []
        self.replicas: dict = {}
        self.calls = 0

    # (what torch.jit.save keeps: graphs without weights)
    def to_zip(self, f) -> None:
        meta = {"tp": self.tp, "spec": self.spec, "graphs": []}
        with zipfile.ZipFile(f, "w") as z:
            for (key, i), g in self.graphs.items():
                buf = io.BytesIO()
                torch.jit.save(_strip(g["traced"], self.spec), buf)
                z.writestr(f"graphs/{key}_{i}.pt", buf.getvalue())
                meta["graphs"].append({"key": key, "bucket": i, "route": g["route"], "dtypes": g["dtypes"],
                                       "aliases": g["aliases"]})
            z.writestr("standin_nxd.json", json.dumps(meta))

    @classmethod
    def from_zip(cls, z: zipfile.ZipFile) -> "StandInNxDModel":
        meta = json.loads(z.read("standin_nxd.json"))
        graphs = {}
        for g in meta["graphs"]:
            graphs[(g["key"], g["bucket"])] = dict(g, blob=z.read(f"graphs/{g['key']}_{g['bucket']}.pt"))
        spec = {k: ({n: (list(v[0]), v[1]) for n, v in meta["spec"][k].items()} if isinstance(meta["spec"][k], dict)
                    else meta["spec"][k]) for k in meta["spec"]}
        return cls(graphs, spec, meta["tp"])

    def initialize(self, checkpoint, start_rank_tensor):
        if not isinstance(start_rank_tensor, torch.Tensor):
            raise TypeError("start_rank_tensor must be a tensor (torch.tensor([start_rank], dtype=torch.int32))")
        if len(checkpoint) != self.tp:
            raise ValueError(f"initialize: {len(checkpoint)} per-rank checkpoints for {self.tp} local ranks")
        for r, sd in enumerate(checkpoint):
            missing = sorted(set(self.spec["weights"]) - set(sd))
            extra = sorted(set(sd) - set(self.spec["weights"]))
            if missing or extra:
                raise KeyError(f"rank {r} checkpoint: missing {missing[:3]}, unexpected {extra[:3]} (the traced "
                               "module's weight names are the checkpoint keys)")
            for n, (shape, dtype) in self.spec["weights"].items():
                if list(sd[n].shape) != shape or str(sd[n].dtype) != dtype:
                    raise RuntimeError(f"expected shape {shape} {dtype} for {n} but found {list(sd[n].shape)} "
                                       f"{sd[n].dtype}")
        claim_cores(self.tp)
        self.weights = [dict(sd) for sd in checkpoint]
        self.state = [{n: torch.zeros(shape, dtype=getattr(torch, dtype.removeprefix("torch.")))
                       for n, (shape, dtype) in self.spec["states"].items()} for _ in range(self.tp)]
        self.replicas = {}
        for k, g in self.graphs.items():
            blob = g.get("blob")
            if blob is None:
                buf = io.BytesIO()
                torch.jit.save(_strip(g["traced"], self.spec), buf)
                blob = buf.getvalue()
            copies = []
            for r in range(self.tp):
                m = torch.jit.load(io.BytesIO(blob))
                for n, t in {**self.weights[r], **self.state[r]}.items():
                    _set(m, n, t)
                copies.append(m)
            self.replicas[k] = copies
        self.initialized = True

    def initialize_with_saved_weights(self, start_rank_tensor):
        raise ValueError("stand-in: this model was traced with initialize_model_weights=False; call initialize()")

    def forward(self, inputs):
        if not self.initialized:
            raise ValueError("This model is not initialized, please call traced_model.nxd_model.initialize("
                             "sharded_checkpoint) or traced_model.nxd_model.initialize_with_saved_weights()")
        if any(not isinstance(x, torch.Tensor) for x in inputs):
            raise TypeError("NxDModel takes positional tensors only")
        sig = routing_signature(inputs)
        match = [k for k, g in self.graphs.items() if g["route"] == sig]
        if not match:
            raise ValueError(f"Input shape {sig} not found in input_shape_map: {[g['route'] for g in self.graphs.values()]}")
        key = match[0]
        g = self.graphs[key]
        got = [str(x.dtype) for x in inputs]
        if got != g["dtypes"]:
            raise TypeError(f"{key}: inputs of dtypes {got}, the graph was compiled for {g['dtypes']}")
        self.calls += 1
        rv, outs, errors = Rendezvous(self.tp), [None] * self.tp, []

        def run(r):
            _ctx.spmd, _ctx.rank = rv, r
            try:
                with torch.no_grad():
                    outs[r] = self.replicas[key][r](*[x.clone() for x in inputs])
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                with rv.cv:
                    rv.failed = True
                    rv.cv.notify_all()
            finally:
                _ctx.spmd = None

        threads = [threading.Thread(target=run, args=(r,)) for r in range(self.tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        aliased = set(g["aliases"].values())
        for r in range(self.tp):
            out = outs[r] if isinstance(outs[r], tuple) else (outs[r],)
            for n, idx in g["aliases"].items():
                self.state[r][n].copy_(out[idx])
        out0 = outs[0] if isinstance(outs[0], tuple) else (outs[0],)
        return tuple(x for i, x in enumerate(out0) if i not in aliased)


def _set(module, dotted: str, tensor: torch.Tensor) -> None:
    *path, leaf = dotted.split(".")
    for p in path:
        module = getattr(module, p)
    setattr(module, leaf, tensor)


def _throw_away_parameters(module) -> None:
    """What ModelBuilder does after tracing a key with one bucket ("Memory optimization: Throw away weights if
    only one bucket is used", preserve_parameters=False): the module's Parameters lose their data, so a key
    traced later over the same Parameter objects fails, as it would on the real SDK."""
    for p in module.parameters():
        p.data = torch.zeros(0, dtype=p.dtype)


def _device_round_trip(module) -> None:
    """What generate_hlo does to the traced module: moves it to the XLA device and back (torch-neuronx
    xla_impl/trace.py `revert_device_placement` -> placement.move -> Module.to). CPU and XLA tensors are not
    shallow-copy compatible, so Module._apply makes every Parameter a NEW Parameter object each way: an
    input_output_aliases dict made before this names Parameters the module no longer has (NxDI builds one
    per bucket for that reason: DecoderModelInstance.get, "otherwise it will fail the aliasing setup").
    The data is shared here (the real one copies it; only the objects matter to the alias check)."""
    made: dict[int, torch.nn.Parameter] = {}
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[name] = made.setdefault(id(p), torch.nn.Parameter(p.data, requires_grad=p.requires_grad))


def _strip(traced, spec: dict):
    """A copy of a traced graph without its weights and states (what the saved NxD model holds)."""
    buf = io.BytesIO()
    torch.jit.save(traced, buf)
    buf.seek(0)
    m = torch.jit.load(buf)
    for n, (shape, dtype) in {**spec["weights"], **spec["states"]}.items():
        _set(m, n, torch.zeros(0, dtype=getattr(torch, dtype.removeprefix("torch."))))
    return m


class StandInExecutor:
    """NxDModelExecutor: `traced(*inputs)` -> `nxd_model(list(inputs))`."""

    def __init__(self, nxd_model: StandInNxDModel):
        self.nxd_model = nxd_model

    def __call__(self, *inputs):
        return self.nxd_model.forward(list(inputs))


# ------------------------------------------------------------------ installing it

class StandInModelBuilder016(StandInModelBuilder):
    """NxD 0.16's (SDK 2.27) ModelBuilder: its `trace()` has no `disable_fail_fast`."""

    def trace(self, initialize_model_weights=True, dry_run=False):
        return super().trace(initialize_model_weights, dry_run)


def builder_class(release: str):
    return StandInModelBuilder016 if release.startswith("2.27.") else StandInModelBuilder


# ------------------------------------------------------------------ the SDK as pip lays it out

MODULES = {"torch-neuronx": "torch_neuronx", "neuronx-cc": "neuronxcc", "libneuronxla": "libneuronxla",
           "neuronx-distributed": "neuronx_distributed", "neuronx-distributed-inference": "neuronx_distributed_inference"}


def release_versions(release: str, *, torch: str = "2.9") -> dict[str, str]:
    """pip name -> the version of each SDK package in `release` (its torch-neuronx for `torch`; the 2.x libneuronxla)."""
    from eagle3_build.backends.neuron.releases import RELEASES

    row = RELEASES[release]
    pick = {"torch-neuronx": lambda v: v.startswith(torch + "."), "libneuronxla": lambda v: v.startswith("2.")}
    return {pip: next(v for v in reversed(row[pip]) if pick.get(pip, lambda v: True)(v)) for pip in MODULES}


def source_version(pip: str, wheel: str) -> str | None:
    """The `__version__` a package's own source declares: NxD and NxD Inference write major.minor.0 in
    _version.py and their setup.py builds the wheel's patch from VERSION_PATCH (neuronx-distributed v2.27.0:
    "0.16.0" for wheel 0.16.25997); libneuronxla declares none (the issue's report); torch-neuronx's public
    copy (1.13) declares its wheel version."""
    if pip in ("neuronx-distributed", "neuronx-distributed-inference"):
        return ".".join(wheel.split(".")[:2]) + ".0"
    return None if pip == "libneuronxla" else wheel


def lay_out_sdk(site: Path, versions: dict[str, str], *, modules: bool = True, summary: str = "") -> Path:
    """`site` as `pip install` leaves it: one <name>-<version>.dist-info per distribution (METADATA, INSTALLER,
    RECORD, top_level.txt) and, with `modules`, each package's __init__.py with its source's __version__."""
    site.mkdir(parents=True, exist_ok=True)
    for pip, version in versions.items():
        mod = MODULES[pip]
        files = []
        if modules:
            pkg = site / mod
            pkg.mkdir(exist_ok=True)
            declared = source_version(pip, version)
            (pkg / "__init__.py").write_text("" if declared is None else f"__version__ = {declared!r}\n")
            files.append(f"{mod}/__init__.py")
        info = site / f"{pip.replace('-', '_')}-{version}.dist-info"  # (pip: the project name, normalised)
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {pip}\nVersion: {version}\n"
                                       f"Summary: {summary or 'AWS Neuron SDK package'}\n\n")
        (info / "INSTALLER").write_text("pip\n")
        (info / "top_level.txt").write_text(mod + "\n")
        files += [f"{info.name}/{n}" for n in ("METADATA", "INSTALLER", "top_level.txt", "RECORD")]
        (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))
    return site


def install(monkeypatch, tmp: Path, neuronx=None, release: str | None = None, versions: dict | None = None
            ) -> StandInNeuronx:
    """Put the stand-in where `import torch_neuronx` / `neuronx_distributed` find it and its distributions'
    metadata where importlib.metadata does (a site directory under `tmp`, as pip lays a release out: `release`,
    default the newest the table knows, or `versions` pip name -> version); ModelBuilder has that release's
    `trace` signature; torch.jit.save / load handle its executor; NeuronCore locks live under `tmp`."""
    from eagle3_build.backends.neuron.releases import NEWEST

    release = release or NEWEST
    versions = versions or release_versions(release)
    site = lay_out_sdk(Path(tmp) / "site-packages", versions, modules=False)
    monkeypatch.syspath_prepend(str(site))
    neuronx = neuronx or StandInNeuronx()
    mod = types.ModuleType("torch_neuronx")
    mod.__version__, mod.trace, mod.replace_weights = versions["torch-neuronx"], neuronx.trace, neuronx.replace_weights
    monkeypatch.setitem(sys.modules, "torch_neuronx", mod)
    for name in ("neuronxcc", "libneuronxla"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    nxd = types.ModuleType("neuronx_distributed")
    nxd.__version__ = source_version("neuronx-distributed", versions["neuronx-distributed"])
    trace_pkg, mb = types.ModuleType("neuronx_distributed.trace"), types.ModuleType("neuronx_distributed.trace.model_builder")
    mb.ModelBuilder, mb.BaseModelInstance = builder_class(release), BaseModelInstance
    mb.neuron_xla_compile = neuron_xla_compile  # (from libneuronxla import neuron_xla_compile, as the real one)
    layers_pkg = types.ModuleType("neuronx_distributed.parallel_layers")
    mappings = types.ModuleType("neuronx_distributed.parallel_layers.mappings")
    mappings.reduce_from_tensor_model_parallel_region = reduce_from_tensor_model_parallel_region
    mappings.gather_from_tensor_model_parallel_region = gather_from_tensor_model_parallel_region
    nxd.trace, trace_pkg.model_builder, nxd.parallel_layers, layers_pkg.mappings = trace_pkg, mb, layers_pkg, mappings
    for name, m in [("neuronx_distributed", nxd), ("neuronx_distributed.trace", trace_pkg),
                    ("neuronx_distributed.trace.model_builder", mb), ("neuronx_distributed.parallel_layers", layers_pkg),
                    ("neuronx_distributed.parallel_layers.mappings", mappings)]:
        monkeypatch.setitem(sys.modules, name, m)
    real_save, real_load = torch.jit.save, torch.jit.load

    def save(m, f, *a, **kw):
        if isinstance(m, StandInExecutor):
            return m.nxd_model.to_zip(f)
        return real_save(m, f, *a, **kw)

    def load(f, *a, **kw):
        data = f.getvalue() if isinstance(f, io.BytesIO) else Path(f).read_bytes()
        if data[:2] == b"PK":
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                if "standin_nxd.json" in z.namelist():
                    return StandInExecutor(StandInNxDModel.from_zip(z))
        return real_load(io.BytesIO(data) if isinstance(f, io.BytesIO) else f, *a, **kw)

    monkeypatch.setattr(torch.jit, "save", save)
    monkeypatch.setattr(torch.jit, "load", load)
    monkeypatch.setenv("NEURON_STANDIN_DEVICE_DIR", str(Path(tmp) / "neuron-cores"))
    StandInModelBuilder.instances.clear()
    COMPILES.update(running=0, most=0, calls=0)
    return neuronx


@pytest.fixture
def standin_sdk(monkeypatch, tmp_path):
    neuronx = StandInNeuronx()
    install(monkeypatch, tmp_path / "standin-sdk", neuronx)
    monkeypatch.setenv("NEURON_RT_NUM_CORES", "8")
    return neuronx
