"""The one thread of a serving process that runs torch: it loads the bundle, warms it up and then runs the
engine, while the HTTP event loop keeps the main thread.

Why one: libgomp (torch's OpenMP) keeps a pool of worker threads per thread that starts parallel work, and
once its pools hold more threads than the process has cores it throttles how long an idle worker spins
before it sleeps, so every parallel region of a graph then pays for waking its workers (docs/architecture.md
has the measurement). torch.set_num_threads is also per thread for OpenMP, so it is applied here, on the
thread that computes.
"""
from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Callable


class TorchThread:
    def __init__(self, name: str = "eagle3-engine"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            fn, fut, last = self._jobs.get()
            if fn is None:
                return
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 (handed to the caller)
                    fut.set_exception(e)
            if last:
                return

    def submit(self, fn: Callable, *args, last: bool = False, **kwargs) -> concurrent.futures.Future:
        """Run fn(*args, **kwargs) on the thread after what was submitted before; `last`: then the thread ends."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((lambda: fn(*args, **kwargs), fut, last))
        return fut

    def call(self, fn: Callable, *args, **kwargs):
        """fn(*args, **kwargs) on the thread; its result, or its exception raised here."""
        return self.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        """End the thread once its queued work is done (a no-op once a `last` job ended it)."""
        self._jobs.put((None, None, False))
