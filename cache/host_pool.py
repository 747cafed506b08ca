"""Views of a stage's region of host-tier memory, laid out as cache/host_layout.py says: the
same per-kind lists as StagePools, so buffer i of a kind on the host mirrors buffer i on the device.
"""

from __future__ import annotations

import torch

from dsv4ray.cache.host_layout import HostLayout, align_offset, numel


class HostBuffers:
    """Views of a region tensor (uint8 [nbytes]) with the same lists as StagePools."""

    def __init__(self, layout: HostLayout, region: torch.Tensor) -> None:
        if region.numel() < layout.nbytes:
            raise ValueError(
                f"host region has {region.numel()} bytes, layout needs {layout.nbytes}"
            )
        self.layout = layout
        views: dict[str, list[torch.Tensor]] = {}
        offset = 0
        for name, shape, dtype_name in layout.buffers():
            offset = align_offset(offset)
            dtype = getattr(torch, dtype_name)
            size = numel(shape) * dtype.itemsize
            views.setdefault(name, []).append(
                region[offset : offset + size].view(dtype).view(shape)
            )
            offset += size
        self.c4, self.indexer, self.c128 = (views.get(k, []) for k in ("c4", "indexer", "c128"))
        self.window = views.get("window", [])
        self.c4_state = _pairs(views.get("c4_state", []))
        self.indexer_state = _pairs(views.get("indexer_state", []))


def _pairs(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(tensors[i], tensors[i + 1]) for i in range(0, len(tensors), 2)]
