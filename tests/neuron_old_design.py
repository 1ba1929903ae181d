"""The neuron design issue 18 replaced, kept only as the negative control of the stand-in's checks
(tests/test_neuron_spmd.py): one torch_neuronx.trace per graph, the rank's weights held by every graph,
the KV cache an example input aliased to the last output, functional collectives, the rank an input."""
import shutil
import tempfile
from pathlib import Path

import torch


class StatefulGraph(torch.nn.Module):
    """The exported graph with its weights as (non-inlined) parameters, taking (kv, rank, *inputs)."""

    def __init__(self, graph: torch.nn.Module, weights: tuple[torch.Tensor, ...]):
        super().__init__()
        self.graph = graph
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(w, requires_grad=False) for w in weights])

    def forward(self, kv, *inputs):
        return (*self.graph(tuple(self.weights), kv, *inputs), kv)


def compile_old(ep, workdir: Path):
    import torch_neuronx

    (weights, kv, *inputs), _ = ep.example_inputs
    fn = StatefulGraph(ep.module(), weights)
    n_out = len(ep.graph_signature.user_outputs)
    Path(workdir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=workdir))
    try:
        return torch_neuronx.trace(fn, (kv, *inputs), input_output_aliases={kv: n_out}, compiler_workdir=str(work),
                                   compiler_args=["--target", "trn2"], inline_weights_to_neff=False, cpu_backend=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
