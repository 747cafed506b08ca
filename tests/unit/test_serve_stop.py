"""`dsv4ray serve`'s shutdown runs to its end: a signal meanwhile is ignored, and a step that
hangs is given a bounded time."""

import os
import signal
import threading
import time

from dsv4ray.entrypoints import serve


def test_signals_during_the_shutdown_are_ignored_then_the_handlers_come_back():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with serve._signals_ignored():
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGTERM)  # and no exit
        time.sleep(0.05)
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_a_shutdown_step_that_hangs_is_left_after_its_time(caplog):
    release = threading.Event()
    start = time.monotonic()
    serve._bounded(release.wait, 0.2, "a stuck step")
    assert time.monotonic() - start < 2  # it did not wait for the step
    assert "a stuck step did not finish in 0 s" in caplog.text
    release.set()
    done = []
    serve._bounded(lambda: done.append(1), 5, "a quick step")
    assert done == [1]
