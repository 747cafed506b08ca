"""ShmFiles: the /dev/shm files of this session's Ray node (compiled-graph channels) and of the
host tier regions of tracked pipelines, for tests that check what a run leaves behind."""

import time

from dsv4ray import LLM
from dsv4ray.cluster.channel_files import node_shm_files, raylet_pid


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
