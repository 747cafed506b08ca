"""The commands stop on SIGINT and SIGTERM: `dsv4ray generate` mid-stream says so and exits as a
shell reports the signal (130, 143), and `dsv4ray serve`'s shutdown runs to its end (a signal
meanwhile is ignored, a step that hangs is given a bounded time)."""

import io
import os
import signal
import threading
import time

import pytest

from dsv4ray.entrypoints import serve
from dsv4ray.entrypoints.stop_signals import signals_held


def test_signals_during_the_shutdown_are_ignored_then_the_handlers_come_back():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with signals_held():
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


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_generate_stops_mid_stream_on_a_signal_and_says_so(tiny_ckpt, sig, capsys):
    from dsv4ray.entrypoints.generate import generate

    class Terminal(io.StringIO):
        signalled = False

        def write(self, text: str) -> int:
            if len(self.getvalue()) > 2 and not self.signalled:  # tokens are streaming
                self.signalled = True
                os.kill(os.getpid(), sig)  # the user
            return super().write(text)

    out = Terminal()
    before = signal.getsignal(signal.SIGTERM)
    code = generate(tiny_ckpt, ["Hi", "never reached"], max_tokens=500, out=out,
                    kv_cache_dtype="fp32")  # fmt: skip
    assert code == (143 if sig == signal.SIGTERM else 130)
    assert "never reached" not in out.getvalue()
    assert "dsv4ray: stopped" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before
