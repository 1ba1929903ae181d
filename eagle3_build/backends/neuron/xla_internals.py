"""Every reach into torch-xla's non-public API, behind a probe: the NEFF generation's lowering of one graph to
an HloModuleProto on CPU (PJRT_DEVICE=CPU), and its collectives (also tools/hlo_check.py's).

Read and measured in torch-xla 2.9 (tools/hlo_check.py's docstring has the measurements):
* `xm.all_reduce` is elided while `torch_xla.runtime.world_size()` is 1; `tp_world` makes it `tp` while tracing
  (what NxD's ModelBuilder does). The list form `xm.all_reduce(SUM, [x], groups)` is NxD's (comm.py).
* Every collective chains torch-xla's per-device ordering token, reset only by a sync: `reset_token` before and
  after each graph, else a second graph drags in the first one's collectives.
* `_XLAC._get_xla_tensors_hlo_proto(outputs)` is the serialised HloModuleProto of the outputs' graph;
  `_get_tensors_xla_device_data_node(outputs)` its ENTRY parameters in order (tensor ids and values): the
  module's Parameters, the inputs, and scalars torch-xla keeps as device data (Python numbers other than 0 and
  1, the collective token), whose values the bundle records; `_xla_get_tensor_id` a tensor's id.
* `module.to(xla_device)` replaces the Parameter objects, so the state is found by name after the move.
The aliasing of the KV state is added to the proto (hlo_proto.with_alias), as torch-neuronx writes it.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from unittest import mock

import torch

from ...errors import UserError
from . import hlo_proto

READ_IN = "2.9"  # the torch-xla whose internals were read for the names below
NEEDS = ("_get_xla_tensors_hlo_proto", "_get_tensors_xla_device_data_node", "_xla_get_tensor_id",
         "_set_all_reduce_token")
MAX_CONSTANT_ELEMS = 1024  # a device-data constant larger than this is a weight baked by mistake


def _xla():
    """torch_xla, its xla_model and runtime modules, and _XLAC, probed for every private name used here."""
    try:
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr
    except Exception as e:  # noqa: BLE001 - one line naming the fix
        raise UserError(f"the NEFF generation of backend neuron lowers graphs with torch-xla, and `import torch_xla` "
                        f"failed ({type(e).__name__}: {str(e).strip()[:200]}); install the torch-xla of the Neuron "
                        "SDK (torch-xla 2.9 to 2.12) with PJRT_DEVICE=CPU") from e
    missing = [n for n in NEEDS if not hasattr(torch_xla._XLAC, n)]
    if missing or not hasattr(xr, "world_size"):
        raise UserError(f"torch-xla {torch_xla.__version__} lacks {', '.join(missing or ['runtime.world_size'])}, "
                        f"which eagle3-build's HLO lowering reads (torch-xla {READ_IN}); install torch-xla {READ_IN}")
    return torch_xla, xm, xr, torch_xla._XLAC


@contextlib.contextmanager
def tp_world(tp: int):
    """torch-xla believes the world has `tp` replicas while tracing, so xm.all_reduce is not elided."""
    _, xm, xr, _ = _xla()
    with contextlib.ExitStack() as st:
        st.enter_context(mock.patch.object(xr, "world_size", lambda: tp))
        if hasattr(xm, "xrt_world_size"):  # (gone in 2.9)
            st.enter_context(mock.patch.object(xm, "xrt_world_size", lambda *a, **k: tp))
        yield


def reset_token() -> None:
    """Drop torch-xla's collective-ordering token (see the module docstring)."""
    _, xm, _, x = _xla()
    x._set_all_reduce_token(xm._get_device_context().device, None)


class XlaCollectives:
    """The model's comm ops (all_reduce, gather_last) as NxD lowers them on device: xm.all_reduce over a
    tensor list and xm.all_gather, both with the TP mesh as replica groups. The NxD mappings' names too."""

    def __init__(self, tp: int):
        self.tp, self.groups = tp, [list(range(tp))]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        _, xm, _, _ = _xla()
        return xm.all_reduce(xm.REDUCE_SUM, [x], groups=self.groups)[0]  # (in place on x, constrain_layout)

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        _, xm, _, _ = _xla()
        return xm.all_gather(x, dim=x.dim() - 1, groups=self.groups, pin_layout=False)

    reduce_from_tensor_model_parallel_region = all_reduce
    gather_from_tensor_model_parallel_region = gather_last


@dataclass
class Lowered:
    proto: bytes  # the HloModuleProto, the state aliased
    parameters: list[dict]  # per ENTRY parameter: binds (weight | state | rank | input | constant) and what
    n_outputs: int


def lower_graph(module: torch.nn.Module, example: tuple, tp: int, *, state: str = "kv", rank: str = "rank_util.rank",
                weight_prefix: str = "model.") -> Lowered:
    """`module(*example)` lowered to an HloModuleProto on the XLA CPU device with world size `tp`; its last
    output is aliased to the Parameter named `state`."""
    torch_xla, _, _, x = _xla()
    dev = torch_xla.device()
    reset_token()
    try:
        module = module.to(dev)
        inputs = tuple(a.to(dev) for a in example)
        with torch.no_grad(), tp_world(tp):
            outs = list(module(*inputs))
        proto = x._get_xla_tensors_hlo_proto(outs)
        ids, values = x._get_tensors_xla_device_data_node(outs)
        named = {x._xla_get_tensor_id(t): n for n, t in module.named_parameters(remove_duplicate=False)}
        positions = {x._xla_get_tensor_id(a): i for i, a in enumerate(inputs)}
        params, state_number = [], None
        for number, (tid, value) in enumerate(zip(ids, values)):
            p = {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape)}
            name = named.get(tid)
            if name == state:
                p["binds"], state_number = "state", number
            elif name == rank:
                p["binds"] = "rank"
            elif name is not None:
                p.update(binds="weight", tensor=name if name.startswith(weight_prefix) else weight_prefix + name)
            elif tid in positions:
                p.update(binds="input", index=positions[tid])
            else:
                if math.prod(value.shape) > MAX_CONSTANT_ELEMS:
                    raise UserError(f"a graph reads a {list(value.shape)} tensor that is neither a weight, the KV "
                                    "state nor an input (a weight baked into the graph); this is a bug in "
                                    "eagle3-build's graphs: report it with the recipe")
                raw = value.cpu().reshape(-1).contiguous().view(torch.uint8)
                p.update(binds="constant", data=bytes(raw.numpy()).hex())  # (exact: -inf and bf16 included)
            params.append(p)
        if state_number is None:
            raise UserError("a neuron graph never reads its KV state, so the state cannot be aliased to its last "
                            "output; this is a bug in eagle3-build's graphs: report it with the recipe")
    finally:
        reset_token()
    return Lowered(hlo_proto.with_alias(proto, len(outs) - 1, state_number), params, len(outs))
