"""What a pipeline stage (StageSpec) and the draft worker (DraftSpec) load and how they compute:
the one argument of each worker and of its actor (the stages of a pipeline differ only in their
layer range)."""

from __future__ import annotations

import dataclasses

from dsv4ray.engine.config import EngineConfig


@dataclasses.dataclass(frozen=True)
class StageSpec:
    model: str  # a local checkpoint folder; a stage actor also takes a URI and fetches it
    start: int  # the stage's layers: [start, end)
    end: int
    kv_cache_dtype: str = "fp8"
    dtype: str | None = None  # compute dtype; None: the checkpoint's
    device: str = "cpu"
    weight_format: str = "auto"  # EngineConfig.weight_format
    cuda_graphs: bool = False  # capture decode steps (CUDA only)
    fp8_prefill: bool = False  # EngineConfig.fp8_prefill

    @classmethod
    def of(cls, ec: EngineConfig, start: int, end: int, model: str | None = None) -> StageSpec:
        """Layers [start, end) of an engine's pipeline; model: where this stage reads the
        checkpoint (default ec.model)."""
        return cls(model or ec.model, start, end, ec.kv_cache_dtype, ec.dtype, ec.device,
                   ec.weight_format, ec.cuda_graphs, ec.fp8_prefill)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class DraftSpec:
    model: str  # a local checkpoint folder; the draft actor also takes a URI and fetches it
    num_steps: int  # drafts per request and step (EngineConfig.speculative_num_steps)
    eagle_topk: int = 1
    kv_cache_dtype: str = "fp8"
    dtype: str | None = None
    device: str = "cpu"
    weight_format: str = "auto"  # EngineConfig.weight_format, as the stages take it
    fp8_prefill: bool = False  # EngineConfig.fp8_prefill, likewise

    @classmethod
    def of(cls, ec: EngineConfig, model: str | None = None) -> DraftSpec:
        return cls(model or ec.model, ec.speculative_num_steps, ec.speculative_eagle_topk,
                   ec.kv_cache_dtype, ec.dtype, ec.device, ec.weight_format,
                   ec.fp8_prefill)  # fmt: skip
