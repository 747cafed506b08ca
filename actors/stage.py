"""StageActor: the Ray actor shell over ``StageWorker`` (all logic lives in the plain class).

Control calls (ready, available_bytes, allocate, open_transfer) are plain ``.remote()`` calls;
the per-step methods ``first``, ``prepare`` / ``receive`` / ``next`` and ``take`` are bound into
the pipeline's compiled graph. Plans arrive as msgpack bytes; results carry the residual stack
and top-k tensors to the next stage.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import ray

from dsv4ray.actors.channel_wait import sleep_between_reads
from dsv4ray.actors.timeline import MethodTimeline
from dsv4ray.cache.pool_sizes import PoolSizes
from dsv4ray.engine.plan import StageResult, decode
from dsv4ray.sources import fetch_model
from dsv4ray.worker.pool_sizing import available_host_memory
from dsv4ray.worker.stage_spec import StageSpec


@ray.remote
class StageActor:
    def __init__(self, spec: StageSpec, num_threads: int, log_level: str = "INFO") -> None:
        logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
        import torch  # here: the driver creating the actor loads neither the network nor kernels

        from dsv4ray.worker.stage_worker import StageWorker

        torch.set_num_threads(max(1, num_threads))
        if spec.device == "cpu":  # Ray's spinning reads would keep a core busy between steps
            sleep_between_reads()
        local = fetch_model(spec.model)  # a URI: this machine's cached copy
        self.worker = StageWorker(dataclasses.replace(spec, model=local))
        self.timeline_records = MethodTimeline()
        self.prepared = None  # the step ``prepare`` readied for ``next``

    def ready(self) -> dict:
        return {
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
            "start": self.worker.model.start,
            "end": self.worker.model.end,
            "gpu": self.worker.gpu_uuid(),
        }

    def available_bytes(self, memory_fraction: float) -> float | None:
        return self.worker.available_bytes(memory_fraction)

    def host_memory(self, sizes: dict) -> dict:
        """What the driver's check of CPU stages sharing a machine needs: this stage's pool bytes
        for sizes and the memory its machine has available."""
        return {
            "node": ray.get_runtime_context().get_node_id(),
            "start": self.worker.model.start,
            "end": self.worker.model.end,
            "need": self.worker.host_pool_bytes(PoolSizes(**sizes)),
            "have": available_host_memory(),
        }

    def allocate(self, sizes: dict) -> int:
        return self.worker.allocate(PoolSizes(**sizes))

    def capture_graphs(self, max_batch: int, max_len: int, draft_steps: int,
                       capture: bool = True) -> None:  # fmt: skip
        self.worker.capture_graphs(max_batch, max_len, draft_steps, capture)

    def hand_off_verifications(self) -> None:
        self.worker.hand_off_verifications()

    def attach_host(self, layout_args: dict, path: str) -> int:
        return self.worker.attach_host(layout_args, path)

    def detach_host(self) -> None:
        self.worker.detach_host()

    def stats(self) -> dict:
        return self.worker.stats()

    def open_transfer(self, protocol: str) -> dict:
        """Starts this stage's Mooncake engine on its node's address and registers its pools."""
        from dsv4ray.worker.pd.transfer import MooncakeTransport

        transport = MooncakeTransport(ray.util.get_node_ip_address(), protocol)
        return self.worker.open_transfer(transport)

    def export_tokens(self):
        return self.worker.export_tokens()

    def map_tokens(self, exported) -> bytes:
        return self.worker.map_tokens(exported)

    def wait_for_tokens(self, event_handle: bytes) -> None:
        self.worker.wait_for_tokens(event_handle)

    def open_link(self, depth: int, rows: int) -> dict:
        return self.worker.open_link(depth, rows)

    def map_link(self, exported: dict) -> list:
        return self.worker.map_link(exported)

    def link_peer(self, handles: list) -> None:
        self.worker.link_peer(handles)

    def timeline(self, record: bool) -> list:
        """Starts (record) or stops recording when each graph method was entered and left
        (time.monotonic, one clock for every process of a machine); returns what was recorded
        since the last call: [(method, step id, entered, left)] (bench/pipeline.py --timeline)."""
        return self.timeline_records.swap(record)

    def take(self, plan: bytes, result: StageResult) -> StageResult:
        entered = self.timeline_records.enter()
        out = self.worker.take(plan := decode(plan), result)
        return self._record("take", plan, entered, out)

    def first(self, plan: bytes, drafts: dict | None = None) -> StageResult:
        """drafts (here and in ``prepare``): the draft actor's held proposals, with one."""
        entered = self.timeline_records.enter()
        out = self.worker.step(plan := decode(plan), drafts=drafts)
        return self._record("first", plan, entered, out)

    def prepare(self, plan: bytes, drafts: dict | None = None) -> int:
        """A later stage's bookkeeping and staged metadata of a step, run before its ``next``
        waits for the stage before (a receive over NCCL blocks until the sender's kernels
        finished) -> the step id ``next`` takes."""
        entered = self.timeline_records.enter()
        self.prepared = self.worker.prepare(plan := decode(plan), drafts)
        self._record("prepare", plan, entered, None)
        return plan.step_id

    def receive(self, prev: StageResult) -> StageResult:
        """The stage before's result, as its channel delivered it."""
        return prev

    def next(self, step_id: int, prev: StageResult) -> StageResult:
        entered = self.timeline_records.enter()
        prepared, self.prepared = self.prepared, None
        if prepared is None or prepared.plan.step_id != step_id:
            raise RuntimeError(f"step {step_id} reached a stage that prepared no such step")
        out = self.worker.step_prepared(prepared, prev)
        return self._record("next", prepared.plan, entered, out)

    def settle(self, drafted: StageResult) -> StageResult:
        """The last stage beside a draft actor: its step's result for the driver, read back
        once the draft actor launched (``StageWorker.settle``)."""
        entered = self.timeline_records.enter()
        out = self.worker.settle(drafted)
        self.timeline_records.left("settle", drafted.step_id, entered)
        return out

    def _record(self, method: str, plan, entered: float, out):
        self.timeline_records.left(method, plan.step_id, entered)
        return out
