"""A stand-in `nrtpy` (Neuron SDK 2.32's runtime bindings, neuron-runtime/nrtpy/*.rst), for tests: `install_nrtpy`
makes `import nrtpy` find this module and lays out its distribution's metadata.

The documented API: `configure(visible_cores=None)` (only while the runtime is not active; TypeError for an int,
ValueError for a negative core), `reset()`; `NrtpyTensor(tensor_ref, shape, dtype, name=None)` with
`from_numpy(array, name=None, core_id=0)`, `write_from_numpy`, `numpy()`, `.shape`, `.dtype`, `.name`;
`NrtpyModel.load_from_neff(neff_path, name=None, core_id=0, cc_enabled=False, rank_id=0, world_size=1)` with
`input_tensors_info` / `output_tensors_info` and `__call__(inputs, outputs=None, save_trace=False,
ntff_name=None)` (the outputs returned only when none are given).

A simulated process is a thread: each thread's runtime singleton claims its visible cores when it becomes active
(a core another runtime holds is refused, as the Neuron runtime gives every visible core to one process), and a
rank is bound to the core its first model is loaded on (a core serving two ranks is refused). On every load:
the NEFF is the neuronx-cc stand-in's (tests/neuronx_cc_standin.py); core_id is a visible core; 0 <= rank_id <
world_size; world_size > 1 needs cc_enabled; a NEFF with collectives needs world_size > 1. On every call: the
input names are exactly the NEFF's, each tensor's shape and dtype its input's, on the model's core; given
outputs name every NEFF output with its shape and dtype; an aliased output is the very tensor passed as the
input it aliases (how the runtime keeps the KV cache on the device [inferred]).

Execution: at world_size 1 the NEFF's HLO really runs, on CPU, through torch-xla (`computation_from_module_proto`
+ `_xla_user_computation`): the outputs are the graph's. At world_size > 1 the HLO holds collectives over the
ranks, which one CPU device cannot run; each call waits for every rank's call of the same NEFF (a collective
NEFF blocks until its group joins, as on the device) and then an ORACLE answers: every output is zeros and the
aliased state keeps its contents. Only the contract (names, shapes, dtypes, aliasing, cores, ranks) is
checked at TP > 1, not the numbers.
"""
from __future__ import annotations

import json
import sys
import threading
import zipfile
from pathlib import Path

import numpy as np

VERSION = "2.34.10"

_held: dict[int, int] = {}  # core -> the thread ident of the runtime that holds it
_lock = threading.Lock()
_local = threading.local()  # .visible (configured cores or None), .active (claimed cores), .rank_of_core
_groups: dict[tuple, "Group"] = {}  # (neff sha, world size) -> the ranks' rendezvous


class NrtpyError(RuntimeError):
    pass


def configure(visible_cores=None) -> None:
    if getattr(_local, "active", None):
        raise RuntimeError("nrtpy.configure: the runtime is already active; call nrtpy.reset() first")
    if visible_cores is None:
        return
    if isinstance(visible_cores, int):
        raise TypeError("visible_cores must be an iterable of core ids, not an int")
    cores = list(visible_cores)
    if any(not isinstance(c, int) for c in cores):
        raise TypeError("visible_cores must hold integers")
    if any(c < 0 for c in cores):
        raise ValueError("core ids must be >= 0")
    _local.visible = cores


def reset() -> None:
    with _lock:
        for c in getattr(_local, "active", None) or []:
            _held.pop(c, None)
    _local.active, _local.visible, _local.rank_of_core = None, None, {}


def _runtime() -> list[int]:
    """This simulated process's visible cores, claimed on first use."""
    if not getattr(_local, "active", None):
        cores = getattr(_local, "visible", None) or [0]
        me = threading.get_ident()
        with _lock:
            taken = [c for c in cores if _held.get(c, me) != me]
            if taken:
                raise NrtpyError(f"NeuronCore(s) {taken} are held by another process (NRT_RESOURCE)")
            _held.update({c: me for c in cores})
        _local.active, _local.rank_of_core = cores, {}
    return _local.active


