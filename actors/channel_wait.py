"""Waiting on a compiled graph's shared-memory channels without spinning a core.

Ray reads a shared-memory channel by spinning (``sched_yield`` in a loop) until the writer seals
the next value: the shortest wait beside GPU stages, whose hosts have cores to spare. On a CPU
machine every waiting reader keeps a core busy: the driver while the stages compute, and each
stage actor between steps, an idle pipeline included (two idle stages kept both cores of a
2-core machine busy). CPU pipelines therefore look at a channel without waiting and sleep
between looks, POLL_FIRST_S at first, doubling up to POLL_MAX_S: a value is seen at most
POLL_MAX_S late, against CPU steps of tens of milliseconds. A reader that has waited IDLE_AFTER_S
(an idle pipeline: no step for longer than any CPU step takes) looks every POLL_IDLE_S, so an
idle stage costs a few wakeups a second and only the first step after a pause is seen late.
Ray's execution loop reads its inputs in calls of at most 0.1 s each (it checks for errors and
teardown between them), so a channel remembers since when its reader waits: the sleeps keep
growing across those calls instead of starting again from POLL_FIRST_S in each.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ray.exceptions import RayChannelTimeoutError

POLL_FIRST_S, POLL_MAX_S = 5e-5, 2e-3
IDLE_AFTER_S, POLL_IDLE_S = 1.0, 0.02


def poll(look: Callable[[], object], deadline: float | None, since: float | None = None):
    """look() until it returns -> its value. look reads without waiting and raises
    RayChannelTimeoutError while nothing is there; raised again once the deadline (monotonic
    seconds; None: none) passed. since: when the reader began waiting for this value (monotonic;
    None: now), which sets how long the sleeps have grown. Other errors propagate at once."""
    since = time.monotonic() if since is None else since
    while True:
        try:
            return look()
        except RayChannelTimeoutError:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise
        time.sleep(_delay(now - since))


def _delay(waited: float) -> float:
    """The sleep before the next look after waiting `waited` seconds: about the time waited
    (the sleeps double from POLL_FIRST_S) up to POLL_MAX_S, then POLL_IDLE_S once idle."""
    if waited >= IDLE_AFTER_S:
        return POLL_IDLE_S
    return min(max(waited, POLL_FIRST_S), POLL_MAX_S)


def polling_read(spinning: Callable):
    """A channel read (``read(channel, timeout)``) over ``spinning(channel, 0)``, one look:
    it polls as ``poll`` does, from when the channel's reader began waiting for its next value
    (kept on the channel across calls that time out)."""

    def read(self, timeout: float | None = None):
        # timeout: None or -1 wait without end, 0 one look, else seconds
        now = time.monotonic()
        deadline = None if timeout is None or timeout < 0 else now + timeout
        since = getattr(self, "_dsv4ray_waiting_since", None)
        since = self._dsv4ray_waiting_since = now if since is None else since
        value = poll(lambda: spinning(self, 0), deadline, since)  # a timeout keeps `since`
        self._dsv4ray_waiting_since = None
        return value

    read.polls = True
    return read


def sleep_between_reads() -> None:
    """From now on this process's reads of shared-memory channels poll and sleep (a stage or
    draft actor on CPU: Ray's execution loop reads the graph's inputs with ``Channel.read``)."""
    from ray.experimental.channel import shared_memory_channel as channels

    spinning = channels.Channel.read
    if not getattr(spinning, "polls", False):
        channels.Channel.read = polling_read(spinning)
