"""The byte layout of a stage's region of host-tier memory (pure Python; cache/host_pool.py maps
its views): page rows and snapshots mirroring its device pools.

One region per (engine, stage), in shared memory the node's host tier actor owns. Host page h
holds, for every compressed buffer of THIS stage's layers, the row of device page p it mirrors;
host snapshot hs holds a window page per layer and the C4 rings (main + indexer) at a boundary:

    pages      c4[i] [H, c4 page bytes]  indexer[j] [H, ...]  c128[k] [H, ...]
    snapshots  window[l] [Hs, window page bytes]  c4_state[i] / indexer_state[j] ([Hs, 8, w] x 2)

The per-kind lists have the same order and length as StagePools' (built from
layer_mapping[start:end] through ``stage_layers``), so buffer i of a kind on the host mirrors
buffer i on the device: a stage never counts or indexes layers of the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4ray.cache.layer_mapping import build_layer_mapping, stage_layers
from dsv4ray.cache.page_layout import layout_for
from dsv4ray.cache.pool_sizes import C4_RING
from dsv4ray.config import ModelConfig

ALIGN = 64  # bytes; the transfer kernels need 16-byte aligned rows
ITEMSIZE = {"uint8": 1, "float32": 4}


@dataclass(frozen=True)
class HostLayout:
    """Byte layout of one stage's host region (computed the same way on every process)."""

    cfg: ModelConfig
    start: int
    end: int
    dtype: str
    num_pages: int
    num_snapshots: int
    ring_scale: int = 1  # the device rings' (2 with drafts): snapshots copy them whole

    def counts(self) -> dict[str, int]:
        """Buffers per kind of this stage's layers only."""
        mapping = build_layer_mapping(
            self.cfg.layer_ratios, [s.skip_topk for s in self.cfg.layers], self.start, self.end
        )
        infos = list(stage_layers(mapping, self.start, self.end))
        return {
            "window": len(infos),
            "c4": sum(1 for i in infos if i.compress_ratio == 4),
            "indexer": sum(1 for i in infos if i.indexer_layer_id is not None),
            "c128": sum(1 for i in infos if i.compress_ratio == 128),
        }

    def buffers(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, shape, dtype name: uint8 or float32) of every buffer, in region order."""
        n = self.counts()
        out = []
        for kind in ("c4", "indexer", "c128"):
            page_bytes = layout_for(kind, self.dtype).page_bytes
            out += [(kind, (self.num_pages, page_bytes), "uint8")] * n[kind]
        window_bytes = layout_for("window", self.dtype).page_bytes
        out += [("window", (self.num_snapshots, window_bytes), "uint8")] * n["window"]
        for kind, width in (
            ("c4_state", 2 * self.cfg.head_dim),
            ("indexer_state", 2 * self.cfg.index_head_dim),
        ):
            count = n["c4" if kind == "c4_state" else "indexer"]
            rows = C4_RING * self.ring_scale
            out += [(kind, (self.num_snapshots, rows, width), "float32")] * (2 * count)
        return out

    @property
    def nbytes(self) -> int:
        total = 0
        for _, shape, dtype in self.buffers():
            total = align_offset(total) + numel(shape) * ITEMSIZE[dtype]
        return align_offset(total)


def align_offset(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def numel(shape: tuple[int, ...]) -> int:
    out = 1
    for dim in shape:
        out *= dim
    return out