def _core(core_id: int) -> int:
    cores = _runtime()
    if not 0 <= core_id < len(cores):
        raise NrtpyError(f"core_id {core_id} is not a visible NeuronCore (visible: {cores})")
    return cores[core_id]


class TensorMetadata:
    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.size = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


class NrtpyTensor:
    def __init__(self, tensor_ref, shape, dtype, name=None):
        self._ref, self.shape, self.dtype, self.name = tensor_ref, (shape,) if isinstance(shape, int) else tuple(shape), \
            np.dtype(dtype), name

    @classmethod
    def from_numpy(cls, array, name=None, core_id=0):
        if not isinstance(array, np.ndarray):
            raise TypeError(f"from_numpy takes a numpy.ndarray, not {type(array).__name__}")
        ref = {"data": np.array(array, order="C"), "core": _core(core_id)}  # (0-d stays 0-d)
        return cls(ref, array.shape, array.dtype, name)

    def write_from_numpy(self, array) -> None:
        array = np.array(array, order="C")
        if array.nbytes != self._ref["data"].nbytes:
            raise ValueError(f"write_from_numpy: {array.nbytes} bytes into a {self._ref['data'].nbytes}-byte tensor")
        self._ref["data"] = array.view(self.dtype).reshape(self.shape).copy()

    def numpy(self):
        return self._ref["data"].copy()


def _hlo_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype("bool" if name == "bool" else name)


class Group:
    """The ranks of one collective NEFF: a call returns when every rank has called."""

    def __init__(self, n: int):
        self.n, self.cv, self.arrived, self.gen = n, threading.Condition(), 0, 0

    def join(self) -> None:
        with self.cv:
            gen = self.gen
            self.arrived += 1
            if self.arrived == self.n:
                self.arrived, self.gen = 0, self.gen + 1
                self.cv.notify_all()
            elif not self.cv.wait_for(lambda: self.gen != gen, timeout=60):
                raise NrtpyError("a collective NEFF waited 60 s for the other ranks of its group")


