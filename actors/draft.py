"""DraftActor: the Ray actor shell over ``DraftWorker`` (all logic lives in the plain class).

It runs in the last stage's placement-group bundle, beside the last stage (a fraction of its GPU,
or of its CPU share). Control calls (ready, allocate) are plain ``.remote()`` calls; three
methods are bound into the pipeline's compiled graph: ``proposals`` first, whose held proposals
every stage writes into the plan's pending drafts, ``prepare`` while the stages compute, and
``next`` after the last stage, whose result (the rows to draft from) it receives: it launches
the step's draft pass and returns that result to the driver at once, naming the requests it
proposes for.
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
from dsv4ray.worker.stage_spec import DraftSpec


@ray.remote
class DraftActor:
    def __init__(self, spec: DraftSpec, num_threads: int, log_level: str = "INFO") -> None:
        logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
        import torch  # here: the driver creating the actor loads neither the network nor kernels

        from dsv4ray.worker.spec.draft import DraftWorker
        from dsv4ray.worker.spec.draft_fill import HeldDrafts

        torch.set_num_threads(max(1, num_threads))
        if spec.device == "cpu":  # Ray's spinning reads would keep a core busy between steps
            sleep_between_reads()
        self.worker = DraftWorker(dataclasses.replace(spec, model=fetch_model(spec.model)))
        self.worker.held = HeldDrafts()
        self.values: dict = {}  # the proposals ``proposals`` gave the stages of this step
        self.prepared = None  # the step ``prepare`` readied for ``next``
        self.timeline_records = MethodTimeline()

    def ready(self) -> dict:
        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}

    def allocate(self, sizes: dict) -> int:
        return self.worker.allocate(PoolSizes(**sizes))

    def capture_graphs(self, max_batch: int, max_len: int, capture: bool = True) -> None:
        self.worker.capture_graphs(max_batch, max_len, capture)

    def open_link(self, depth: int, rows: int) -> dict:
        return self.worker.open_link(depth, rows)

    def link_peer(self, handles: list) -> None:
        self.worker.link_peer(handles)

    def host_memory(self, sizes: dict) -> dict:
        """As StageActor.host_memory, for the draft layer's pools."""
        return {
            "node": ray.get_runtime_context().get_node_id(),
            "name": "the draft layer",
            "need": self.worker.host_pool_bytes(PoolSizes(**sizes)),
            "have": available_host_memory(),
        }

    def stats(self) -> dict:
        return dict(self.worker.stats)

    def timeline(self, record: bool) -> list:
        """As StageActor.timeline: [(method, step id, entered, left)] of ``proposals``,
        ``prepare`` and ``next``."""
        return self.timeline_records.swap(record)

    def proposals(self, plan: bytes) -> dict:
        """The proposals of the draft passes launched so far (req_id -> k drafts), for the
        stages of the plan about to run."""
        entered = self.timeline_records.enter()
        self.values = self.worker.held_values()
        self.timeline_records.left("proposals", decode(plan).step_id, entered)
        return self.values

    def prepare(self, plan: bytes) -> int:
        """The step's bookkeeping and staged bucket while the stages compute -> the step id
        ``next`` takes."""
        entered = self.timeline_records.enter()
        self.prepared = self.worker.prepare(plan := decode(plan), self.values)
        self.timeline_records.left("prepare", plan.step_id, entered)
        return plan.step_id

    def next(self, step_id: int, prev: StageResult) -> StageResult:
        entered = self.timeline_records.enter()
        prepared, self.prepared = self.prepared, None
        if prepared is None or prepared.plan.step_id != step_id:
            raise RuntimeError(f"step {step_id} reached a draft actor that prepared no such step")
        out = self.worker.execute_prepared(prepared, prev)
        self.timeline_records.left("next", step_id, entered)
        return out
