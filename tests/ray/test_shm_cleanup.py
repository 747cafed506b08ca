"""Pipeline builds, rebuilds, a dead stage and shutdowns leave no files in /dev/shm.

Each compiled graph's shared-memory channel has two semaphore files,
``/dev/shm/sem.{obj,hdr}<raylet pid>-<ns>``; Ray removes them only when a process that used
the channel exits cleanly, so stage actors killed at teardown used to leave them behind
(12 files per build while the driver lived, 4 of them for good). Host tier regions are
``/dev/shm/dsv4ray-<pipeline key>-s<stage>``. Only files of this session's Ray node and of this
test's pipelines are counted: other Ray instances on the machine may come and go meanwhile.
"""

import time

import ray

from dsv4ray import LLM, SamplingParams
from dsv4ray.cluster.channel_files import node_shm_files, raylet_pid

GREEDY = SamplingParams(max_tokens=3, ignore_eos=True)
NUM_REBUILDS = 2  # each starts fresh actors (seconds); a single build used to leak 12 files


class ShmFiles:
    """This node's channel semaphore files and the host tier regions of the tracked pipelines."""

    def __init__(self) -> None:
        self.raylet_pid = raylet_pid()
        self.keys: list[str] = []

    def track(self, llm: LLM) -> None:
        self.keys.append(llm.core.pipeline.key)

    def now(self) -> set[str]:
        return node_shm_files(self.raylet_pid, self.keys)

    def settle(self, at_most: int, baseline: set[str], timeout_s: float = 30) -> set[str]:
        """The new files once no more than at_most remain (actors that were told to exit
        remove theirs as their processes end, a moment after Ray reports them dead)."""
        deadline = time.monotonic() + timeout_s
        while True:
            new = self.now() - baseline
            if len(new) <= at_most or time.monotonic() > deadline:
                return new
            time.sleep(0.2)


def test_rebuilds_a_dead_stage_and_shutdown_leave_no_files(ray_session, tiny_ckpt):
    shm = ShmFiles()
    baseline = shm.now()
    llm = LLM(
        tiny_ckpt, pp_size=2, kv_cache_dtype="fp32", enable_hicache=True, max_total_tokens=1024
    )
    shm.track(llm)
    try:
        llm.generate([[5, 6, 7]], GREEDY)
        live = shm.now() - baseline
        num_sems = sum(name.startswith("sem.") for name in live)
        assert num_sems >= 4 and len(live) == num_sems + 2, live  # channels + 2 stage regions
        for _ in range(NUM_REBUILDS):
            llm.core.pipeline.rebuild()
            assert len(shm.settle(len(live), baseline)) == len(live)
        ray.kill(llm.core.pipeline.actors[-1], no_restart=True)  # it cannot clean up after itself
        assert llm.generate([[5, 6, 7]], GREEDY)[0].finish_reason == "abort"
        assert llm.generate([[5, 6, 8]], GREEDY)[0].finish_reason == "length"
        assert len(shm.settle(len(live), baseline)) == len(live)
    finally:
        llm.shutdown()
    assert shm.settle(0, baseline) == set()


def test_a_dead_middle_stage_and_shutdown_leave_no_files(ray_session, tiny_ckpt):
    shm = ShmFiles()
    baseline = shm.now()
    llm = LLM(tiny_ckpt, pp_size=3, kv_cache_dtype="fp32")
    shm.track(llm)
    try:
        llm.generate([[5, 6, 7]], GREEDY)
        live = len(shm.now() - baseline)
        ray.kill(llm.core.pipeline.actors[1], no_restart=True)
        assert llm.generate([[5, 6, 7]], GREEDY)[0].finish_reason == "abort"
        assert llm.generate([[5, 6, 8]], GREEDY)[0].finish_reason == "length"
        assert len(shm.settle(live, baseline)) == live
    finally:
        llm.shutdown()
    assert shm.settle(0, baseline) == set()
