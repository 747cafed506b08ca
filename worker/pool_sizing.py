"""The pool sizing every pipeline shares, in process or over Ray: each stage sized by its own
layer slice, the pipeline taking the minimum, since one page id names a page in every stage. With
speculation every stage's compressor rings are doubled and the last stage, whose device the draft
layer shares, prices it as one more layer. Also the CUDA graph shapes every stage captures once
its pools are allocated.
"""

from __future__ import annotations

import dataclasses

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
