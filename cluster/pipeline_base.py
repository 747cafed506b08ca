"""Pipelines the engine core drives: stages in this process, or stage actors over Ray.

Both have the same surface: ``capacity`` (the pipeline's pool sizes: the minimum over stages,
each sized by its own layer slice), ``depth`` (plans in flight), ``submit(plan) -> handle``,
``collect(handle) -> StageResult`` (the last stage's result), ``rebuild()`` and ``shutdown()``.
A dead stage surfaces as ``PipelineFailure``.
"""

from __future__ import annotations

from dsv4ray.cache.configurator import pipeline_capacity, size_stage
from dsv4ray.cache.layer_mapping import split_layers
from dsv4ray.cache.layout import layout_for
from dsv4ray.cache.pools import PoolSizes
from dsv4ray.cluster.engine_config import EngineConfig
from dsv4ray.cluster.plan import StepPlan
from dsv4ray.cluster.worker import StageResult, StageWorker
from dsv4ray.config import ModelConfig


class PipelineFailure(RuntimeError):
    """A stage of the pipeline died or stopped answering."""


def size_pipeline(cfg: ModelConfig, ec: EngineConfig, available: list[float | None]):
    """Pools of every stage from its own layer slice; the pipeline takes the minimum (seed 004)."""
    entry_bytes = {
        k: layout_for(k, ec.kv_cache_dtype).bytes_per_entry
        for k in ("window", "c4", "c128", "indexer")
    }
    skip = [spec.skip_topk for spec in cfg.layers]
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
        )
        for i, (start, end) in enumerate(split_layers(cfg.num_hidden_layers, ec.pp_size))
    ]
    return pipeline_capacity(caps)


def pool_sizes(cap) -> PoolSizes:
    return PoolSizes(
        cap.num_pages, cap.num_window_pages, cap.num_state_slots, cap.num_cached_state_slots
    )


class LocalPipeline:
    """Stage workers called in order in this process (pp_size 1, or tests of a split)."""

    depth = 1

    def __init__(self, config: EngineConfig, cfg: ModelConfig) -> None:
        self.config, self.cfg = config, cfg
        self._build()

    def _build(self) -> None:
        ec, cfg = self.config, self.cfg
        self.workers = [
            StageWorker(ec.model, s, e, ec.kv_cache_dtype, ec.dtype, ec.device, cfg)
            for s, e in split_layers(cfg.num_hidden_layers, ec.pp_size)
        ]
        self.capacity = size_pipeline(
            cfg, ec, [w.available_bytes(ec.memory_fraction) for w in self.workers]
        )
        for w in self.workers:
            w.allocate(pool_sizes(self.capacity))

    def submit(self, plan: StepPlan) -> StageResult:
        result = None
        for worker in self.workers:
            result = worker.execute(plan, result)
        return result

    def collect(self, handle: StageResult) -> StageResult:
        return handle

    def rebuild(self) -> None:
        self._build()

    def shutdown(self) -> None:
        self.workers = []


def make_pipeline(config: EngineConfig, cfg: ModelConfig, placement=None):
    """In-process when pp_size == 1 and use_ray is not forced; Ray stage actors otherwise."""
    if config.uses_ray or placement is not None:
        from dsv4ray.cluster.pipeline import RayPipeline

        return RayPipeline(config, cfg, placement)
    return LocalPipeline(config, cfg)
