"""One stage's device pools: preallocated byte pages per layer and kind, plus compressor rings.

Index spaces:

    window pool, one buffer per stage layer (local id):  slot = window_page_id * 128 + pos % 128
    C4 / C4 indexer / C128 pools, one buffer per compress (or indexer) layer id:
        entry of full slot f = page_ids[f // 256] * (256 // ratio) + (f % 256) // ratio
        (the page id of a logical full page names the same page in every compressed pool)
    compressor rings [num_state_slots + num_cached_state_slots, ring, width] fp32:
        rows 0 .. S-1 belong to running requests (row of position p = p % ring); rows S.. hold
        cached-state snapshots (C4 main + indexer rings at a 256-token boundary)

Every page buffer is a uint8 tensor [num_pages, page_bytes] in the layout of cache/layout.py.
With HiSparse (sizes.hisparse_hot_rows > 0) the C4 buffers c4[i] are the host history of
cache/hisparse.py (same page ids, host memory) and the device holds only its hot rows.
"""

from __future__ import annotations

import torch

from dsv4ray.cache.hisparse import HiSparseStore
from dsv4ray.cache.layer_mapping import LayerInfo, build_layer_mapping, stage_layers
from dsv4ray.cache.page_layout import layout_for
from dsv4ray.cache.pool_sizes import C4_RING, C128_RING, PoolSizes
from dsv4ray.config import ModelConfig


