"""The draft worker's pools: the MTP layer's window pages (and, for a DSA-style draft, its C4
pages and compressor rings), shaped like a one-layer StagePools so the paged forward runs on them.

Index spaces (the scheduler's ids, as in every stage):

    window pool  [num_window_pages + num_state_slots] pages: ids below num_window_pages are the
                 scheduler's window pages (slot = id * 128 + pos % 128); page
                 num_window_pages + s is the scratch page of state slot s. Chain draft steps
                 (positions past the verified ones) write their window KV there, so nothing a
                 draft proposes lands in a real window page
    C4 pool      [num_pages] pages: entry of full slot f = page_ids[f // 256] * 64 + (f % 256) // 4
    C4 ring      [num_state_slots + num_cached_state_slots + 1, 8, 2 * head_dim] fp32 rows
                 [kv | score + ape]: running requests (row of position p = p % 8), then
                 cached-state snapshots, then one scratch row for chain steps (they complete no
                 entry, so nothing reads what they write)
"""

from __future__ import annotations

import torch

from dsv4ray.cache.layer_mapping import LayerInfo
from dsv4ray.cache.page_layout import layout_for
from dsv4ray.cache.pool_sizes import C4_RING, PoolSizes
from dsv4ray.cache.pools import device_index
from dsv4ray.config import ModelConfig


class DraftPools:
    """Pools of the MTP layer in kv_cache_dtype ``dtype``."""

    def __init__(
        self, cfg: ModelConfig, sizes: PoolSizes, dtype: str, device: torch.device | str = "cpu"
    ) -> None:
        spec = cfg.mtp_layer
        if spec is None or spec.compress_ratio not in (0, 4):
            raise ValueError("a draft layer is window-only (ratio 0) or DSA-style (ratio 4)")
        self.sizes, self.layer_id, ratio = sizes, spec.layer_id, spec.compress_ratio
        self.layouts = {k: layout_for(k, dtype) for k in ("window", "c4", "c128", "indexer")}
        num_windows = sizes.num_window_pages + sizes.num_state_slots
        self.window = [self._pages("window", num_windows, device)]
        self._info = LayerInfo(self.layer_id, 0, ratio, 0 if ratio == 4 else None, None)
        self.c4, self.c4_state = [], []
        self.c128, self.c128_state, self.indexer, self.indexer_state = [], [], [], []
        self.hisparse = None  # the draft layer's C4 entries stay on the device
        if ratio == 4:
            rows = sizes.num_state_slots + sizes.num_cached_state_slots + 1
            self.c4 = [self._pages("c4", sizes.num_pages, device)]
            kv = torch.zeros(rows, C4_RING, 2 * cfg.head_dim, dtype=torch.float32, device=device)
            self.c4_state = [(kv, torch.full_like(kv, float("-inf")))]

    def _pages(self, kind: str, num: int, device) -> torch.Tensor:
        return torch.zeros(num, self.layouts[kind].page_bytes, dtype=torch.uint8, device=device)

    def info(self, layer_id: int) -> LayerInfo:
        if layer_id != self.layer_id:
            raise ValueError(f"layer {layer_id} is not the draft layer {self.layer_id}")
        return self._info

    def scratch_page(self, state_slot: int) -> int:
        return self.sizes.num_window_pages + state_slot

    @property
    def scratch_row(self) -> int:
        return self.sizes.num_state_slots + self.sizes.num_cached_state_slots

    def cached_row(self, cached_slot: int) -> int:
        return self.sizes.num_state_slots + cached_slot

    def reset_rings(self, rows: list[int]) -> None:
        """Empty ring rows: kv = 0, score = -inf."""
        if rows and self.c4_state:
            kv, score = self.c4_state[0]
            idx = device_index(rows, kv.device)
            kv.index_fill_(0, idx, 0.0)
            score.index_fill_(0, idx, float("-inf"))

    def copy_rings(self, src_rows: list[int], dst_rows: list[int]) -> None:
        if src_rows and self.c4_state:
            kv, score = self.c4_state[0]
            src, dst = device_index(src_rows, kv.device), device_index(dst_rows, kv.device)
            kv.index_copy_(0, dst, kv.index_select(0, src))
            score.index_copy_(0, dst, score.index_select(0, src))

    def nbytes(self) -> int:
        tensors = self.window + self.c4 + [t for pair in self.c4_state for t in pair]
        return sum(t.numel() * t.element_size() for t in tensors)
