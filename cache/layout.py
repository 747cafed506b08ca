"""The torch quantise / dequantise that writes and reads the page bytes of cache/page_layout.py
(the layout itself, its constants and ``layout_for`` live there).

Every pool buffer is a uint8 tensor [num_pages, page_bytes], one per layer per pool kind; the
formats, the scales and the rounding are described in cache/page_layout.py. The Triton kernels
write the same bytes.
"""

from functools import lru_cache

import torch

from dsv4ray.cache.page_layout import (
    AMAX_FLOOR,
    FP8_MAX,
    GROUP_DIM,
    HADAMARD_SCALE,
    INDEXER_AMAX_FLOOR,
    INDEXER_DIM,
    NOPE_DIM,
    NUM_GROUPS,
    PageLayout,
)


@lru_cache(maxsize=1)
def _hadamard_128() -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < INDEXER_DIM:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h * HADAMARD_SCALE


def hadamard_128() -> torch.Tensor:
    """The normalised 128x128 Sylvester Hadamard matrix (fp32, symmetric, orthonormal)."""
    return _hadamard_128().clone()


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x @ hadamard_128() for x [..., 128] fp32, as a fast Walsh-Hadamard transform.

    Butterflies (a + b, a - b) with h = 1, 2, ..., 64 then one multiply by 128^-0.5: the Triton
    kernels run the same sequence of fp32 operations, so both produce identical bits.
    """
    shape = x.shape
    y = x.reshape(-1, INDEXER_DIM)
    h = 1
    while h < INDEXER_DIM:
        v = y.view(-1, INDEXER_DIM // (2 * h), 2, h)
        a, b = v[:, :, 0], v[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).reshape(-1, INDEXER_DIM)
        h *= 2
    return (y * HADAMARD_SCALE).reshape(shape)


def ue8m0_exponent_byte(amax: torch.Tensor) -> torch.Tensor:
    """Byte e + 127 with e = ceil(log2(amax / 448)), computed exactly from the bits of amax (fp32,
    >= 1e-10).

    amax = 1.m * 2^E and 448 = 1.75 * 2^8, so e = E - 8 + (1.m > 1.75).
    """
    bits = amax.contiguous().view(torch.int32)
    return ((bits >> 23) & 0xFF) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)


def pow2_from_byte(exp_byte: torch.Tensor) -> torch.Tensor:
    """2^(byte - 127) as fp32 for int32 bytes in [1, 254]."""
    return (exp_byte.to(torch.int32) << 23).view(torch.float32)


def to_e4m3_bits(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> fp8 e4m3fn bytes, round-to-nearest-even, saturating to +-448 (NaN too, by its
    sign bit, as the kernels' ``f32_to_e4m3_bits``: the two write the same bytes)."""
    x = torch.where(x.isnan(), torch.copysign(torch.full_like(x, FP8_MAX), x), x)
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def _quantize_fp8_kv(x: torch.Tensor):
    num = x.shape[0]
    nope = x[:, :NOPE_DIM].reshape(num, NUM_GROUPS, GROUP_DIM)
    amax = nope.abs().amax(-1).clamp_min(AMAX_FLOOR)  # [N, 7]
    exp_byte = ue8m0_exponent_byte(amax)
    inv_scale = pow2_from_byte(254 - exp_byte)  # 2^-e: exact, so x * 2^-e == x / 2^e
    nope_bits = to_e4m3_bits(nope * inv_scale[..., None]).reshape(num, NOPE_DIM)
    rope_bits = x[:, NOPE_DIM:].to(torch.bfloat16).contiguous().view(torch.uint8)
    pad = torch.zeros(num, 1, dtype=torch.uint8, device=x.device)
    return torch.cat((nope_bits, rope_bits), 1), torch.cat((exp_byte.to(torch.uint8), pad), 1)


def _quantize_fp8_indexer(x: torch.Tensor):
    rotated = hadamard_rotate(x)
    amax = rotated.abs().amax(-1).clamp_min(INDEXER_AMAX_FLOOR)  # [N]
    # tensor / tensor: torch on CUDA turns a division by a Python scalar into a multiplication by
    # its reciprocal, which is not correctly rounded; the kernels divide exactly (div_rn).
    scale = amax / torch.full_like(amax, FP8_MAX)
    values = to_e4m3_bits(rotated / scale[:, None])
    return values, scale.contiguous().view(torch.uint8).reshape(-1, 4)


def quantize_entries(x: torch.Tensor, layout: PageLayout):
    """x [N, dim] fp32 -> (values uint8 [N, value_bytes], scales uint8 [N, scale_bytes])."""
    assert x.dtype == torch.float32 and x.dim() == 2, (x.dtype, x.shape)
    assert x.shape[1] == layout.dim, (x.shape, layout)
    x = x.contiguous()
    if layout.dtype == "fp8":
        return _quantize_fp8_kv(x) if layout.is_fp8_kv else _quantize_fp8_indexer(x)
    stored = x if layout.dtype == "fp32" else x.to(torch.bfloat16)
    values = stored.view(torch.uint8).reshape(x.shape[0], layout.value_bytes)
    return values, torch.empty(x.shape[0], 0, dtype=torch.uint8, device=x.device)


