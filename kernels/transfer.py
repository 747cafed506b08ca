"""Page transfers for all layers in one launch: token-granular entries and whole page rows.

`transfer_cache_dsv4_mla` copies N entries (value bytes AND scale bytes: they live in two ranges of
the page) from src_layers[l] at src_indices[i] to dst_layers[l] at dst_indices[i], for every
layer l. `transfer_page_rows` copies whole page rows. Each side may be device memory or pinned
host memory (the kernel reads and writes host memory through unified addresses);
the wrapper passes the layers as an int64 tensor of data pointers, so one launch covers all layers.
Pairs with a negative index on either side are skipped; indices must be inside the buffers (not
checked: that would need a device sync).
"""

from functools import lru_cache

import torch
import triton
import triton.language as tl

from dsv4ray.cache.layout import check_pages, entry_byte_offsets
from dsv4ray.cache.page_layout import PageLayout
from dsv4ray.kernels.bits import interpreting

# ALIGNMENT: addresses loaded from a pointer table carry no alignment facts, so the kernels declare
# int64-word pairs 16-byte aligned (16-byte accesses): buffers are 16-byte aligned (the wrapper
# checks) and every page row and value range starts at a multiple of 16 bytes (tests check the
# layouts). The hints must sit in the kernel body: Triton drops them across a helper call.


