"""The count a last stage posts its graph executions in, for a first stage on the same GPU: a
second mapping sees every write, a wait returns only once the count is reached, a count never
reached fails the step with both numbers instead of hanging, and no file is left behind."""

import os
import threading
import time

import pytest

from dsv4ray.worker.graphs.overlap import PostedCount


def test_a_peer_mapping_sees_each_write_and_the_name_can_go_at_once():
    first = PostedCount.create()
    last = PostedCount(first.path, create=False)
    first.unlink()  # both mapped: the name is not needed any more
    assert not os.path.exists(first.path)
    assert first.read() == 0
    for count in (1, 2, 2**40 + 3):
        last.write(count)
        assert first.read() == count


def test_a_wait_returns_once_the_last_stage_posted_enough():
    first = PostedCount.create()
    last = PostedCount(first.path, create=False)
    first.unlink()
    first.wait_until(0)  # nothing to wait for: the first execution
    posted_at = {}

    def post_later() -> None:
        time.sleep(0.05)
        last.write(1)
        time.sleep(0.05)
        posted_at["2"] = time.monotonic()
        last.write(2)

    writer = threading.Thread(target=post_later)
    writer.start()
    first.wait_until(2)
    returned = time.monotonic()
    writer.join()
    assert returned >= posted_at["2"]  # not before the second post


def test_a_count_never_reached_fails_naming_both_counts():
    first = PostedCount.create()
    first.unlink()
    first.write(3)
    with pytest.raises(RuntimeError, match=r"posted 3 graph executions .* waits for 5"):
        first.wait_until(5, timeout_s=0.05)


def test_a_second_count_never_takes_an_existing_name():
    first = PostedCount.create()
    try:
        with pytest.raises(FileExistsError):
            PostedCount(first.path, create=True)
    finally:
        first.unlink()
