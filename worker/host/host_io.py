"""A stage's copies between its device pools and its host-tier region (cache/host_pool.py).

Per plan, in this order: backups (device -> host, on the compute stream, so nothing of this step
overwrites a page before it is copied), snapshot loads (window page and C4 rings, before the
rings are copied into a request), then page loads. On GPUs page loads run on a side stream one
layer after another with one event per layer, so layer i's attention waits only for layer i's
pages; on CPUs they are plain copies. Whole pages move by page rows (transfer_page_rows).
With HiSparse the C4 pages are the host history, so their copies run on the CPU: they wait for
the kernels in flight, which read and write that history.
"""

from __future__ import annotations

import torch

from dsv4ray.cache.host_layout import HostLayout
from dsv4ray.cache.host_pool import HostBuffers
from dsv4ray.cache.layer_mapping import stage_layers
from dsv4ray.cache.pools import StagePools
from dsv4ray.engine.plan import StepPlan
from dsv4ray.kernels import dispatch


class LayerEvents:
    """What attention of a layer waits for before reading pages loaded this step."""

    def __init__(self, events: dict[int, torch.cuda.Event] | None = None) -> None:
        self.events = events or {}

    def wait(self, layer_id: int) -> None:
        event = self.events.get(layer_id)
        if event is not None:
            torch.cuda.current_stream().wait_event(event)


class HostIO:
    def __init__(self, pools: StagePools, layout: HostLayout, path: str) -> None:
        self.pools, self.device = pools, pools.window[0].device
        region = torch.from_file(path, shared=True, size=layout.nbytes, dtype=torch.uint8)
        if self.device.type == "cuda":
            _pin(region)
        self.region, self.host = region, HostBuffers(layout, region)
        self.side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # per stage layer: (device, host) buffer pairs of its compressed pools
        self.by_layer: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for info in stage_layers(pools.mapping, pools.start, pools.end):
            pairs = []
            if info.compress_ratio == 4:
                pairs.append(
                    (pools.c4[info.compress_layer_id], self.host.c4[info.compress_layer_id])
                )
            if info.indexer_layer_id is not None:
                idx = info.indexer_layer_id
                pairs.append((pools.indexer[idx], self.host.indexer[idx]))
            if info.compress_ratio == 128:
                cid = info.compress_layer_id
                pairs.append((pools.c128[cid], self.host.c128[cid]))
            self.by_layer[info.layer_id] = pairs

    def run(self, plan: StepPlan) -> LayerEvents:
        if self.pools.hisparse is not None and self.side is not None:
            torch.cuda.current_stream(self.device).synchronize()
        ops = plan.host
        if ops is None:
            return LayerEvents()
        if ops.backups:
            dev, host = _ids(ops.backups, self.device)
            for src, dst in self._page_pairs():
                dispatch.transfer_page_rows([src], [dst], dev, host)
        for window, slot, hs in ops.snapshot_backups:
            self._copy_snapshot(window, self.pools.cached_row(slot), hs, to_host=True)
        for hs, window, slot in ops.snapshot_loads:
            self._copy_snapshot(window, self.pools.cached_row(slot), hs, to_host=False)
        if not ops.loads:
            return LayerEvents()
        host, dev = _ids(ops.loads, self.device)
        return self._load_pages(host, dev)

    def _page_pairs(self):
        return [pair for pairs in self.by_layer.values() for pair in pairs]

    def _load_pages(self, host: torch.Tensor, dev: torch.Tensor) -> LayerEvents:
        if self.side is None:
            for dst, src in self._page_pairs():
                dispatch.transfer_page_rows([src], [dst], host, dev)
            return LayerEvents()
        events = {}
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            for layer_id, pairs in self.by_layer.items():
                for dst, src in pairs:
                    dispatch.transfer_page_rows([src], [dst], host, dev)
                events[layer_id] = torch.cuda.Event()
                events[layer_id].record(self.side)
        return LayerEvents(events)

    def _copy_snapshot(self, window: int, row: int, hs: int, to_host: bool) -> None:
        """Window page of every layer + the C4 rings (main and indexer) of one snapshot."""
        pools, host = self.pools, self.host
        pairs = [(dev[window], hst[hs]) for dev, hst in zip(pools.window, host.window, strict=True)]
        for dev_ring, host_ring in zip(
            pools.c4_state + pools.indexer_state, host.c4_state + host.indexer_state, strict=True
        ):
            pairs += [(dev[row], hst[hs]) for dev, hst in zip(dev_ring, host_ring, strict=True)]
        for dev, hst in pairs:
            (hst if to_host else dev).copy_(dev if to_host else hst)


def _ids(pairs, device) -> tuple[torch.Tensor, torch.Tensor]:
    first = torch.tensor([a for a, _ in pairs], dtype=torch.long, device=device)
    second = torch.tensor([b for _, b in pairs], dtype=torch.long, device=device)
    return first, second


def _pin(region: torch.Tensor) -> None:
    """Page-locks a host mapping so copies and kernels reach it at full PCIe speed."""
    err = torch.cuda.cudart().cudaHostRegister(region.data_ptr(), region.numel(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of the host tier region failed ({err})")