@triton.jit(do_not_specialize=["num_entries"])
def _transfer_entries_kernel(
    src_ptrs,
    dst_ptrs,
    src_idx_ptr,
    dst_idx_ptr,
    num_entries,
    EPP: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    VALUE_BYTES: tl.constexpr,
    SCALE_OFF: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # program (entry block, layer): values as int64 words, scales as int32 words
    layer = tl.program_id(1)
    src = tl.load(src_ptrs + layer).to(tl.pointer_type(tl.uint8))
    dst = tl.load(dst_ptrs + layer).to(tl.pointer_type(tl.uint8))
    i = tl.program_id(0).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
    in_range = i < num_entries
    s = tl.load(src_idx_ptr + i, mask=in_range, other=-1)
    d = tl.load(dst_idx_ptr + i, mask=in_range, other=-1)
    ok = ((s >= 0) & (d >= 0))[:, None]
    s_page, s_off = s // EPP, s % EPP
    d_page, d_off = d // EPP, d % EPP
    words = tl.arange(0, BLOCK_V)[None, :]
    v_mask = ok & (words < VALUE_BYTES // 8)
    src_word = (s_page * PAGE_BYTES + s_off * VALUE_BYTES) // 8
    dst_word = (d_page * PAGE_BYTES + d_off * VALUE_BYTES) // 8
    src_v = src.to(tl.pointer_type(tl.int64)) + src_word[:, None]
    dst_v = dst.to(tl.pointer_type(tl.int64)) + dst_word[:, None]
    src_v = tl.max_contiguous(tl.multiple_of(src_v + words, [1, 16]), [1, 2])  # see ALIGNMENT
    dst_v = tl.max_contiguous(tl.multiple_of(dst_v + words, [1, 16]), [1, 2])
    tl.store(dst_v, tl.load(src_v, mask=v_mask), mask=v_mask)
    if SCALE_BYTES > 0:
        s_words = tl.arange(0, BLOCK_S)[None, :]
        s_mask = ok & (s_words < SCALE_BYTES // 4)
        src_s = (s_page * PAGE_BYTES + SCALE_OFF + s_off * SCALE_BYTES) // 4
        dst_s = (d_page * PAGE_BYTES + SCALE_OFF + d_off * SCALE_BYTES) // 4
        src_s_ptrs = src.to(tl.pointer_type(tl.int32)) + src_s[:, None] + s_words
        dst_s_ptrs = dst.to(tl.pointer_type(tl.int32)) + dst_s[:, None] + s_words
        tl.store(dst_s_ptrs, tl.load(src_s_ptrs, mask=s_mask), mask=s_mask)


@triton.jit
def _transfer_rows_kernel(
    src_ptrs, dst_ptrs, src_page_ptr, dst_page_ptr, ROW_WORDS: tl.constexpr, BLOCK: tl.constexpr
):
    # program (page, layer, chunk of the row): BLOCK int64 words
    page_i = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1)
    s = tl.load(src_page_ptr + page_i)
    d = tl.load(dst_page_ptr + page_i)
    if (s >= 0) & (d >= 0):
        words = tl.program_id(2).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = words < ROW_WORDS
        src = tl.load(src_ptrs + layer).to(tl.pointer_type(tl.int64)) + s * ROW_WORDS
        dst = tl.load(dst_ptrs + layer).to(tl.pointer_type(tl.int64)) + d * ROW_WORDS
        src = tl.max_contiguous(tl.multiple_of(src + words, [16]), [2])  # see ALIGNMENT
        dst = tl.max_contiguous(tl.multiple_of(dst + words, [16]), [2])
        tl.store(dst, tl.load(src, mask=mask), mask=mask)


def _check_lists(src_layers, dst_layers, src_idx, dst_idx, what: str) -> None:
    if len(src_layers) != len(dst_layers):
        raise ValueError(
            f"{len(src_layers)} source layers but {len(dst_layers)} destination layers"
        )
    if src_idx.numel() != dst_idx.numel():
        raise ValueError(
            f"src {what} has {src_idx.numel()} entries but dst {what} has {dst_idx.numel()}"
        )
    if src_idx.dtype != torch.int64 or dst_idx.dtype != torch.int64:
        raise ValueError(f"{what} must be int64, got {src_idx.dtype} and {dst_idx.dtype}")
    rows = {t.shape[1:] for t in (*src_layers, *dst_layers)}
    if len(rows) > 1:
        sizes = sorted(r[0] for r in rows)
        raise ValueError(f"all layers must share one page row size, got {sizes}")


def _kernel_device(layers) -> torch.device:
    """The CUDA device among the buffers (host ones must then be pinned), else the CPU."""
    devices = {t.device for t in layers if t.device.type != "cpu"}
    if len(devices) > 1:
        raise ValueError(f"buffers on several devices: {sorted(map(str, devices))}")
    if not devices:
        return torch.device("cpu")
    unpinned = [i for i, t in enumerate(layers) if t.device.type == "cpu" and not t.is_pinned()]
    if unpinned:
        raise ValueError(
            f"host buffers must be pinned for a device transfer (unpinned: {unpinned})"
        )
    return devices.pop()


@lru_cache(maxsize=64)
def _pointer_table(ptrs: tuple, device: torch.device) -> torch.Tensor:
    # keyed by the pointer values themselves, so a cached table can never be stale
    return torch.tensor(ptrs, dtype=torch.int64, device=device)


def _pointers(layers, device) -> torch.Tensor:
    assert all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in layers), "need aligned buffers"
    return _pointer_table(tuple(t.data_ptr() for t in layers), device)


def transfer_cache_dsv4_mla(
    src_layers: list,
    dst_layers: list,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layout: PageLayout,
) -> None:
    """Copy entries src_indices[i] -> dst_indices[i] (each side's own slot space) in every layer.

    src_layers, dst_layers: lists (same length) of uint8 [num_pages, layout.page_bytes] buffers,
    device or pinned host. src_indices, dst_indices: int64 [N]; slot = page * entries_per_page +
    offset; the value_bytes at page * page_bytes + offset * value_bytes and the scale_bytes at page
    * page_bytes + scale_offset + offset * scale_bytes move together. Different lengths raise
    ValueError; N = 0 is a no-op.
    """
    _check_lists(src_layers, dst_layers, src_indices, dst_indices, "indices")
    for t in (*src_layers, *dst_layers):
        check_pages(t, layout)
    if src_indices.numel() == 0 or not src_layers:
        return
    device = _kernel_device([*src_layers, *dst_layers])
    if device.type == "cpu" and not interpreting():  # host <-> host: no kernel to launch
        transfer_cache_dsv4_mla_ref(src_layers, dst_layers, src_indices, dst_indices, layout)
        return
    src_idx, dst_idx = src_indices.reshape(-1).to(device), dst_indices.reshape(-1).to(device)
    block_v = triton.next_power_of_2(layout.value_bytes // 8)
    num, block_e = src_idx.numel(), max(4, 256 // block_v)  # >= 2 words per thread (16 B)
    grid = (triton.cdiv(num, block_e), len(src_layers))
    _transfer_entries_kernel[grid](
        _pointers(src_layers, device),
        _pointers(dst_layers, device),
        src_idx,
        dst_idx,
        num,
        EPP=layout.entries_per_page,
        PAGE_BYTES=layout.page_bytes,
        VALUE_BYTES=layout.value_bytes,
        SCALE_OFF=layout.scale_offset,
        SCALE_BYTES=layout.scale_bytes,
        BLOCK_E=block_e,
        BLOCK_V=block_v,
        BLOCK_S=2,
        num_warps=4,
    )


def transfer_page_rows(
    src_layers: list, dst_layers: list, src_pages: torch.Tensor, dst_pages: torch.Tensor
) -> None:
    """Copy whole page rows src_pages[i] -> dst_pages[i] in every layer.

    src_layers, dst_layers: lists (same length) of uint8 [num_pages, page_bytes] buffers with one
    row size, device or pinned host; src_pages, dst_pages int64 [N]. Different lengths raise
    ValueError; N = 0 is a no-op.
    """
    _check_lists(src_layers, dst_layers, src_pages, dst_pages, "pages")
    if src_pages.numel() == 0 or not src_layers:
        return
    device = _kernel_device([*src_layers, *dst_layers])
    if device.type == "cpu" and not interpreting():  # host <-> host: no kernel to launch
        transfer_page_rows_ref(src_layers, dst_layers, src_pages, dst_pages)
        return
    row_bytes = src_layers[0].shape[1]
    assert row_bytes % 8 == 0 and all(t.dtype == torch.uint8 for t in (*src_layers, *dst_layers))
    block = min(1024, triton.next_power_of_2(row_bytes // 8))
    grid = (src_pages.numel(), len(src_layers), triton.cdiv(row_bytes // 8, block))
    _transfer_rows_kernel[grid](
        _pointers(src_layers, device),
        _pointers(dst_layers, device),
        src_pages.reshape(-1).to(device),
        dst_pages.reshape(-1).to(device),
        ROW_WORDS=row_bytes // 8,
        BLOCK=block,
        num_warps=4,
    )


def transfer_cache_dsv4_mla_ref(
    src_layers: list,
    dst_layers: list,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layout: PageLayout,
) -> None:
    """Torch reference of transfer_cache_dsv4_mla: gather and scatter the value and scale bytes."""
    _check_lists(src_layers, dst_layers, src_indices, dst_indices, "indices")
    keep = (src_indices >= 0) & (dst_indices >= 0)
    src_idx, dst_idx = src_indices[keep], dst_indices[keep]
    if src_idx.numel() == 0:
        return
    src_value, src_scale = entry_byte_offsets(src_idx, layout)
    dst_value, dst_scale = entry_byte_offsets(dst_idx, layout)
    src_bytes = torch.cat((src_value, src_scale), 1).reshape(-1)
    dst_bytes = torch.cat((dst_value, dst_scale), 1).reshape(-1)
    for src, dst in zip(src_layers, dst_layers, strict=True):
        check_pages(src, layout)
        check_pages(dst, layout)
        moved = src.view(-1)[src_bytes.to(src.device)]
        dst.view(-1)[dst_bytes.to(dst.device)] = moved.to(dst.device)


def transfer_page_rows_ref(
    src_layers: list, dst_layers: list, src_pages: torch.Tensor, dst_pages: torch.Tensor
) -> None:
    """Torch reference of transfer_page_rows."""
    _check_lists(src_layers, dst_layers, src_pages, dst_pages, "pages")
    keep = (src_pages >= 0) & (dst_pages >= 0)
    for src, dst in zip(src_layers, dst_layers, strict=True):
        rows = src[src_pages[keep].to(src.device)]
        dst[dst_pages[keep].to(dst.device)] = rows.to(dst.device)
