"""Reading a compiled graph's channel on CPU by looking and sleeping: the sleeps grow to
POLL_MAX_S while a step may still be running, and an idle reader looks every POLL_IDLE_S."""

import types

import pytest
from ray.exceptions import RayChannelTimeoutError

from dsv4ray.actors import channel_wait


class Clock:
    """time.monotonic / time.sleep without waiting: sleeps advance the clock and are recorded."""

    def __init__(self) -> None:
        self.now, self.sleeps = 0.0, []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(channel_wait, "time", types.SimpleNamespace(monotonic=lambda: c.now,
                                                                    sleep=c.sleep))  # fmt: skip
    return c


def _ready_at(clock: Clock, at: float):
    def look():
        if clock.now < at:
            raise RayChannelTimeoutError("nothing yet")
        return "value"

    return look


def test_a_value_during_a_step_is_seen_at_most_poll_max_late(clock):
    at = 0.0503
    assert channel_wait.poll(_ready_at(clock, at), None) == "value"
    assert clock.now - at <= channel_wait.POLL_MAX_S
    assert clock.sleeps[0] == channel_wait.POLL_FIRST_S
    assert max(clock.sleeps) == channel_wait.POLL_MAX_S


def test_an_idle_reader_wakes_a_few_times_a_second_and_sees_the_next_step(clock):
    at = channel_wait.IDLE_AFTER_S + 10.0  # ten seconds of an idle pipeline
    assert channel_wait.poll(_ready_at(clock, at), None) == "value"
    idle_looks = [s for s in clock.sleeps if s == channel_wait.POLL_IDLE_S]
    assert len(idle_looks) <= 10.0 / channel_wait.POLL_IDLE_S + 2
    assert (
        len(clock.sleeps) - len(idle_looks)
        < channel_wait.IDLE_AFTER_S / channel_wait.POLL_MAX_S + 20
    )
    assert clock.now - at <= channel_wait.POLL_IDLE_S


def test_the_deadline_raises_and_other_errors_propagate(clock):
    with pytest.raises(RayChannelTimeoutError):
        channel_wait.poll(_ready_at(clock, 100.0), deadline=3.0)
    assert 3.0 <= clock.now <= 3.0 + channel_wait.POLL_IDLE_S

    def broken():
        raise ValueError("channel closed")

    with pytest.raises(ValueError, match="channel closed"):
        channel_wait.poll(broken, None)
