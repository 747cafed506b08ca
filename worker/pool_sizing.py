"""The pool sizing every pipeline shares, in process or over Ray: each stage sized by its own
layer slice, the pipeline taking the minimum, since one page id names a page in every stage. With
speculation every stage's compressor rings are doubled and the last stage, whose device the draft
layer shares, prices it as one more layer. Also the CUDA graph shapes every stage captures once
its pools are allocated.
"""

from __future__ import annotations

import dataclasses

from dsv4ray.cache.configurator import (
    bytes_per_full_token,
    pipeline_capacity,
    share_devices,
    size_stage,
)
from dsv4ray.cache.formats import KINDS
from dsv4ray.cache.hisparse_sizing import resolve_hot_rows
from dsv4ray.cache.layer_mapping import split_layers
from dsv4ray.cache.page_layout import layout_for
from dsv4ray.cache.pool_sizes import PoolSizes
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
    if not ec.cuda_graphs or ec.device != "cuda":
        return None
    max_len = ec.max_model_len or cfg.max_position_embeddings
    return ec.max_running_requests, min(max_len, cap.num_full_tokens)


def check_shared_host_memory(stages: list[dict], sizes: PoolSizes) -> None:
    """A ValueError naming the options when CPU stages that share a machine need more memory for
    their pools together than it has available. stages: one dict per stage, {"node", "start",
    "end" (or "name": the draft layer), "need": pool bytes, "have": available bytes on its node
    or None}; stages allocate at once, so each alone would see the whole machine free."""
    by_node: dict[str, list[dict]] = {}
    for stage in stages:
        by_node.setdefault(stage["node"], []).append(stage)
    for group in by_node.values():
        need = sum(stage["need"] for stage in group)
        known = [stage["have"] for stage in group if stage["have"] is not None]
        if len(group) < 2 or not known or need <= min(known):
            continue
        ranges = ", ".join(stage.get("name") or f"[{stage['start']}, {stage['end']})"
                           for stage in group)  # fmt: skip
        raise ValueError(
            f"stages {ranges} share one machine: their KV pools need {need / 2**30:.1f} GiB "
            f"together, more than the {min(known) / 2**30:.1f} GiB of memory it has available "
            f"({sizes.num_pages} pages, {sizes.num_state_slots - 1} running requests): lower "
            "max_total_tokens or max_running_requests"
        )


def available_host_memory() -> int | None:
    """Bytes this process may still allocate: MemAvailable of /proc/meminfo, or less where a
    cgroup (a container's memory limit) leaves less; None where neither can be read."""
    sizes = [_meminfo_available(), _cgroup_room()]
    known = [size for size in sizes if size is not None]
    return min(known) if known else None


MEMINFO = "/proc/meminfo"


def _meminfo_available() -> int | None:
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


CGROUP_FILES = (  # (limit, usage): cgroup v2, then v1
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def _cgroup_room() -> int | None:
    for limit_file, usage_file in CGROUP_FILES:
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:  # "max" (v2) or a huge number (v1): none
            return max(int(limit) - usage, 0)
    return None
