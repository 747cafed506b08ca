"""The host tier's regions outlive their holder's restarts but not their engine: a region whose
holder process has been gone for the region's grace period is released (its file removed),
one claimed again by a new holder within the grace period keeps its pages, and a region
without a holder stays until released (the plain class, its clock and processes stubbed)."""

import os

import pytest

from dsv4ray.actors.host_tier import HostTier


class Node:
    """The sweep's view of time and of this node's live pids."""

    def __init__(self) -> None:
        self.now, self.live = 0.0, {11, 12}

    def tier(self) -> HostTier:
        return HostTier(clock=lambda: self.now, alive=lambda pid: pid in self.live)


@pytest.fixture
def node():
    return Node()


def _write(region: dict, data: bytes) -> None:
    with open(region["path"], "r+b") as f:
        f.write(data)


def test_a_region_of_a_gone_holder_is_released_after_its_grace_period(node):
    tier = node.tier()
    held = tier.create_region("e1-s0", 4096, holder_pid=11, grace_s=100)
    kept = tier.create_region("e2-s0", 4096, holder_pid=12, grace_s=100)
    node.live.discard(11)  # e1's stage (and engine) killed
    assert tier.sweep() == []  # the grace period starts
    node.now = 99.0
    assert tier.sweep() == [] and os.path.exists(held["path"])
    node.now = 100.0
    assert tier.sweep() == ["e1-s0"]
    assert not os.path.exists(held["path"]) and os.path.exists(kept["path"])
    assert tier.usage() == {"num_regions": 1, "bytes": 4096}
    tier.shutdown()
    assert not os.path.exists(kept["path"])


def test_a_rebuilt_stage_claims_its_region_again_with_its_pages(node):
    tier = node.tier()
    region = tier.create_region("e1-s1", 4096, holder_pid=11, grace_s=100)
    _write(region, b"pages")
    node.live.discard(11)
    tier.sweep()
    node.now = 90.0
    node.live.add(21)  # the rebuilt stage's process
    again = tier.create_region("e1-s1", 4096, holder_pid=21, grace_s=100)
    assert again["created"] is False and again["path"] == region["path"]
    node.now = 500.0
    assert tier.sweep() == []
    with open(region["path"], "rb") as f:
        assert f.read(5) == b"pages"
    tier.shutdown()


def test_a_holder_seen_again_restarts_the_grace_period_and_a_region_without_one_stays(node):
    tier = node.tier()
    tier.create_region("e1-s0", 4096, holder_pid=11, grace_s=100)
    free = tier.create_region("bench", 4096)  # no holder: until released
    node.live.discard(11)
    tier.sweep()
    node.now = 60.0
    node.live.add(11)
    tier.sweep()
    node.live.discard(11)
    node.now = 150.0
    assert tier.sweep() == []  # gone again since 150, not since 0
    node.now = 250.0
    assert tier.sweep() == ["e1-s0"]
    node.now = 10**6
    assert tier.sweep() == [] and os.path.exists(free["path"])
    assert tier.release_region("bench") and not os.path.exists(free["path"])


def test_a_region_asked_for_with_another_size_is_refused(node):
    tier = node.tier()
    tier.create_region("e1-s0", 4096, holder_pid=11, grace_s=100)
    with pytest.raises(ValueError, match="exists with 4096 bytes, not 8192"):
        tier.create_region("e1-s0", 8192, holder_pid=11, grace_s=100)
    with pytest.raises(ValueError, match="needs grace_s"):  # a holder without a bound
        tier.create_region("e1-s1", 4096, holder_pid=11)
    tier.shutdown()


def test_regions_count_what_the_others_may_still_fill(node, tmp_path, monkeypatch):
    """Regions are sparse: a filesystem's free space does not count what earlier regions may
    still take. Memory (/dev/shm) that cannot hold a new one beside them sends it to the
    temporary directory, and one that fits nowhere is refused, naming host_cache_tokens."""
    import collections
    import shutil
    import tempfile

    from dsv4ray.actors import host_tier

    free = {"/dev/shm": 3000, str(tmp_path): 10**9}
    usage = collections.namedtuple("usage", "total used free")
    real = shutil.disk_usage
    monkeypatch.setattr(host_tier.shutil, "disk_usage",
                        lambda path: usage(0, 0, free.get(str(path), real(path).free)))  # fmt: skip
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    tier, key = node.tier(), f"test-commit-{os.getpid()}"
    try:
        first = tier.create_region(key + "-a", 2000)
        assert first["path"].startswith("/dev/shm/")
        second = tier.create_region(key + "-b", 2000)  # 2000 + 2000 unfilled > 3000 free
        assert second["path"].startswith(str(tmp_path))
        free[str(tmp_path)] = 5000  # 2000 + 4000 the others may still take
        with pytest.raises(ValueError, match="lower host_cache_tokens"):
            tier.create_region(key + "-c", 2000)
    finally:
        for suffix in ("-a", "-b", "-c"):
            tier.release_region(key + suffix)
