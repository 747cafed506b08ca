"""What every stage's KV pools hold, in counts (pure Python: the driver of a pipeline sizes the
pools its stage actors allocate without loading torch)."""

from dataclasses import dataclass

C4_RING, C128_RING = 8, 128  # compressor ring rows per state slot (times ring_scale)


@dataclass(frozen=True)
class PoolSizes:
    num_pages: int
    num_window_pages: int
    num_state_slots: int
    num_cached_state_slots: int
    ring_scale: int = 1  # 2 with speculative decoding (drafts write ahead of the commit point)
    hisparse_hot_rows: int = 0  # per request per C4 layer; 0: HiSparse off
