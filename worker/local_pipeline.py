"""LocalPipeline: stage workers called in order in this process (the engine.pipeline protocol),
then the draft worker when speculative decoding is on, and the pool sizing every pipeline
shares: each stage sized by its own layer slice, the pipeline taking the minimum, since one page
id names a page in every stage. With speculation every stage's compressor rings are doubled and
the last stage, whose device the draft layer shares, prices it as one more layer.
"""

from __future__ import annotations

import dataclasses
import gc

import torch

from dsv4ray.cache.configurator import (
    bytes_per_full_token,
    pipeline_capacity,
    share_devices,
    size_stage,
)
from dsv4ray.cache.hisparse_sizing import resolve_hot_rows
from dsv4ray.cache.layer_mapping import split_layers
from dsv4ray.cache.layout import KINDS, layout_for
from dsv4ray.cache.pools import PoolSizes
from dsv4ray.config import ModelConfig
from dsv4ray.engine.config import EngineConfig
from dsv4ray.engine.plan import StageResult, StepPlan
from dsv4ray.worker.draft import DraftWorker
from dsv4ray.worker.draft_fill import DraftFill
from dsv4ray.worker.stage_spec import DraftSpec, StageSpec
from dsv4ray.worker.stage_worker import StageWorker


def size_pipeline(cfg: ModelConfig, ec: EngineConfig, available: list[float | None],
                  devices: list[str | None] | None = None):  # fmt: skip
    """Pools of every stage from its own layer slice; the pipeline takes the minimum. devices:
    each stage's GPU (stages on one GPU split the free memory they all measured)."""
    entry_bytes = {k: layout_for(k, ec.kv_cache_dtype).bytes_per_entry for k in KINDS}
    skip = [spec.skip_topk for spec in cfg.layers]
    ranges = split_layers(cfg.num_hidden_layers, ec.pp_size)
    speculative = ec.speculative_num_steps > 0  # the last stage's device holds the MTP layer
    hot_rows = resolve_hot_rows(cfg.index_topk, ec.hisparse_hot_rows) if ec.enable_hisparse else 0
    if devices is not None:
        weights = [
            bytes_per_full_token(
                cfg.layer_ratios[s:e],
                skip[s:e],
                entry_bytes,
                mtp=speculative and i == len(ranges) - 1,
            )  # fmt: skip
            for i, (s, e) in enumerate(ranges)
        ]
        available = share_devices(available, devices, weights)
    caps = [
        size_stage(
            i,
            start,
            end,
            cfg.layer_ratios,
            skip,
            entry_bytes,
            available_bytes=available[i],
            max_total_tokens=ec.resolved_max_total_tokens,
            max_running_requests=ec.max_running_requests,
            max_num_batched_tokens=ec.max_num_batched_tokens,
            speculative=ec.ring_scale > 1,
            hosts_draft=speculative and i == len(ranges) - 1,
            hisparse_hot_rows=hot_rows,
            hisparse_host_tokens=ec.hisparse_host_tokens,
        )
        for i, (start, end) in enumerate(ranges)
    ]
    return dataclasses.replace(pipeline_capacity(caps), hisparse_hot_rows=hot_rows)


def pool_sizes(cap, ring_scale: int = 1) -> PoolSizes:
    """The pools every stage (and the draft worker) allocates; ring_scale: EngineConfig's."""
    return PoolSizes(
        cap.num_pages,
        cap.num_window_pages,
        cap.num_state_slots,
        cap.num_cached_state_slots,
        ring_scale=ring_scale,
        hisparse_hot_rows=cap.hisparse_hot_rows,
    )


def graph_shapes(ec: EngineConfig, cfg: ModelConfig, cap) -> tuple[int, int] | None:
    """(largest batch, longest context) of the CUDA graphs every stage of a CUDA engine (and its
    draft worker) captures once its pools are allocated; None on CPU or with cuda_graphs off."""
    if not ec.cuda_graphs or torch.device(ec.device).type != "cuda":
        return None
    max_len = ec.max_model_len or cfg.max_position_embeddings
    return ec.max_running_requests, min(max_len, cap.num_full_tokens)


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
        self.last_drafts = result.pending_drafts
        return result

    def collect(self, handle: StageResult) -> StageResult:
        fill = self.fills.pop(handle.step_id, None)
        if fill is not None:  # settling reads the drafts
            handle.resolved_drafts = fill.resolve()
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