def dequantize_entries(
    values: torch.Tensor, scales: torch.Tensor, layout: PageLayout
) -> torch.Tensor:
    """(values [N, value_bytes], scales [N, scale_bytes]) uint8 -> fp32 [N, dim].

    For the fp8 indexer format this is the rotated key times its scale (see the module docstring).
    """
    num = values.shape[0]
    values = values.contiguous()
    if layout.dtype == "fp32":
        return values.view(torch.float32).reshape(num, layout.dim).clone()
    if layout.dtype == "bf16":
        return values.view(torch.bfloat16).reshape(num, layout.dim).float()
    fp8 = values[:, : NOPE_DIM if layout.is_fp8_kv else INDEXER_DIM].contiguous()
    q = fp8.view(torch.float8_e4m3fn).float()
    if not layout.is_fp8_kv:
        return q * scales.contiguous().view(torch.float32).reshape(num, 1)
    scale = pow2_from_byte(scales[:, :NUM_GROUPS].to(torch.int32))  # [N, 7]
    nope = (q.view(num, NUM_GROUPS, GROUP_DIM) * scale[..., None]).reshape(num, NOPE_DIM)
    rope = values[:, NOPE_DIM:].contiguous().view(torch.bfloat16).float()
    return torch.cat((nope, rope), 1)


def entry_byte_offsets(slots: torch.Tensor, layout: PageLayout):
    """Flat byte offsets into pages.view(-1) of each slot's value and scale bytes.

    slots [N] int64 (all >= 0) -> (value offsets [N, value_bytes], scale offsets [N, scale_bytes])
    int64.
    """
    page, offset = slots // layout.entries_per_page, slots % layout.entries_per_page
    start = page * layout.page_bytes
    value_start = start + offset * layout.value_bytes
    scale_start = start + layout.scale_offset + offset * layout.scale_bytes
    value_range = torch.arange(layout.value_bytes, device=slots.device)
    scale_range = torch.arange(layout.scale_bytes, device=slots.device)
    return value_start[:, None] + value_range, scale_start[:, None] + scale_range


def check_pages(pages: torch.Tensor, layout: PageLayout) -> None:
    if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.shape[1] != layout.page_bytes:
        raise ValueError(
            f"{layout.kind}/{layout.dtype} pages must be uint8 [num_pages, {layout.page_bytes}], "
            f"got {pages.dtype} {tuple(pages.shape)}"
        )
    if not pages.is_contiguous():
        raise ValueError("page buffers must be contiguous")


def page_regions(pages: torch.Tensor, layout: PageLayout):
    """Views of the page bytes: (values [P, epp, value_bytes], scales [P, epp, scale_bytes])."""
    num, epp = pages.shape[0], layout.entries_per_page
    values = pages[:, : layout.scale_offset].view(num, epp, layout.value_bytes)
    end = layout.scale_offset + epp * layout.scale_bytes
    scales = pages[:, layout.scale_offset : end].view(num, epp, layout.scale_bytes)
    return values, scales


def write_entries(
    pages: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, layout: PageLayout
) -> None:
    """Quantise x [N, dim] fp32 and store entry i at slots[i] (int64 [N]); slots < 0 are skipped."""
    check_pages(pages, layout)
    keep = slots >= 0
    kept = slots[keep]
    values, scales = quantize_entries(x[keep], layout)
    value_view, scale_view = page_regions(pages, layout)
    page, offset = kept // layout.entries_per_page, kept % layout.entries_per_page
    value_view[page, offset] = values
    if layout.scale_bytes:
        scale_view[page, offset] = scales


def read_entries(pages: torch.Tensor, slots: torch.Tensor, layout: PageLayout) -> torch.Tensor:
    """Dequantised entries at slots (int64, any shape S) -> fp32 [*S, dim]; slots < 0 read as 0."""
    check_pages(pages, layout)
    flat_slots = slots.reshape(-1)
    keep = flat_slots >= 0
    safe = flat_slots.clamp_min(0)
    page, offset = safe // layout.entries_per_page, safe % layout.entries_per_page
    value_view, scale_view = page_regions(pages, layout)
    if layout.dtype == "fp32":
        x = value_view.view(torch.float32)[page, offset]
    elif layout.dtype == "bf16":
        x = value_view.view(torch.bfloat16)[page, offset].float()
    else:
        x = dequantize_entries(value_view[page, offset], scale_view[page, offset], layout)
    if not bool(keep.all()):
        x = x.masked_fill_(~keep[:, None], 0.0)
    return x.reshape(*slots.shape, layout.dim)
