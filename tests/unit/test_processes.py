"""Waiting for processes to end: an engine's next pools are sized only after the last engine's
stage processes let go of their memory."""

import signal
import subprocess
import sys
import time

from dsv4ray.actors.processes import end_processes, process_running, wait_exited


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def test_wait_exited_returns_when_the_process_has_exited_and_counts_a_zombie_as_gone():
    child = _child("import time; time.sleep(0.5)")
    try:
        start = time.monotonic()
        assert wait_exited([child.pid], 30) == []
        assert time.monotonic() - start >= 0.3  # it waited for the exit...
        assert not process_running(child.pid)  # ...which left a zombie: nobody reaped it yet
        assert child.poll() == 0
    finally:
        child.kill()
        child.wait()


def test_wait_exited_gives_up_after_its_timeout_and_names_the_running_ones():
    child = _child("import time; time.sleep(60)")
    try:
        start = time.monotonic()
        assert wait_exited([child.pid], 0.3) == [child.pid]
        assert time.monotonic() - start < 5
        assert process_running(child.pid)
    finally:
        child.kill()
        child.wait()


def test_end_processes_kills_what_outlives_its_timeout():
    # a process that ignores SIGTERM and never exits on its own
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    child = _child(code)
    try:
        time.sleep(0.3)  # the handler is installed
        assert end_processes([child.pid], 0.2) == []
        assert child.wait(timeout=5) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()


def test_no_pids_and_unknown_pids_return_at_once():
    child = _child("pass")
    child.wait()  # reaped: its pid names no process now
    start = time.monotonic()
    assert wait_exited([], 10) == [] and end_processes([child.pid], 10) == []
    assert time.monotonic() - start < 1