class NrtpyModel:
    def __init__(self, meta: dict, hlo: bytes, name: str, core: int, cc_enabled: bool, rank_id: int, world_size: int):
        self.meta, self.hlo, self.name, self.core = meta, hlo, name, core
        self.cc_enabled, self.rank_id, self.world_size = cc_enabled, rank_id, world_size
        self.input_tensors_info = {p["name"]: TensorMetadata(p["shape"], _hlo_dtype(p["dtype"])) for p in meta["inputs"]}
        self.output_tensors_info = {p["name"]: TensorMetadata(p["shape"], _hlo_dtype(p["dtype"])) for p in meta["outputs"]}
        self.aliases = {a["output"]: a["input"] for a in meta["aliases"]}
        self.calls = 0
        self._computation = None

    @classmethod
    def load_from_neff(cls, neff_path, name=None, core_id=0, cc_enabled=False, rank_id=0, world_size=1):
        path = Path(neff_path)
        try:
            with zipfile.ZipFile(path) as z:
                meta, hlo = json.loads(z.read("neff.json")), z.read("graph.hlo")
        except (OSError, KeyError, zipfile.BadZipFile) as e:
            raise NrtpyError(f"{path}: not a NEFF ({e})") from e
        if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank_id, int)
                and 0 <= rank_id < world_size):
            raise NrtpyError(f"rank_id {rank_id} is outside a collective group of world_size {world_size}")
        if world_size > 1 and not cc_enabled:
            raise NrtpyError(f"world_size {world_size} needs cc_enabled=True")
        if meta["collectives"] and world_size == 1:
            raise NrtpyError(f"{path.name} holds collectives ({', '.join(meta['collectives'])}) and was loaded with "
                             "world_size 1")
        core = _core(core_id)
        bound = _local.rank_of_core.setdefault(core, rank_id)
        if bound != rank_id:
            raise NrtpyError(f"NeuronCore {core} already serves rank {bound}; rank {rank_id} needs its own core")
        return cls(meta, hlo, name or path.stem, core, cc_enabled, rank_id, world_size)

    def _check(self, kind: str, given: dict, info: dict) -> None:
        if not isinstance(given, dict) or set(given) != set(info):
            missing, extra = sorted(set(info) - set(given or {})), sorted(set(given or {}) - set(info))
            raise NrtpyError(f"{self.name}: {kind} names differ from the NEFF's (missing {missing}, unknown {extra})")
        for n, t in given.items():
            if not isinstance(t, NrtpyTensor):
                raise TypeError(f"{self.name}: {kind} {n} is a {type(t).__name__}, not an NrtpyTensor")
            want = info[n]
            if tuple(t.shape) != want.shape or t.dtype != want.dtype:
                raise NrtpyError(f"{self.name}: {kind} {n} is {t.dtype}{list(t.shape)}, the NEFF takes "
                                 f"{want.dtype}{list(want.shape)}")
            if t._ref["core"] != self.core:
                raise NrtpyError(f"{self.name}: {kind} {n} lives on NeuronCore {t._ref['core']}, the model on {self.core}")

    def __call__(self, inputs, outputs=None, save_trace=False, ntff_name=None):
        self._check("input", inputs, self.input_tensors_info)
        if outputs is not None:
            self._check("output", outputs, self.output_tensors_info)
            for out, inp in self.aliases.items():
                if outputs[out] is not inputs[inp]:
                    raise NrtpyError(f"{self.name}: output {out} aliases input {inp}; pass the same tensor as both")
        self.calls += 1
        if self.world_size > 1:
            key = (self.meta["hlo_sha256"], self.world_size)
            with _lock:
                group = _groups.setdefault(key, Group(self.world_size))
            group.join()
            results = [np.zeros(i.shape, i.dtype) if o not in self.aliases else inputs[self.aliases[o]].numpy()
                       for o, i in self.output_tensors_info.items()]
        else:
            results = self._execute([inputs[p["name"]].numpy() for p in self.meta["inputs"]])
        made = {}
        for (o, info), value in zip(self.output_tensors_info.items(), results):
            if outputs is not None:
                outputs[o]._ref["data"] = np.array(value, dtype=info.dtype, order="C").reshape(info.shape)
            else:
                made[o] = NrtpyTensor({"data": np.asarray(value, info.dtype).reshape(info.shape), "core": self.core},
                                      info.shape, info.dtype, o)
        return None if outputs is not None else made

    def _execute(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """The HLO run on torch-xla's CPU device."""
        import torch
        import torch_xla
        import torch_xla.core.xla_builder as xb

        if self._computation is None:
            self._computation = xb.computation_from_module_proto(f"neff_{id(self)}", self.hlo)
        dev = torch_xla.device()
        xs = [_torch(a).to(dev) for a in arrays]
        out = torch_xla._XLAC._xla_user_computation(f"xla::neff_{id(self)}", xs, self._computation)
        return [_numpy(t.cpu()) for t in out]


def _torch(a: np.ndarray):
    import torch

    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _numpy(t):
    import torch

    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def install_nrtpy(monkeypatch, site: Path) -> None:
    """`import nrtpy` -> this module; nrtpy's distribution metadata in `site` (on sys.path)."""
    from neuron_standin import MODULES, lay_out_sdk

    monkeypatch.setitem(MODULES, "nrtpy", "nrtpy")
    lay_out_sdk(site, {"nrtpy": VERSION}, modules=False)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setitem(sys.modules, "nrtpy", sys.modules[__name__])
    _held.clear()
    _groups.clear()
    reset()


__all__ = ["NrtpyModel", "NrtpyTensor", "configure", "reset"]
