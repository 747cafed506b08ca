"""Page byte layouts of the KV pools (pure Python: a driver of stage actors sizes pools from them
without torch; cache/layout.py holds the torch quantise/dequantise that writes these bytes).

Every pool buffer is a uint8 tensor [num_pages, page_bytes], one per layer per pool kind. Inside a
page, all entries' value bytes come first, then all entries' scale bytes, then padding:

    page row:  | value[0] | value[1] | ... | value[E-1] | scale[0] | ... | scale[E-1] | pad |
    slot = page_id * E + offset
    value bytes at offset * value_bytes, scale bytes at scale_offset + offset * scale_bytes

Formats (`kv_cache_dtype`):
- fp8, kv kinds (window, c4, c128; d = 512): value = 448 fp8 e4m3fn bytes (7 groups of 64 "nope"
  dims) then the 64 rope dims as bf16 (128 bytes at byte 448) = 576 bytes; scale = 7 ue8m0 bytes
  (group g's scale is 2^(byte - 127) = 2^ceil(log2(amax_g / 448)), amax floored at AMAX_FLOOR) +
  1 zero pad byte. The page is padded up to a multiple of 576 bytes.
- fp8, indexer kind (d = 128): value = 128 fp8 bytes of the Hadamard-rotated key; scale = one fp32
  max(amax, 1e-4) / 448 (4 bytes). Quantising rotates; dequantising returns the ROTATED key, i.e.
  what is dotted with a rotated query (the normalised rotation leaves q.k unchanged).
- bf16 / fp32: the plain values (no rotation, no scales).
Rounding is round-to-nearest-even; fp8 saturates to +-448. The Triton kernels write the same bytes.
"""

from dataclasses import dataclass
from functools import cache

from dsv4ray.cache.formats import DTYPES, ENTRIES_PER_PAGE, KINDS

KV_DIM, INDEXER_DIM = 512, 128
NOPE_DIM, ROPE_DIM, GROUP_DIM = 448, 64, 64
NUM_GROUPS = NOPE_DIM // GROUP_DIM  # 7 ue8m0 scales per kv entry
FP8_MAX = 448.0
AMAX_FLOOR = 1e-10  # an all-zero group gets scale 2^ceil(log2(1e-10 / 448)) = 2^-42, values stay 0
INDEXER_AMAX_FLOOR = 1e-4
HADAMARD_SCALE = 128**-0.5
LAYOUT_VERSION = 1


@dataclass(frozen=True)
class PageLayout:
    """Byte layout of one pool kind's pages in one kv_cache_dtype."""

    kind: str
    dtype: str

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"PageLayout.kind must be one of {KINDS}, got {self.kind!r}")
        if self.dtype not in DTYPES:
            raise ValueError(
                f"PageLayout.dtype (kv_cache_dtype) must be one of {DTYPES}, got {self.dtype!r}"
            )

    @property
    def entries_per_page(self) -> int:
        return ENTRIES_PER_PAGE[self.kind]

    @property
    def dim(self) -> int:
        return INDEXER_DIM if self.kind == "indexer" else KV_DIM

    @property
    def is_fp8_kv(self) -> bool:
        return self.dtype == "fp8" and self.kind != "indexer"

    @property
    def value_bytes(self) -> int:
        if self.dtype == "fp8":
            return NOPE_DIM + 2 * ROPE_DIM if self.is_fp8_kv else INDEXER_DIM
        return self.dim * (2 if self.dtype == "bf16" else 4)

    @property
    def scale_bytes(self) -> int:
        if self.dtype != "fp8":
            return 0
        return NUM_GROUPS + 1 if self.is_fp8_kv else 4

    @property
    def scale_offset(self) -> int:
        return self.entries_per_page * self.value_bytes

    @property
    def page_bytes(self) -> int:
        used = self.entries_per_page * (self.value_bytes + self.scale_bytes)
        if not self.is_fp8_kv:
            return used
        return -(-used // self.value_bytes) * self.value_bytes

    @property
    def bytes_per_entry(self) -> float:
        return self.page_bytes / self.entries_per_page


@cache
def layout_for(kind: str, dtype: str) -> PageLayout:
    return PageLayout(kind, dtype)


def layout_signature(*layouts: PageLayout) -> str:
    """A short string naming the byte layouts, e.g. 'v1:window/fp8/74880;c4/fp8/37440'.

    Both sides of a page handoff compute it for their pools; a mismatch means the bytes cannot be
    reused.
    """
    parts = [f"{lay.kind}/{lay.dtype}/{lay.page_bytes}" for lay in layouts]
    return f"v{LAYOUT_VERSION}:" + ";".join(parts)
