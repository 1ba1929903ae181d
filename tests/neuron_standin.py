"""A stand-in Neuron SDK for tests, written from the real signatures (docs/neuron-sdk-facts.md):
`torch_neuronx.trace(func, example_inputs, *_, input_output_aliases={}, compiler_workdir=None,
compiler_args=None, partitioner_config=None, inline_weights_to_neff=True, cpu_backend=False)` "compiles"
with torch.jit.trace on CPU and writes a placeholder NEFF; `replace_weights` binds a state dict.

With `strict`, it also refuses what the real stack refuses or silently breaks on (checked one by one,
so each test sees exactly one contract):
  "aliases"      input_output_aliases keys must be Parameters of the traced nn.Module (device state,
                 never a call argument; old torch_neuronx hlo_conversion.xla_trace matches them among
                 func.named_parameters() by storage), and no state may also be an example input
  "collectives"  no torch.distributed._functional_collectives ops in the graph: torch-xla lowers them
                 without their process group, NxD's graphs reduce through xm.all_reduce(groups=TP mesh)
                 (parallel_layers.mappings / comm.py)
"""
import sys
import types
from pathlib import Path

import pytest
import torch

CHECKS = ("aliases", "collectives")


class StandInNeuronx:
    """CONTRACT-TEST STAND-IN for torch_neuronx: records every trace() call and 'compiles' with
    torch.jit.trace on CPU, writing a placeholder graph.neff into the compiler workdir."""

    __version__ = "0.0.0-standin"

    def __init__(self, strict=()):
        self.calls = []
        self.strict = set(strict)
        assert self.strict <= set(CHECKS), self.strict

    def trace(self, func, example_inputs, *_, input_output_aliases={}, compiler_workdir=None, compiler_args=None,
              partitioner_config=None, inline_weights_to_neff=True, cpu_backend=False):
        # the documented signature (aws-neuron-sdk api-torch-neuronx-trace.rst): no other keyword is accepted
        if "aliases" in self.strict:
            check_aliases(func, example_inputs, input_output_aliases)
        if "collectives" in self.strict:
            check_collectives(func)
        outs = func(*[x.clone() for x in example_inputs])
        self.calls.append({"func": func, "inputs": example_inputs, "aliases": input_output_aliases,
                           "workdir": compiler_workdir, "args": compiler_args, "inline": inline_weights_to_neff,
                           "cpu_backend": cpu_backend, "n_outputs": len(outs)})
        traced = torch.jit.trace(func, tuple(x.clone() for x in example_inputs), check_trace=False, strict=False)
        Path(compiler_workdir, "graph.neff").write_bytes(b"NEFF stand-in")
        return traced

    @staticmethod
    def replace_weights(model, weights):
        sd = model.state_dict()
        assert set(weights) <= set(sd), sorted(set(weights) - set(sd))[:3]
        with torch.no_grad():
            for k, v in weights.items():
                sd[k].copy_(v)


@pytest.fixture
def standin_sdk(monkeypatch):
    neuronx = StandInNeuronx()
    install(monkeypatch, neuronx)
    return neuronx


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
            raise ValueError(f"input_output_aliases: key {list(key.shape)} is not a Parameter of the traced module")
        if not isinstance(index, int):
            raise ValueError(f"input_output_aliases: output index {index!r} is not an int")


def check_collectives(func) -> None:
    """Read from the FX graphs inside `func` (the real torch_neuronx traces through XLA instead)."""
    ops = sorted({str(n.target) for m in func.modules() if isinstance(m, torch.fx.GraphModule)
                  for n in m.graph.nodes if n.op == "call_function" and "c10d_functional" in str(n.target)})
    if ops:
        raise ValueError(f"the graph calls {', '.join(ops)}: torch-xla lowers functional collectives without their "
                         "process group; reduce through NxD's parallel_layers.mappings (xm.all_reduce with the TP "
                         "replica groups)")


def install(monkeypatch, neuronx) -> None:
    """Put the stand-in where `import torch_neuronx` (and the SDK presence checks) find it."""
    mod = types.ModuleType("torch_neuronx")
    mod.__version__, mod.trace, mod.replace_weights = neuronx.__version__, neuronx.trace, neuronx.replace_weights
    monkeypatch.setitem(sys.modules, "torch_neuronx", mod)
    for name in ("neuronxcc", "libneuronxla"):
        m = types.ModuleType(name)
        m.__version__ = "0.0.0-standin"
        monkeypatch.setitem(sys.modules, name, m)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: sys.modules[n].__spec__ or object() if n in ("torch_neuronx", "neuronxcc",
                                                                                  "libneuronxla") else real(n, *a))
