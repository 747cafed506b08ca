"""Triton helpers that read and write page entries in the byte layouts of cache/layout.py.

Kernels receive a layout as constexprs (`layout_args`): FMT (FMT_FP32 / FMT_BF16 / FMT_FP8),
D (entry dim), EPP (entries per page), PAGE_BYTES, VALUE_BYTES, SCALE_OFF, SCALE_BYTES and
INDEXER (the d = 128 pool). Slot s lives at page s // EPP, offset s % EPP; its value bytes start at
page * PAGE_BYTES + offset * VALUE_BYTES, its scale bytes at
page * PAGE_BYTES + SCALE_OFF + offset * SCALE_BYTES. Offsets are int64.
"""

import triton
import triton.language as tl

from dsv4ray.cache.page_layout import HADAMARD_SCALE, PageLayout
from dsv4ray.kernels.bits import (
    bf16_bits_to_f32,
    f32_to_bf16_bits,
    f32_to_e4m3_bits,
    pow2_from_byte,
    ue8m0_exponent_byte,
)

FMT_FP32 = tl.constexpr(0)
FMT_BF16 = tl.constexpr(1)
FMT_FP8 = tl.constexpr(2)
NOPE = tl.constexpr(448)
GROUP = tl.constexpr(64)
AMAX_FLOOR = tl.constexpr(1e-10)
INDEXER_AMAX_FLOOR = tl.constexpr(1e-4)
FP8_MAX = tl.constexpr(448.0)
H_SCALE = tl.constexpr(HADAMARD_SCALE)

_FMT_CODES = {"fp32": 0, "bf16": 1, "fp8": 2}


def layout_args(layout: PageLayout, prefix: str = "") -> dict:
    """The constexpr keyword arguments that describe `layout` to a kernel (prefixed names)."""
    args = {
        "FMT": _FMT_CODES[layout.dtype],
        "D": layout.dim,
        "EPP": layout.entries_per_page,
        "PAGE_BYTES": layout.page_bytes,
        "VALUE_BYTES": layout.value_bytes,
        "SCALE_OFF": layout.scale_offset,
        "SCALE_BYTES": layout.scale_bytes,
        "INDEXER": layout.kind == "indexer",
    }
    return {prefix + name: value for name, value in args.items()}


@triton.jit
def entry_offsets(
    slot,
    EPP: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    VALUE_BYTES: tl.constexpr,
    SCALE_OFF: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
):
    """slot (int64, scalar or tensor) -> (value byte offset, scale byte offset), int64."""
    page = slot // EPP
    offset = slot % EPP
    start = page * PAGE_BYTES
    return start + offset * VALUE_BYTES, start + SCALE_OFF + offset * SCALE_BYTES


