"""A fake torch.distributed world for tracing TP graphs in the build process."""
from __future__ import annotations

import contextlib

from ..errors import UserError


@contextlib.contextmanager
def tracing_process_group(tp: int):
    """A fake world of `tp` ranks so in-graph collectives trace with the right shapes; nothing runs."""
    if tp == 1:
        yield
        return
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise UserError("a torch.distributed process group is already initialised in the build process; "
                        "run eagle3-build compile as a plain process (not under torchrun)")
    dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
