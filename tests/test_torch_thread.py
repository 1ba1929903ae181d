"""eagle3_runtime.torch_thread: every torch call of a serving process on one thread (one OpenMP pool)."""
import threading

import pytest

from eagle3_runtime.torch_thread import TorchThread


def test_calls_run_in_order_on_one_thread_and_errors_reach_the_caller():
    t = TorchThread("t")
    names = [t.call(lambda: threading.current_thread().name) for _ in range(3)]
    assert names == ["t"] * 3 and threading.current_thread().name != "t"
    with pytest.raises(ZeroDivisionError):
        t.call(lambda: 1 / 0)
    assert t.call(lambda a, b=0: a + b, 2, b=3) == 5  # (still serving after an error)
    done = []
    t.submit(lambda: done.append(1), last=True).result(timeout=5)
    t.thread.join(timeout=5)
    assert done == [1] and not t.thread.is_alive()


def test_close_ends_the_thread_after_its_queued_work():
    t = TorchThread()
    fut = t.submit(lambda: 7)
    t.close()
    t.thread.join(timeout=5)
    assert fut.result() == 7 and not t.thread.is_alive()