class StagePools:
    """Pools of the layers [start, end) of one stage, in kv_cache_dtype ``dtype``."""

    def __init__(
        self,
        cfg: ModelConfig,
        start: int,
        end: int,
        sizes: PoolSizes,
        dtype: str,
        device: torch.device | str = "cpu",
    ) -> None:
        self.cfg, self.start, self.end, self.sizes, self.dtype = cfg, start, end, sizes, dtype
        skip = [spec.skip_topk for spec in cfg.layers]
        self.mapping = build_layer_mapping(cfg.layer_ratios, skip, start, end)
        self.layouts = {
            kind: layout_for(kind, dtype) for kind in ("window", "c4", "c128", "indexer")
        }
        infos = list(stage_layers(self.mapping, start, end))
        self.window = [self._pages("window", sizes.num_window_pages, device) for _ in infos]
        num_c4 = sum(1 for i in infos if i.compress_ratio == 4)
        self.hisparse: HiSparseStore | None = None
        if sizes.hisparse_hot_rows:
            self.hisparse = HiSparseStore(
                num_c4, sizes.num_state_slots, sizes.hisparse_hot_rows, sizes.num_pages, dtype,
                device,
            )  # fmt: skip
            self.c4 = self.hisparse.history
        else:
            self.c4 = [self._pages("c4", sizes.num_pages, device) for _ in range(num_c4)]
        self.c128 = [
            self._pages("c128", sizes.num_pages, device) for i in infos if i.compress_ratio == 128
        ]
        self.indexer = [
            self._pages("indexer", sizes.num_pages, device)
            for i in infos
            if i.indexer_layer_id is not None
        ]
        rows = sizes.num_state_slots + sizes.num_cached_state_slots
        ring4, ring128 = C4_RING * sizes.ring_scale, C128_RING * sizes.ring_scale
        dim, idim = cfg.head_dim, cfg.index_head_dim
        self.c4_state = [_ring(rows, ring4, 2 * dim, device) for _ in self.c4]
        self.indexer_state = [_ring(rows, ring4, 2 * idim, device) for _ in self.indexer]
        # C128 rings never need snapshots: matched prefixes end on 256-token boundaries. Every
        # layer's ring is a view of one [layers, slots, ring, dim] pair, so that a rollback of
        # rejected drafts empties its rows in every layer at once.
        self._c128_rings = _ring((len(self.c128), sizes.num_state_slots), ring128, dim, device)
        kv, score = self._c128_rings  # one view per layer (not unbind's: those refuse writes)
        self.c128_state = [(kv[i], score[i]) for i in range(len(self.c128))]

    def _pages(self, kind: str, num: int, device) -> torch.Tensor:
        return torch.zeros(num, self.layouts[kind].page_bytes, dtype=torch.uint8, device=device)

    def info(self, layer_id: int) -> LayerInfo:
        info = self.mapping[layer_id]
        if info is None:
            raise ValueError(f"layer {layer_id} is not in this stage [{self.start}, {self.end})")
        return info

    def reset_rings(self, slots: list[int]) -> None:
        """Empty rows: kv = 0, score = -inf (a fresh request, or one restarting from scratch);
        with HiSparse its hot rows are emptied too."""
        if not slots:
            return
        self.reset_hot_rows(slots)
        idx = device_index(slots, self._device)
        for kv, score in self.c4_state + self.indexer_state + self.c128_state:
            kv.index_fill_(0, idx, 0.0)  # a scalar argument: `kv[idx] = 0.0` copies it over
            score.index_fill_(0, idx, float("-inf"))  # with a blocking copy

    def reset_hot_rows(self, slots: list[int]) -> None:
        """With HiSparse, empties the hot rows of `slots` (their rings left as they are)."""
        if self.hisparse is not None and slots:
            self.hisparse.reset_slots(slots)

    def reset_c128_rows(self, resets: list[tuple[int, range]]) -> None:
        """Empties the C128 ring rows of positions that rejected draft tokens wrote: resets
        [(state slot, positions)], in every C128 layer with one fill of each tensor."""
        kv, score = self._c128_rings  # [layers, slots, ring, dim]
        layers, slots, ring, dim = kv.shape
        rows = [slot * ring + p % ring for slot, positions in resets for p in positions]
        if not layers or not rows:
            return
        flat = [layer * slots * ring + row for layer in range(layers) for row in rows]
        idx = device_index(flat, self._device)
        kv.view(-1, dim).index_fill_(0, idx, 0.0)
        score.view(-1, dim).index_fill_(0, idx, float("-inf"))

    def copy_c4_rings(self, src_rows: list[int], dst_rows: list[int]) -> None:
        """Copies the C4 main + indexer rings between rows (snapshot in, or restore out)."""
        if not src_rows:
            return
        src, dst = device_index(src_rows, self._device), device_index(dst_rows, self._device)
        for kv, score in self.c4_state + self.indexer_state:
            kv.index_copy_(0, dst, kv.index_select(0, src))
            score.index_copy_(0, dst, score.index_select(0, src))

    def cached_row(self, cached_slot: int) -> int:
        return self.sizes.num_state_slots + cached_slot

    @property
    def _device(self) -> torch.device:
        return self.window[0].device

    def nbytes(self) -> int:
        """Device bytes (a HiSparse history lives in host memory and is not counted)."""
        tensors = self.window + self.c128 + self.indexer
        tensors += self.c4 if self.hisparse is None else []
        tensors += [
            t for pair in self.c4_state + self.indexer_state + self.c128_state for t in pair
        ]
        hisparse = self.hisparse.device_bytes() if self.hisparse is not None else 0
        return sum(t.numel() * t.element_size() for t in tensors) + hisparse


def _ring(rows, ring: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty rings [*rows, ring, width] (rows: an int or a tuple of leading dims)."""
    shape = (*(rows if isinstance(rows, tuple) else (rows,)), ring, width)
    kv = torch.zeros(shape, dtype=torch.float32, device=device)
    score = torch.full(shape, float("-inf"), dtype=torch.float32, device=device)
    return kv, score


def device_index(values: list[int], device: torch.device) -> torch.Tensor:
    """Host ints as an int64 index on ``device`` without waiting for the device: a blocking copy
    (``torch.tensor(..., device=)``, or a Python scalar assigned through a tensor index) waits
    for everything queued before it, such as the draft pass of the step before, which the host
    means to overlap."""
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)
