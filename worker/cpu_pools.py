"""What a stage's CPU pools take in host memory, priced by building them on the meta device, and
the check that they fit before they are allocated."""

from __future__ import annotations

import dataclasses

import torch

from dsv4ray.cache.pool_sizes import PoolSizes
from dsv4ray.cache.pools import StagePools
from dsv4ray.config import ModelConfig
from dsv4ray.worker.pool_sizing import available_host_memory


def host_pool_bytes(cfg: ModelConfig, start: int, end: int, sizes: PoolSizes,
                    kv_cache_dtype: str) -> int:  # fmt: skip
    """Bytes of the CPU pools of layers [start, end), priced without HiSparse: its host history
    holds as many C4 pages as the pools would (and a store allocates that history even for meta
    shapes)."""
    flat = dataclasses.replace(sizes, hisparse_hot_rows=0)
    return StagePools(cfg, start, end, flat, kv_cache_dtype, torch.device("meta")).nbytes()


def check_host_memory(cfg: ModelConfig, start: int, end: int, sizes: PoolSizes,
                      kv_cache_dtype: str) -> None:  # fmt: skip
    """A ValueError naming the options when the CPU pools of layers [start, end) need more than
    the memory this machine has available (pools are zero-filled: past it the allocation fails
    or the OOM killer ends the process)."""
    need, have = host_pool_bytes(cfg, start, end, sizes, kv_cache_dtype), available_host_memory()
    if have is not None and need > have:
        raise ValueError(
            f"stage [{start}, {end}): its KV pools need {need / 2**30:.1f} GiB, more than the "
            f"{have / 2**30:.1f} GiB of memory this machine has available ({sizes.num_pages} "
            f"pages, {sizes.num_state_slots - 1} running requests): lower max_total_tokens or "
            "max_running_requests"
        )
