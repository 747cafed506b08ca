"""Processes of this node, as the actors and the sweeps of their files see them."""

from __future__ import annotations

import os
import signal
import time

from dsv4ray.pids import process_alive  # the other modules of actors/ and above take it here


def process_running(pid: int) -> bool:
    """Alive and not a zombie: an exited process its parent has not reaped yet holds no memory."""
    if not process_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]  # the name in parentheses may hold spaces
    except (OSError, IndexError):
        return process_alive(pid)  # no /proc (or it went meanwhile): what kill(0) says
    return state != "Z"


def wait_exited(pids: list[int], timeout_s: float, poll_s: float = 0.02) -> list[int]:
    """Waits until none of `pids` runs on this node, at most timeout_s; returns those still
    running."""
    deadline = time.monotonic() + timeout_s
    left = [pid for pid in pids if process_running(pid)]
    while left and time.monotonic() < deadline:
        time.sleep(poll_s)
        left = [pid for pid in left if process_running(pid)]
    return left


KILL_WAIT_S = 2.0  # a SIGKILLed process is gone well within this


def end_processes(pids: list[int], timeout_s: float) -> list[int]:
    """Waits up to timeout_s for `pids` to exit, SIGKILLs those still running and waits for them
    too; returns any that outlived that."""
    left = wait_exited(pids, timeout_s)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return wait_exited(left, KILL_WAIT_S) if left else []
