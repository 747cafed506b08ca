"""store_kv: quantise token vectors and store them at paged slots (window KV, or any pool)."""

import torch
import triton
import triton.language as tl

from dsv4ray.cache.layout import check_pages, write_entries
from dsv4ray.cache.page_layout import PageLayout
from dsv4ray.kernels.entries import layout_args, store_entry


@triton.jit
def _store_kv_kernel(
    x_ptr,
    pages_ptr,
    slots_ptr,
    stride_xt,
    FMT: tl.constexpr,
    D: tl.constexpr,
    EPP: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    VALUE_BYTES: tl.constexpr,
    SCALE_OFF: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    INDEXER: tl.constexpr,
):
    # one program per token t: x[t] [D] -> the entry at slots[t]
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        x = tl.load(x_ptr + t * stride_xt + tl.arange(0, D)).to(tl.float32)
        store_entry(
            pages_ptr,
            slot,
            x,
            FMT,
            D,
            EPP,
            PAGE_BYTES,
            VALUE_BYTES,
            SCALE_OFF,
            SCALE_BYTES,
            INDEXER,
        )


def _check(x: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor, layout: PageLayout) -> None:
    check_pages(pages, layout)
    assert x.dtype == torch.float32 and x.dim() == 2, (x.dtype, x.shape)
    assert x.shape[1] == layout.dim, (x.shape, layout)
    assert x.stride(1) == 1, "x rows must be contiguous"
    assert slots.dtype == torch.int64 and slots.shape == (x.shape[0],), (slots.dtype, slots.shape)
    assert slots.is_contiguous(), "slots must be contiguous (the kernel reads slots[t] at t)"


def store_kv(x: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor, layout: PageLayout) -> None:
    """Quantise x and write row t to slot slots[t] of `pages`; slots < 0 are skipped.

    x [T, dim] fp32 (dim = layout.dim: 512, or 128 for the indexer pool); pages uint8 [num_pages,
    layout.page_bytes]; slots int64 [T], slot = page_id * entries_per_page + offset. Bytes as in
    cache/layout.py: fp8 kv = 448 e4m3 + 64 bf16 values with 7 ue8m0 scale bytes + 1 zero pad byte;
    fp8 indexer = 128 e4m3 of the Hadamard-rotated row + an fp32 scale; bf16 / fp32 = plain values.
    """
    _check(x, pages, slots, layout)
    if x.shape[0] == 0:
        return
    _store_kv_kernel[(x.shape[0],)](x, pages, slots, x.stride(0), **layout_args(layout))


def store_kv_ref(
    x: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor, layout: PageLayout
) -> None:
    """Torch reference of store_kv (same bytes)."""
    _check(x, pages, slots, layout)
    write_entries(pages, slots, x, layout)