@triton.jit
def _fwht_stage(x, M: tl.constexpr, N: tl.constexpr, H: tl.constexpr):
    # [M, N] viewed as [M, N / 2H, 2, H]: butterflies (a + b, a - b) across the halves of each 2H
    # block of every row
    a, b = tl.split(tl.permute(tl.reshape(x, (M, N // (2 * H), 2, H)), (0, 1, 3, 2)))
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (M, N))


@triton.jit
def hadamard_rotate_rows(x, M: tl.constexpr):
    """x [M, 128] fp32 -> x @ H128 (normalised) per row: the fp32 operations of
    layout.hadamard_rotate."""
    x = _fwht_stage(x, M, 128, 1)
    x = _fwht_stage(x, M, 128, 2)
    x = _fwht_stage(x, M, 128, 4)
    x = _fwht_stage(x, M, 128, 8)
    x = _fwht_stage(x, M, 128, 16)
    x = _fwht_stage(x, M, 128, 32)
    x = _fwht_stage(x, M, 128, 64)
    return x * H_SCALE


@triton.jit
def hadamard_rotate(x):
    """x [128] fp32 -> x @ H128 (normalised): the fp32 operations of layout.hadamard_rotate."""
    return tl.reshape(hadamard_rotate_rows(tl.reshape(x, (1, 128)), 1), (128,))


@triton.jit
def _store_fp8_kv(pages_ptr, value_off, scale_off, x, D: tl.constexpr):
    # x [512]: groups 0..6 -> fp8 with a ue8m0 scale each; group 7 (rope dims) -> bf16 at byte 448
    groups = tl.reshape(x, (D // GROUP, GROUP))
    amax = tl.maximum(tl.max(tl.abs(groups), axis=1), AMAX_FLOOR)  # [8]
    exp_byte = ue8m0_exponent_byte(amax)
    q = tl.reshape(groups * pow2_from_byte(254 - exp_byte)[:, None], (D,))  # x * 2^-e, exact
    cols = tl.arange(0, D)
    tl.store(pages_ptr + value_off + cols, f32_to_e4m3_bits(q), mask=cols < NOPE)
    rope_ptr = (pages_ptr + value_off + NOPE).to(tl.pointer_type(tl.uint16))
    tl.store(rope_ptr + (cols - NOPE), f32_to_bf16_bits(x), mask=cols >= NOPE)
    g = tl.arange(0, D // GROUP)
    tl.store(pages_ptr + scale_off + g, tl.where(g < NOPE // GROUP, exp_byte, 0).to(tl.uint8))


@triton.jit
def _store_fp8_indexer(pages_ptr, value_off, scale_off, x, D: tl.constexpr):
    # x [128], already rotated: one fp32 scale = max(amax, 1e-4) / 448, values x / scale; both
    # divisions correctly rounded, as in torch
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), INDEXER_AMAX_FLOOR), FP8_MAX)
    cols = tl.arange(0, D)
    tl.store(pages_ptr + value_off + cols, f32_to_e4m3_bits(tl.math.div_rn(x, scale)))
    tl.store((pages_ptr + scale_off).to(tl.pointer_type(tl.float32)), scale)


@triton.jit
def store_entry(
    pages_ptr,
    slot,
    x,
    FMT: tl.constexpr,
    D: tl.constexpr,
    EPP: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    VALUE_BYTES: tl.constexpr,
    SCALE_OFF: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    INDEXER: tl.constexpr,
):
    """Quantise x [D] fp32 (fp8 indexer format: rotate first) and store it at slot (int64 >= 0)."""
    value_off, scale_off = entry_offsets(slot, EPP, PAGE_BYTES, VALUE_BYTES, SCALE_OFF, SCALE_BYTES)
    cols = tl.arange(0, D)
    if FMT == FMT_FP32:
        tl.store((pages_ptr + value_off).to(tl.pointer_type(tl.float32)) + cols, x)
    elif FMT == FMT_BF16:
        tl.store((pages_ptr + value_off).to(tl.pointer_type(tl.uint16)) + cols, f32_to_bf16_bits(x))
    elif INDEXER:
        _store_fp8_indexer(pages_ptr, value_off, scale_off, hadamard_rotate(x), D)
    else:
        _store_fp8_kv(pages_ptr, value_off, scale_off, x, D)


@triton.jit
def load_values(pages_ptr, value_off, valid, TC: tl.constexpr, FMT: tl.constexpr, D: tl.constexpr):
    """Raw values of N entries (value_off [N] int64, valid [N]) -> [N, D], 0 where not valid.

    fp8: the unscaled fp8 numbers of all D dims (only the indexer format stores D fp8 values). TC:
    the 16-bit tensor-core type that holds the format exactly (bf16 pages: bf16; fp8: fp16, one
    conversion instruction per two values), else fp32.
    """
    cols = tl.arange(0, D)
    mask = valid[:, None]
    if FMT == FMT_FP32:
        ptrs = pages_ptr.to(tl.pointer_type(tl.float32)) + (value_off // 4)[:, None] + cols[None, :]
        out = tl.load(ptrs, mask=mask, other=0.0)
    elif FMT == FMT_BF16:
        ptrs = pages_ptr.to(tl.pointer_type(tl.uint16)) + (value_off // 2)[:, None] + cols[None, :]
        bits = tl.load(ptrs, mask=mask, other=0)
        if TC:
            out = bits.to(tl.bfloat16, bitcast=True)
        else:
            out = bf16_bits_to_f32(bits)
    else:
        fp8 = tl.load(pages_ptr + value_off[:, None] + cols[None, :], mask=mask, other=0)
        out = fp8.to(tl.float8e4nv, bitcast=True).to(tl.float16 if TC else tl.float32)
    return out


@triton.jit
def kv_scale_words(
    pages_ptr,
    slots,
    FMT: tl.constexpr,
    EPP: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    VALUE_BYTES: tl.constexpr,
    SCALE_OFF: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
):
    """(value byte offsets [N] int64, low and high scale words [N] int32) of kv entries at slots
    [N] (>= 0 valid). fp8: the 8 scale bytes of an entry read as one little-endian int64 (they are
    8-byte aligned), split in two: byte g % 4 of the low / high word is group g's exponent byte."""
    value_off, scale_off = entry_offsets(
        slots, EPP, PAGE_BYTES, VALUE_BYTES, SCALE_OFF, SCALE_BYTES
    )
    if FMT == FMT_FP8:
        word = tl.load(
            pages_ptr.to(tl.pointer_type(tl.int64)) + scale_off // 8, mask=slots >= 0, other=0
        )
        lo, hi = word.to(tl.int32), (word >> 32).to(tl.int32)
    else:
        lo = tl.zeros(slots.shape, tl.int32)
        hi = lo
    return value_off, lo, hi


@triton.jit
def load_kv_group(
    pages_ptr,
    value_off,
    scale_lo,
    scale_hi,
    valid,
    G: tl.constexpr,
    BF16: tl.constexpr,
    FMT: tl.constexpr,
):
    """Dims [64 G, 64 G + 64) of N dequantised kv entries (d = 512) -> [N, 64], 0 where not valid.

    (value_off, scale_lo, scale_hi) come from kv_scale_words. fp8: groups 0..6 are e4m3 dims with
    one scale byte per entry (byte G % 4 of scale_lo for G < 4, else of scale_hi), group 7 is the
    bf16 rope. BF16: return bf16 (exact for bf16 and fp8 pages: e4m3 values times powers of two),
    else fp32.
    """
    dtype: tl.constexpr = tl.bfloat16 if BF16 else tl.float32
    c = G * GROUP + tl.arange(0, GROUP)[None, :]
    mask = valid[:, None]
    if FMT == FMT_FP32:
        ptrs = pages_ptr.to(tl.pointer_type(tl.float32)) + (value_off // 4)[:, None] + c
        out = tl.load(ptrs, mask=mask, other=0.0)
    elif (FMT == FMT_BF16) or (G * GROUP >= NOPE):  # bf16 values (bf16 pages, fp8 rope dims)
        start = value_off // 2 if FMT == FMT_BF16 else (value_off + NOPE) // 2 - NOPE
        bits = tl.load(
            pages_ptr.to(tl.pointer_type(tl.uint16)) + start[:, None] + c, mask=mask, other=0
        )
        out = bits.to(tl.bfloat16, bitcast=True) if BF16 else bf16_bits_to_f32(bits)
    else:
        fp8 = tl.load(pages_ptr + value_off[:, None] + c, mask=mask, other=0)
        words = scale_lo if G < 4 else scale_hi
        scale = pow2_from_byte((words >> ((G % 4) * 8)) & 0xFF).to(dtype)  # [N]
        out = fp8.to(tl.float8e4nv, bitcast=True).to(dtype) * scale[:, None]
    return out


@triton.jit
def load_indexer_keys(
    pages_ptr,
    slots,
    valid,
    TC: tl.constexpr,
    FMT: tl.constexpr,
    D: tl.constexpr,
    EPP: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    VALUE_BYTES: tl.constexpr,
    SCALE_OFF: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
):
    """Indexer keys at slots [N] -> (values [N, D] unscaled, scale [N] fp32): key = values * scale.

    Keeping the scale apart lets the dot run on the fp8 numbers, which fp16 holds exactly (TC: see
    load_values).
    """
    value_off, scale_off = entry_offsets(
        slots, EPP, PAGE_BYTES, VALUE_BYTES, SCALE_OFF, SCALE_BYTES
    )
    values = load_values(pages_ptr, value_off, valid, TC, FMT, D)
    if FMT == FMT_FP8:
        scale_ptrs = pages_ptr.to(tl.pointer_type(tl.float32)) + scale_off // 4
        scale = tl.load(scale_ptrs, mask=valid, other=0.0)
    else:
        scale = tl.where(valid, 1.0, 0.0)
    return values, scale
