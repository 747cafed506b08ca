"""LocalPipeline: stage workers called in order in this process (the engine.pipeline protocol),
then the draft worker when speculative decoding is on; pools sized as every pipeline sizes them
(worker/pool_sizing.py).
"""

from __future__ import annotations

import gc

import torch

from dsv4ray.cache.layer_mapping import split_layers
from dsv4ray.config import ModelConfig
from dsv4ray.engine.config import EngineConfig
from dsv4ray.engine.plan import StageResult, StepPlan
from dsv4ray.worker.pool_sizing import graph_shapes, pool_sizes, size_pipeline
from dsv4ray.worker.spec.draft import DraftWorker
from dsv4ray.worker.spec.draft_fill import DraftFill
from dsv4ray.worker.stage_spec import DraftSpec, StageSpec
from dsv4ray.worker.stage_worker import StageWorker


def draft_worker(ec: EngineConfig, cfg: ModelConfig) -> DraftWorker:
    return DraftWorker(DraftSpec.of(ec), cfg)


class LocalPipeline:
    """Stage workers called in order in this process (pp_size 1, or several stages sharing this
    process's device), then the draft worker."""

    host_lost = False  # no host tier in process

    def __init__(self, config: EngineConfig, cfg: ModelConfig) -> None:
        self.config, self.cfg = config, cfg
        # overlap scheduling: a second plan is submitted while the first one's samples are read
        self.depth = 2 if config.uses_overlap else 1
        self._build()

    def _build(self) -> None:
        ec, cfg = self.config, self.cfg
        self.workers = [
            StageWorker(StageSpec.of(ec, s, e), cfg)
            for s, e in split_layers(cfg.num_hidden_layers, ec.pp_size)
        ]
        self.draft = draft_worker(ec, cfg) if ec.speculative_num_steps else None
        if self.draft is not None:  # its proposals stay on the device for the next plan
            self.draft.defer_drafts = True
        self.last_drafts = None  # the last step's PendingDrafts
        self.fills: dict[int, DraftFill] = {}  # step id -> its plan's pending drafts
        available = [w.available_bytes(ec.memory_fraction) for w in self.workers]
        self.capacity = size_pipeline(cfg, ec, available, [w.gpu_uuid() for w in self.workers])
        sizes = pool_sizes(self.capacity, ec.ring_scale)
        for w in self.workers:
            w.allocate(sizes)
        if self.draft is not None:
            self.draft.allocate(sizes)
        graphs = graph_shapes(ec, cfg, self.capacity)
        if graphs is not None:
            max_batch, max_len = graphs
            for w in self.workers:  # with drafts: verification graphs
                w.capture_graphs(max_batch, max_len, ec.speculative_num_steps)
            if self.draft is not None:
                self.draft.capture_graphs(max_batch, max_len)

    def submit(self, plan: StepPlan) -> StageResult:
        """Runs the plan; with overlap scheduling the sampled ids stay on the device until
        ``collect``, so the host can build the next plan while the device computes. Drafts of
        plan.draft_lookahead come from the last step's proposals on the device."""
        plan.lag = self.depth > 1  # the last stage hands its sampled ids to the first
        plan.take = plan.lag and len(self.workers) > 1
        fill = None
        if plan.draft_lookahead:
            if self.last_drafts is None:
                raise RuntimeError(f"step {plan.step_id} has pending drafts but none were proposed")
            fill = self.fills[plan.step_id] = DraftFill(plan, self.last_drafts)
        result = None
        for worker in self.workers[:-1]:
            result = worker.execute(plan, result, draft_fill=fill)
        # a draft worker with graphs takes a replayed verification's rows on the device
        handoff = self.draft is not None and self.draft.graphs is not None
        last = self.workers[-1]
        result = last.execute(plan, result, self.depth > 1, handoff, fill)
        if self.draft is None:
            return self.workers[0].take(plan, result) if len(self.workers) > 1 else result
        result = self.draft.execute(plan, result, fill)
        self.last_drafts = result.spec.pending if result.spec is not None else None
        return result

    def collect(self, handle: StageResult) -> StageResult:
        for abandoned in [s for s in self.fills if s < handle.step_id]:  # an interrupted
            del self.fills[abandoned]  # caller's step, never collected
        fill = self.fills.pop(handle.step_id, None)
        if fill is not None:  # settling reads the drafts
            handle.spec_section().resolved = fill.resolve()
        return self.workers[-1].finish(handle)

    def rebuild(self) -> None:
        self._build()

    def attach_host(self, num_pages: int, num_snapshots: int) -> None:
        raise ValueError("the host tier needs Ray stage actors (use_ray)")

    def host_alive(self) -> bool:
        return True

    def drop_host(self) -> None:
        """No host tier is ever attached in process."""

    def placement(self) -> dict:
        """Where the stages run (this process) and whether a draft worker runs beside them."""
        return {"stage_placement_group_id": None, "draft_worker": self.draft is not None}

    def stages_alive(self) -> bool:
        return True  # the stages are this process

    def draft_lost(self) -> bool:
        """A draft worker in process fails with the process, never alone."""
        return False

    def stage_stats(self) -> list[dict]:
        return [w.stats() for w in self.workers]

    def shutdown(self) -> None:
        on_cuda = any(w.device.type == "cuda" for w in self.workers)
        self.workers, self.draft = [], None
        if on_cuda:  # hand the pools and graph memory back, for the next engine of this process
            gc.collect()
            torch.cuda.empty_cache()
