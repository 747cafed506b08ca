"""A C4 layer's cache in one step: all on the device, or HiSparse (cache/hisparse.py).

paged_attention takes ``c4_cache(pools, meta, info)`` and makes three uses of it:

    cache.pages, cache.out_loc   the step's C4 buffer and the slot each token's compressor writes
    cache.written()              after the compressor (HiSparse: the new entries go to the host)
    cache.read(topk)             logical C4 positions [T, K] -> (pages, physical slots [T, K])

With HiSparse a step has one of two shapes (the same for every C4 layer of the stage):

  decode: every request runs one token (meta.hisparse_step is None, as in a captured graph). The
    step's buffer is the hot buffer: a block-completing token's entry goes to its request's
    reserved row and to its host history slot; the top-k swap into hot rows (misses copied from
    the host token by token) and attention reads those rows. Everything derives from the batch
    tensors on the device: no host array, no sync.
  scratch: some request runs several tokens (a prefill chunk; ``scratch_step`` builds the plan).
    The step's buffer is scratch, shared by the stage's C4 layers in turn:
        region of a multi-token request: its C4 positions 0 .. end // 4 at region_base + c,
            pages before the chunk loaded from the host history (whole page rows)
        mirror of a single-token request: K + 1 slots from mirror_base, its top-k rows copied
            from its hot rows (after the swap-in) and the entry its compressor writes
    New entries go to the host history; a single-token request's also to its reserved row.

``c4_write_locations`` is the only place that turns a compressor write into buffer slots: the
logical C4 slot (meta.c4_out) addresses the host history, never a device row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dsv4ray.cache.formats import PAGE_SIZE
from dsv4ray.cache.hisparse import C4_PER_PAGE, HiSparseStore
from dsv4ray.cache.layer_mapping import LayerInfo
from dsv4ray.cache.pools import StagePools
from dsv4ray.engine.plan import StepPlan
from dsv4ray.kernels import dispatch
from dsv4ray.worker.batch import BatchMeta, HostStage

_FIELDS = ("region_base", "mirror_base", "swap_slots")


class DeviceC4:
    """All C4 entries in the device pool at their logical slots."""

    def __init__(self, pages: torch.Tensor, meta: BatchMeta) -> None:
        self.pages, self.out_loc, self.meta = pages, meta.c4_out, meta

    def written(self) -> None:
        """Nothing to copy: the compressor wrote the pool itself."""

    def read(self, topk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pages, self.meta.c4_slots(topk)


@dataclass
class ScratchStep:
    """A step where some request runs several tokens (device tensors, one upload).

    buffer [pages, c4 page bytes]: scratch shared by the stage's C4 layers;
    load_src / load_dst [N]: host history page -> scratch page (history before each chunk);
    per token [T]: region_base (scratch slot of its request's C4 position 0; -1 for single-token
    requests), mirror_base (first of its request's num_k + 1 mirror slots; -1 for multi-token
    requests), swap_slots (state slot of a single-token request's token, else -1).
    """

    buffer: torch.Tensor
    load_src: torch.Tensor
    load_dst: torch.Tensor
    region_base: torch.Tensor
    mirror_base: torch.Tensor
    swap_slots: torch.Tensor
    num_k: int


@dataclass
class C4Writes:
    """Where each token's new C4 entry goes ([T] int64, -1: none): device = slot in the step's
    buffer the compressor writes; host = logical C4 slot in the host history; reserved = hot row
    the entry is copied to after the compressor (scratch steps; None when device is that row);
    new_pos = the C4 position the request's reserved row holds from this step."""

    device: torch.Tensor
    host: torch.Tensor
    reserved: torch.Tensor | None
    new_pos: torch.Tensor


def c4_write_locations(store: HiSparseStore, meta: BatchMeta, step: ScratchStep | None):
    """The one translation of compressor write locations with HiSparse (see C4Writes)."""
    done = meta.c4_out >= 0  # the token completes a block: entry c4_bound - 1 of its request
    reserved_row = store.reserved_rows(meta.state_slots)
    if step is None:
        device = torch.where(done, reserved_row, -1)
        return C4Writes(device, meta.c4_out, None, torch.where(done, meta.c4_bound - 1, -1))
    single = step.mirror_base >= 0
    region_slot = step.region_base + meta.c4_bound - 1  # its C4 position in the region
    device = torch.where(single, step.mirror_base + step.num_k, region_slot)
    reserved = torch.where(done & single, reserved_row, -1)
    new_pos = torch.where(reserved >= 0, meta.c4_bound - 1, -1)
    return C4Writes(torch.where(done, device, -1), meta.c4_out, reserved, new_pos)


class HiSparseC4:
    """One C4 layer (buffer `layer`) of a HiSparse stage in one step."""

    def __init__(self, store: HiSparseStore, meta: BatchMeta, layer: int) -> None:
        self.store, self.meta, self.step = store, meta, meta.hisparse_step
        self.history, self.hot = store.history[layer], store.hot[layer]
        self.layer = layer
        self.writes = c4_write_locations(store, meta, self.step)
        self.out_loc = self.writes.device
        if self.step is None:
            self.pages = self.hot
        else:
            self.pages = self.step.buffer
            dispatch.transfer_page_rows(
                [self.history], [self.pages], self.step.load_src, self.step.load_dst
            )

    def written(self) -> None:
        layout, w = self.store.layout, self.writes
        dispatch.transfer_cache_dsv4_mla([self.pages], [self.history], w.device, w.host, layout)
        if w.reserved is not None:
            dispatch.transfer_cache_dsv4_mla([self.pages], [self.hot], w.device, w.reserved, layout)

    def read(self, topk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        topk = topk.contiguous()
        phys = self._swap_in(topk)
        if self.step is None:
            return self.hot, phys
        step, layout = self.step, self.store.layout
        if topk.shape[1] != step.num_k:
            raise ValueError(f"top-k has {topk.shape[1]} columns, the step planned {step.num_k}")
        cols = torch.arange(step.num_k, device=topk.device)
        mirror = torch.where(phys >= 0, step.mirror_base[:, None] + cols, -1)
        dispatch.transfer_cache_dsv4_mla(
            [self.hot], [self.pages], phys.reshape(-1), mirror.reshape(-1), layout
        )
        region = torch.where(topk >= 0, step.region_base[:, None] + topk, -1)
        return self.pages, torch.where(step.mirror_base[:, None] >= 0, mirror, region)

    def _swap_in(self, topk: torch.Tensor) -> torch.Tensor:
        """Hot rows of the top-k (physical hot slots [T, K]), misses copied from the host."""
        store, i, meta = self.store, self.layer, self.meta
        slots = meta.state_slots if self.step is None else self.step.swap_slots
        phys, src, dst = dispatch.hisparse_swap_in(
            topk, slots, self.writes.new_pos, meta.page_table, meta.req_rows, store.row_pos[i],
            store.row_age[i], store.clock[i], store.counters[i],
        )  # fmt: skip
        dispatch.transfer_cache_dsv4_mla([self.history], [self.hot], src, dst, store.layout)
        return phys


def c4_cache(pools: StagePools, meta: BatchMeta, info: LayerInfo):
    """The C4 cache of layer `info` in this step (a DeviceC4 or a HiSparseC4)."""
    if pools.hisparse is None:
        return DeviceC4(pools.c4[info.compress_layer_id], meta)
    return HiSparseC4(pools.hisparse, meta, info.compress_layer_id)


def scratch_step(
    plan: StepPlan, pools: StagePools, tables: dict, num_k: int, device, stage: HostStage | None
) -> ScratchStep | None:
    """The scratch plan of a step in which some request runs several tokens; None otherwise
    (no HiSparse, or a decode step)."""
    if pools.hisparse is None or all(e.num_tokens == 1 for e in plan.batch):
        return None
    arrays, loads, num_slots = _scratch_arrays(plan, tables, num_k)
    flat = np.concatenate([arrays[name] for name in _FIELDS] + [loads[0], loads[1]])
    dev = (stage or HostStage()).upload(flat, device)
    num_tokens, num_loads = len(arrays["region_base"]), len(loads[0])
    views = dev[: 3 * num_tokens].view(3, num_tokens)
    layout = pools.hisparse.layout
    num_pages = max(1, -(-num_slots // C4_PER_PAGE))
    buffer = torch.empty(num_pages, layout.page_bytes, dtype=torch.uint8, device=device)
    load = dev[3 * num_tokens :].view(2, num_loads)
    return ScratchStep(buffer, load[0], load[1], views[0], views[1], views[2], num_k)


def _scratch_arrays(plan: StepPlan, tables: dict, num_k: int):
    """numpy per-token fields, (load_src, load_dst) pages and the scratch slots needed: regions
    (whole pages, from scratch page 0) first, then the mirrors."""
    per_token = {name: [] for name in _FIELDS}
    src, dst, page_cursor, mirrors = [], [], 0, []
    for entry in plan.batch:
        n = entry.num_tokens
        region = mirror = swap = -1
        if n > 1:
            end = entry.start_pos + n
            history = -(-entry.start_pos // PAGE_SIZE)  # pages holding entries before the chunk
            src += tables[entry.req_id].page_ids[:history].tolist()
            dst += range(page_cursor, page_cursor + history)
            region = page_cursor * C4_PER_PAGE
            page_cursor += -(-end // PAGE_SIZE)
        else:
            mirror, swap = len(mirrors), tables[entry.req_id].state_slot
            mirrors.append(mirror)
        for name, value in zip(_FIELDS, (region, mirror, swap), strict=True):
            per_token[name] += [value] * n
    mirror_start = page_cursor * C4_PER_PAGE
    arrays = {name: np.asarray(v, dtype=np.int64) for name, v in per_token.items()}
    single = arrays["mirror_base"] >= 0
    arrays["mirror_base"][single] = mirror_start + arrays["mirror_base"][single] * (num_k + 1)
    loads = (np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64))
    return arrays, loads, mirror_start + len(mirrors) * (num_k + 1)
