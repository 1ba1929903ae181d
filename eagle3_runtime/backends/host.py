"""The portable backends' shared runtime side (export, aoti): weights and KV caches are host tensors
of this process's rank, graphs are called with them as inputs, and tensor parallelism is one process
per rank under torchrun (gloo), rank 0 driving (tp.py)."""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..manifest import BundleError, GraphEntry, Manifest
from ..reader import bundle_file
from .base import DTYPES, Graph, GraphFn, RuntimeBackend, TPContext, world_size


def launch_hint(tp: int) -> str:
    return f"torchrun --nproc-per-node {tp} -m eagle3_runtime.cli BUNDLE ..."


class HostBackend(RuntimeBackend):
    @classmethod
    def join_world(cls, m: Manifest, environ=os.environ) -> TPContext | None:
        """None for a TP-1 bundle run as one process; otherwise join the torchrun world (and check it)."""
        world, tp = world_size(environ) or 1, m.tp_degree
        if world == 1 and tp == 1:
            return None
        if world != tp:
            raise BundleError(f"this bundle was built for tp_degree {tp} but this run has {world} process(es); "
                              f"run it as: {launch_hint(tp)}" if tp > 1 else
                              f"this bundle was built for tp_degree 1; run it as one process, not under torchrun "
                              f"with {world} processes")
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        return TPContext(dist.get_rank(), world, dist.new_group(backend="gloo"))

    def load_graph(self, path: Path, entry: GraphEntry, weights: tuple[torch.Tensor, ...]) -> GraphFn:
        raise NotImplementedError

    def __init__(self, root: Path, m: Manifest, rank: int):
        super().__init__(root, m, rank)
        for name, model in m.models.items():
            path = bundle_file(self.root, model.weight_files[rank].path)
            try:
                tensors = load_file(path)
            except (SafetensorError, OSError) as e:
                raise BundleError(f"{path}: not a readable safetensors file ({e}); rebuild the bundle") from e
            for k, v in tensors.items():
                self.weights[f"{name}/{k}"] = v
        self.state = {s.name: torch.zeros(s.shape, dtype=DTYPES[s.dtype]) for s in m.state}
        rank_t = torch.tensor([rank], dtype=torch.int64)
        for g in m.graphs:
            weights = tuple(self.weights[w] for w in g.weights) + self.inputs_after_weights(g)
            fn = self.load_graph(bundle_file(self.root, g.file.path), g, weights)
            self.graphs[g.name] = Graph(g, fn, weights, self.state[g.state], rank_t)
        self.rows, self.positions = m.kv_dim("rows"), m.kv_dim("positions")
        self.target_kv = self.state[m.state_of("target")]

    def inputs_after_weights(self, g: GraphEntry) -> tuple[torch.Tensor, ...]:
        """What a graph takes after its weights (the aoti backend: copies packed at load)."""
        return ()

    def copy_kv_row(self, src: int, dst: int) -> None:
        for kv in self.state.values():
            kv.select(self.rows, dst).copy_(kv.select(self.rows, src))

    def compact_kv(self, row: int, src: list[int], dst: list[int]) -> None:
        kv = self.target_kv.select(self.rows, row)
        pos = self.positions - (self.positions > self.rows)  # (one dim fewer once the row is selected)
        kv.index_copy_(pos, torch.tensor(dst), kv.index_select(pos, torch.tensor(src)))
