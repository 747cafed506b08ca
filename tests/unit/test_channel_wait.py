"""Reading a compiled graph's channel on CPU by looking and sleeping: the sleeps grow to
POLL_MAX_S while a step may still be running, and an idle reader looks every POLL_IDLE_S, also
when Ray's execution loop reads in calls of 0.1 s each."""

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


class Channel:
    """A channel whose one-look read (timeout 0) finds a value from `at` on."""

    def __init__(self, clock: Clock, at: float) -> None:
        self.clock, self.at, self.looks = clock, at, 0

    def spinning_read(self, timeout):
        assert timeout == 0
        self.looks += 1
        return _ready_at(self.clock, self.at)()


def _read_as_ray_does(read, channel: Channel, clock: Clock):
    """Ray's SynchronousReader: calls of at most 0.1 s each until one returns."""
    while True:
        try:
            return read(channel, 0.1)
        except RayChannelTimeoutError:
            continue


def test_an_idle_reader_of_calls_of_a_tenth_of_a_second_polls_at_the_idle_rate(clock):
    channel = Channel(clock, at=channel_wait.IDLE_AFTER_S + 10.0)
    read = channel_wait.polling_read(Channel.spinning_read)
    assert _read_as_ray_does(read, channel, clock) == "value"
    # not ~50 looks in each 0.1 s call (sleeps starting again from POLL_FIRST_S): those of
    # poll alone, and one more as each call begins
    calls = channel.at / 0.1
    assert channel.looks < channel_wait.IDLE_AFTER_S / channel_wait.POLL_MAX_S + 10.0 / (
        channel_wait.POLL_IDLE_S) + calls + 10  # fmt: skip
    assert clock.now - channel.at <= channel_wait.POLL_IDLE_S
    # the next value's wait starts over: a step right after is seen quickly
    channel.at, start = clock.now + 0.0101, clock.now
    looks = channel.looks
    assert _read_as_ray_does(read, channel, clock) == "value"
    assert clock.now - channel.at <= channel_wait.POLL_MAX_S
    assert clock.sleeps[-(channel.looks - looks) + 1] == channel_wait.POLL_FIRST_S
    assert clock.now - start < 0.02
