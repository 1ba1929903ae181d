"""Every reach into a non-public part of NxD, each behind a probe that fails loudly.

ModelBuilder.trace() compiles every bucket but the priority one through an unbounded
`concurrent.futures.ThreadPoolExecutor()` (up to cores + 4 neuronx-cc jobs at once, whatever the host's
memory), each job a call of the module-level `neuron_xla_compile` that model_builder.py imports from
libneuronxla (read in neuronx-distributed v2.27.0, v2.28.0 and the 2.29 release: NxD 0.16 to 0.18;
0.19 not published, same code assumed). ModelBuilder has no parameter for it, so `bounded_compiles` wraps
that name for the duration of one trace: at most `jobs` compiler jobs run, the rest of the pool waits.
"""
from __future__ import annotations

import contextlib
import functools
import threading

from eagle3_runtime.backends.neuron_sdk import distribution_version

from ...errors import UserError

HOOK = "neuron_xla_compile"
READ_IN = "0.16-0.18"  # the NxD releases whose model_builder.py was read for HOOK


@contextlib.contextmanager
def bounded_compiles(jobs: int):
    """At most `jobs` neuronx-cc jobs at once inside ModelBuilder.trace()."""
    from neuronx_distributed.trace import model_builder

    real = getattr(model_builder, HOOK, None)
    if not callable(real):
        raise UserError(f"neuronx-distributed {distribution_version('neuronx-distributed')}: ModelBuilder no longer "
                        f"compiles through model_builder.{HOOK} (read in NxD {READ_IN}), so eagle3-build cannot "
                        f"bound its compiler jobs to --jobs {jobs} and the build could exhaust this host's memory; "
                        "install an SDK release eagle3-build knows (eagle3_build/backends/neuron/release_table.py)")
    gate = threading.BoundedSemaphore(jobs)

    @functools.wraps(real)
    def bounded(*args, **kwargs):
        with gate:
            return real(*args, **kwargs)

    setattr(model_builder, HOOK, bounded)
    try:
        yield
    finally:
        setattr(model_builder, HOOK, real)
