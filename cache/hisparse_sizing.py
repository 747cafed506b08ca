"""HiSparse terms of pool sizing (pure Python; cache/configurator.py applies them per stage).

With HiSparse a stage's device keeps no C4 entry per token: each running request holds
``hot_rows`` rows per C4 layer of the stage instead (default 2 x index_topk), and the C4 history
moves to host memory. So the per-token C4 term of bytes_per_full_token drops out and a fixed
hot_rows x b(c4) x L_c4 per running request is reserved, like the compressor rings. The host
store holds the history of every full token the pools admit: by default as many tokens as the
device pools hold (HISPARSE_HOST_RATIO), or ``hisparse_host_tokens``, which then caps the
pipeline's capacity.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dsv4ray.cache.formats import ENTRIES_PER_PAGE, PAGE_SIZE
from dsv4ray.cache.layer_mapping import count_kinds

HISPARSE_HOST_RATIO = 1  # default host tokens = device capacity x this
HOT_ROWS_PER_TOPK = 2  # default hot rows = this x index_topk
MAX_HOT_ROWS = 8192  # the swap-in kernel holds a request's rows in one program


def resolve_hot_rows(index_topk: int, requested: int | None) -> int:
    """hisparse_hot_rows, or its default 2 x index_topk; one row is reserved for the newest
    entry, so at least index_topk + 1 (a miss never evicts a row the same top-k hit)."""
    rows = HOT_ROWS_PER_TOPK * index_topk if requested is None else requested
    if not index_topk + 1 <= rows <= MAX_HOT_ROWS:
        raise ValueError(
            f"hisparse_hot_rows must be in [index_topk + 1, {MAX_HOT_ROWS}] = "
            f"[{index_topk + 1}, {MAX_HOT_ROWS}], got {rows}"
        )
    return rows


def hot_bytes_per_request(
    ratios_slice: Sequence[int],
    skip_slice: Sequence[bool],
    entry_bytes: Mapping[str, float],
    hot_rows: int,
) -> float:
    """Device bytes of one running request's hot rows on the stage owning these layers."""
    return hot_rows * entry_bytes["c4"] * count_kinds(ratios_slice, skip_slice)["c4"]


def c4_device_bytes_per_request(
    ratios_slice: Sequence[int],
    skip_slice: Sequence[bool],
    entry_bytes: Mapping[str, float],
    context_tokens: int,
    hot_rows: int = 0,
) -> float:
    """Device C4 bytes a request at context_tokens holds on this stage: its hot rows with
    HiSparse (hot_rows > 0), else the C4 entries of its full pages."""
    if hot_rows:
        return hot_bytes_per_request(ratios_slice, skip_slice, entry_bytes, hot_rows)
    entries = -(-context_tokens // PAGE_SIZE) * ENTRIES_PER_PAGE["c4"]
    return entries * entry_bytes["c4"] * count_kinds(ratios_slice, skip_slice)["c4"]
