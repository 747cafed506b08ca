"""LocalPipeline: stage workers called in order in this process (the engine.pipeline protocol),
and the pool sizing every pipeline shares: each stage sized by its own layer slice, the
pipeline taking the minimum, since one page id names a page in every stage.
"""

from __future__ import annotations

import dataclasses

from dsv4ray.cache.configurator import pipeline_capacity, size_stage
from dsv4ray.cache.hisparse_sizing import resolve_hot_rows
from dsv4ray.cache.layer_mapping import split_layers
from dsv4ray.cache.layout import KINDS, layout_for
from dsv4ray.cache.pools import PoolSizes
from dsv4ray.config import ModelConfig
from dsv4ray.engine.config import EngineConfig
from dsv4ray.engine.plan import StageResult, StepPlan
from dsv4ray.worker.stage_worker import StageWorker


def size_pipeline(cfg: ModelConfig, ec: EngineConfig, available: list[float | None]):
    """Pools of every stage from its own layer slice; the pipeline takes the minimum."""
    entry_bytes = {k: layout_for(k, ec.kv_cache_dtype).bytes_per_entry for k in KINDS}
    skip = [spec.skip_topk for spec in cfg.layers]
    hot_rows = resolve_hot_rows(cfg.index_topk, ec.hisparse_hot_rows) if ec.enable_hisparse else 0
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
            hisparse_hot_rows=hot_rows,
            hisparse_host_tokens=ec.hisparse_host_tokens,
        )
        for i, (start, end) in enumerate(split_layers(cfg.num_hidden_layers, ec.pp_size))
    ]
    return dataclasses.replace(pipeline_capacity(caps), hisparse_hot_rows=hot_rows)


def pool_sizes(cap) -> PoolSizes:
    return PoolSizes(
        cap.num_pages,
        cap.num_window_pages,
        cap.num_state_slots,
        cap.num_cached_state_slots,
        hisparse_hot_rows=cap.hisparse_hot_rows,
    )


class LocalPipeline:
    """Stage workers called in order in this process (pp_size 1, or tests of a split)."""

    depth = 1
    host_lost = False  # no host tier in process

    def __init__(self, config: EngineConfig, cfg: ModelConfig) -> None:
        self.config, self.cfg = config, cfg
        self._build()

    def _build(self) -> None:
        ec, cfg = self.config, self.cfg
        self.workers = [
            StageWorker(ec.model, s, e, ec.kv_cache_dtype, ec.dtype, ec.device, cfg, ec.cuda_graphs)
            for s, e in split_layers(cfg.num_hidden_layers, ec.pp_size)
        ]
        self.capacity = size_pipeline(
            cfg, ec, [w.available_bytes(ec.memory_fraction) for w in self.workers]
        )
        max_len = ec.max_model_len or cfg.max_position_embeddings
        max_len = min(max_len, self.capacity.num_full_tokens)
        for w in self.workers:
            w.allocate(pool_sizes(self.capacity))
            w.capture_graphs(ec.max_running_requests, max_len)

    def submit(self, plan: StepPlan) -> StageResult:
        result = None
        for worker in self.workers:
            result = worker.execute(plan, result)
        return result

    def collect(self, handle: StageResult) -> StageResult:
        return handle

    def rebuild(self) -> None:
        self._build()

    def attach_host(self, num_pages: int, num_snapshots: int) -> None:
        raise ValueError("the host tier needs Ray stage actors (use_ray)")

    def host_alive(self) -> bool:
        return True

    def drop_host(self) -> None:
        """No host tier is ever attached in process."""

    def placement(self) -> dict:
        """Where the stages run: this process."""
        return {"stage_placement_group_id": None}

    def stage_stats(self) -> list[dict]:
        return [w.stats() for w in self.workers]

    def shutdown(self) -> None:
        self.workers = []
