"""Which layers a pipeline stage owns and where their per-layer cache buffers sit (pure Python).

A stage owns global layers [start, end). Its pools hold one buffer per owned layer and kind:

    window   buffer local_id           for every layer of the stage (local_id = layer_id - start)
    C4 KV    buffer compress_layer_id  for ratio-4 layers: count of earlier C4 layers in the stage
    C128 KV  buffer compress_layer_id  for ratio-128 layers: count of earlier C128 layers in stage
    indexer  buffer indexer_layer_id   for C4 layers that compute their own top-k: count of earlier
                                       such layers in the stage (IndexShare sharing layers own none)

The mapping is a list over ALL model layers (MTP excluded) with None outside the stage, so a global
layer id indexes it directly. Failures this guards against:
counting layers of the whole model, indexing a per-global-layer list with local ids, and iterating
None entries. Convert ids only through ``to_local`` / ``to_global``; iterate with ``stage_layers``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

VALID_RATIOS = (0, 4, 128)


@dataclass(frozen=True)
class LayerInfo:
    """One owned layer. compress_layer_id is None for window-only (ratio 0) layers."""

    layer_id: int
    local_id: int
    compress_ratio: int
    compress_layer_id: int | None
    indexer_layer_id: int | None

    @property
    def computes_topk(self) -> bool:
        """A C4 layer running its own indexer (an IndexShare sharing layer reuses the previous)."""
        return self.indexer_layer_id is not None


class BufferInfo(NamedTuple):
    """One compressed per-layer buffer: kind in {"c4", "indexer", "c128"}, its index, its layer."""

    kind: str
    buffer_idx: int
    layer_id: int


def split_layers(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """Even split of layers over stages; earlier stages take the remainder (43 at pp 2: 22 + 21)."""
    if pp_size < 1:
        raise ValueError(f"pp_size must be >= 1, got {pp_size}")
    if num_layers < pp_size:
        raise ValueError(f"num_layers ({num_layers}) must be >= pp_size ({pp_size})")
    base, extra = divmod(num_layers, pp_size)
    ranges, start = [], 0
    for stage_idx in range(pp_size):
        end = start + base + (1 if stage_idx < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def to_local(layer_id: int, start: int, end: int) -> int:
    """Global layer id -> index among the stage's layers; ValueError outside [start, end)."""
    if not start <= layer_id < end:
        raise ValueError(f"layer {layer_id} is outside this stage's layers [{start}, {end})")
    return layer_id - start


def to_global(local_id: int, start: int, end: int) -> int:
    """Index among the stage's layers -> global layer id; ValueError outside [0, end - start)."""
    if not 0 <= local_id < end - start:
        raise ValueError(
            f"local layer {local_id} is outside this stage's {end - start} layers [{start}, {end})"
        )
    return start + local_id


def _validate(ratios: Sequence[int], skip_topk: Sequence[bool], start: int, end: int) -> None:
    if len(skip_topk) != len(ratios):
        raise ValueError(f"skip_topk has {len(skip_topk)} entries, ratios has {len(ratios)}")
    if not 0 <= start < end <= len(ratios):
        raise ValueError(f"stage layers [{start}, {end}) not inside [0, {len(ratios)})")
    first_c4 = True
    for layer_id, (ratio, skip) in enumerate(zip(ratios, skip_topk, strict=True)):
        if ratio not in VALID_RATIOS:
            raise ValueError(f"compress ratio {ratio} of layer {layer_id} not in {VALID_RATIOS}")
        if skip and ratio != 4:
            raise ValueError(f"skip_topk set on layer {layer_id}, which is not a C4 layer")
        if ratio == 4:
            if skip and first_c4:
                raise ValueError(f"the model's first C4 layer ({layer_id}) cannot share top-k")
            first_c4 = False


def build_layer_mapping(
    ratios: Sequence[int], skip_topk: Sequence[bool], start: int, end: int
) -> list[LayerInfo | None]:
    """Per-global-layer LayerInfo for the stage owning [start, end); None elsewhere.

    ratios and skip_topk cover the model's layers (MTP excluded); skip_topk[i] marks an IndexShare
    sharing C4 layer. Buffer ids count only layers INSIDE the stage (never the whole model).
    """
    _validate(ratios, skip_topk, start, end)
    mapping: list[LayerInfo | None] = [None] * len(ratios)
    counts = {4: 0, 128: 0}
    num_indexers = 0
    for layer_id in range(start, end):
        ratio = ratios[layer_id]
        compress_layer_id = indexer_layer_id = None
        if ratio in counts:
            compress_layer_id = counts[ratio]
            counts[ratio] += 1
        if ratio == 4 and not skip_topk[layer_id]:
            indexer_layer_id = num_indexers
            num_indexers += 1
        mapping[layer_id] = LayerInfo(
            layer_id=layer_id,
            local_id=layer_id - start,
            compress_ratio=ratio,
            compress_layer_id=compress_layer_id,
            indexer_layer_id=indexer_layer_id,
        )
    return mapping


def stage_layers(mapping: Sequence[LayerInfo | None], start: int, end: int) -> Iterator[LayerInfo]:
    """The stage's LayerInfo in layer order; never yields None (RuntimeError if one is met)."""
    for layer_id in range(start, end):
        info = mapping[layer_id]
        if info is None:
            raise RuntimeError(f"layer {layer_id} is in [{start}, {end}) but has no LayerInfo")
        yield info


def buffer_infos(mapping: Sequence[LayerInfo | None]) -> list[BufferInfo]:
    """Compressed buffers in pool order: all C4 KV, then all C4 indexer, then all C128 (SPEC 9)."""
    owned = [info for info in mapping if info is not None]
    c4 = [
        BufferInfo("c4", info.compress_layer_id, info.layer_id)
        for info in owned
        if info.compress_ratio == 4
    ]
    indexer = [
        BufferInfo("indexer", info.indexer_layer_id, info.layer_id)
        for info in owned
        if info.indexer_layer_id is not None
    ]
    c128 = [
        BufferInfo("c128", info.compress_layer_id, info.layer_id)
        for info in owned
        if info.compress_ratio == 128
    ]
    return c4 + indexer + c128


def count_kinds(ratios_slice: Sequence[int], skip_slice: Sequence[bool]) -> dict[str, int]:
    """Layer counts of a stage slice: {"all", "c4", "c128", "indexer"} (indexer = computing C4)."""
    if len(ratios_slice) != len(skip_slice):
        raise ValueError(
            f"skip slice has {len(skip_slice)} entries, ratios slice has {len(ratios_slice)}"
        )
    bad = sorted({r for r in ratios_slice if r not in VALID_RATIOS})
    if bad:
        raise ValueError(f"compress ratios {bad} not in {VALID_RATIOS}")
    return {
        "all": len(ratios_slice),
        "c4": sum(1 for r in ratios_slice if r == 4),
        "c128": sum(1 for r in ratios_slice if r == 128),
        "indexer": sum(
            1 for r, s in zip(ratios_slice, skip_slice, strict=True) if r == 4 and not s
        ),
    }
