"""Triton helpers that read and write page entries in the byte layouts of cache/layout.py.

Kernels receive a layout as constexprs (`layout_args`): FMT (FMT_FP32 / FMT_BF16 / FMT_FP8),
D (entry dim), EPP (entries per page), PAGE_BYTES, VALUE_BYTES, SCALE_OFF, SCALE_BYTES and
INDEXER (the d = 128 pool). Slot s lives at page s // EPP, offset s % EPP; its value bytes start at
page * PAGE_BYTES + offset * VALUE_BYTES, its scale bytes at
page * PAGE_BYTES + SCALE_OFF + offset * SCALE_BYTES. Offsets are int64.
"""

import triton
import triton.language as tl

from dsv4ray.cache.layout import HADAMARD_SCALE, PageLayout
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
def entry_offsets(slot, EPP: tl.constexpr, PAGE_BYTES: tl.constexpr, VALUE_BYTES: tl.constexpr,
                  SCALE_OFF: tl.constexpr, SCALE_BYTES: tl.constexpr):
    """slot (int64, scalar or tensor) -> (value byte offset, scale byte offset), int64."""
    page = slot // EPP
    offset = slot % EPP
    start = page * PAGE_BYTES
    return start + offset * VALUE_BYTES, start + SCALE_OFF + offset * SCALE_BYTES


@triton.jit
def _fwht_stage(x, N: tl.constexpr, H: tl.constexpr):
    # [N] viewed as [N / 2H, 2, H]: butterflies (a + b, a - b) across the halves of each 2H block
    a, b = tl.split(tl.permute(tl.reshape(x, (N // (2 * H), 2, H)), (0, 2, 1)))
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (N,))


@triton.jit
def hadamard_rotate(x):
    """x [128] fp32 -> x @ H128 (normalised): the fp32 operations of layout.hadamard_rotate."""
    x = _fwht_stage(x, 128, 1)
    x = _fwht_stage(x, 128, 2)
    x = _fwht_stage(x, 128, 4)
    x = _fwht_stage(x, 128, 8)
    x = _fwht_stage(x, 128, 16)
    x = _fwht_stage(x, 128, 32)
    x = _fwht_stage(x, 128, 64)
    return x * H_SCALE


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
def store_entry(pages_ptr, slot, x, FMT: tl.constexpr, D: tl.constexpr, EPP: tl.constexpr,
                PAGE_BYTES: tl.constexpr, VALUE_BYTES: tl.constexpr, SCALE_OFF: tl.constexpr,
                SCALE_BYTES: tl.constexpr, INDEXER: tl.constexpr):
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
def load_values(pages_ptr, value_off, valid, BF16: tl.constexpr, FMT: tl.constexpr,
                D: tl.constexpr):
    """Raw values of N entries (value_off [N] int64, valid [N]) -> [N, D], 0 where not valid.

    fp8: the unscaled fp8 numbers of all D dims (only the indexer format stores D fp8 values). BF16:
    return bf16 (only for bf16 and fp8 pages, whose values it holds exactly), else fp32.
    """
    cols = tl.arange(0, D)
    mask = valid[:, None]
    if FMT == FMT_FP32:
        ptrs = pages_ptr.to(tl.pointer_type(tl.float32)) + (value_off // 4)[:, None] + cols[None, :]
        out = tl.load(ptrs, mask=mask, other=0.0)
    elif FMT == FMT_BF16:
        ptrs = pages_ptr.to(tl.pointer_type(tl.uint16)) + (value_off // 2)[:, None] + cols[None, :]
        bits = tl.load(ptrs, mask=mask, other=0)
        if BF16:
            out = bits.to(tl.bfloat16, bitcast=True)
        else:
            out = bf16_bits_to_f32(bits)
    else:
        fp8 = tl.load(pages_ptr + value_off[:, None] + cols[None, :], mask=mask, other=0)
        out = fp8.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16 if BF16 else tl.float32)
    return out


@triton.jit
def _load_fp8_kv(pages_ptr, value_off, scale_off, valid, BF16: tl.constexpr, D: tl.constexpr):
    # [N, 8 groups, 64]: groups 0..6 = e4m3 bytes * 2^(scale byte - 127), group 7 = bf16 rope dims
    dtype: tl.constexpr = tl.bfloat16 if BF16 else tl.float32
    cols = tl.arange(0, D)
    nope = valid[:, None] & (cols < NOPE)[None, :]
    fp8 = tl.load(pages_ptr + value_off[:, None] + cols[None, :], mask=nope, other=0)
    fp8 = fp8.to(tl.float8e4nv, bitcast=True).to(dtype)
    g = tl.arange(0, D // GROUP)
    exp_byte = tl.load(pages_ptr + scale_off[:, None] + g[None, :],
                       mask=valid[:, None] & (g < NOPE // GROUP)[None, :], other=0)  # [N, 8]
    rope_ptrs = pages_ptr.to(tl.pointer_type(tl.uint16)) + ((value_off + NOPE) // 2)[:, None]
    rope = tl.load(rope_ptrs + tl.arange(0, GROUP)[None, :], mask=valid[:, None], other=0)
    rope = bf16_bits_to_f32(rope).to(dtype)
    scale = pow2_from_byte(exp_byte).to(dtype)
    grouped = tl.reshape(fp8, (fp8.shape[0], D // GROUP, GROUP)) * scale[:, :, None]
    grouped = tl.where((g == NOPE // GROUP)[None, :, None], rope[:, None, :], grouped)
    return tl.reshape(grouped, (fp8.shape[0], D))


@triton.jit
def load_kv_entries(pages_ptr, slots, BF16: tl.constexpr, FMT: tl.constexpr, D: tl.constexpr,
                    EPP: tl.constexpr, PAGE_BYTES: tl.constexpr, VALUE_BYTES: tl.constexpr,
                    SCALE_OFF: tl.constexpr, SCALE_BYTES: tl.constexpr):
    """Dequantised kv entries (d = 512) at slots [N] int64 -> [N, D]; slots < 0 read as zeros.

    BF16: return bf16 (exact for bf16 and fp8 pages: e4m3 values times powers of two) instead of
    fp32, so tensor-core operands need no fp32 copy of the tile.
    """
    valid = slots >= 0
    value_off, scale_off = entry_offsets(slots, EPP, PAGE_BYTES, VALUE_BYTES, SCALE_OFF,
                                         SCALE_BYTES)
    if FMT == FMT_FP8:
        out = _load_fp8_kv(pages_ptr, value_off, scale_off, valid, BF16, D)
    else:
        out = load_values(pages_ptr, value_off, valid, BF16, FMT, D)
    return out


@triton.jit
def load_indexer_keys(pages_ptr, slots, valid, BF16: tl.constexpr, FMT: tl.constexpr,
                      D: tl.constexpr, EPP: tl.constexpr, PAGE_BYTES: tl.constexpr,
                      VALUE_BYTES: tl.constexpr, SCALE_OFF: tl.constexpr,
                      SCALE_BYTES: tl.constexpr):
    """Indexer keys at slots [N] -> (values [N, D] unscaled, scale [N] fp32): key = values * scale.

    Keeping the scale apart lets the dot run on the fp8 numbers, which bf16 holds exactly (BF16:
    values in bf16, see load_values).
    """
    value_off, scale_off = entry_offsets(slots, EPP, PAGE_BYTES, VALUE_BYTES, SCALE_OFF,
                                         SCALE_BYTES)
    values = load_values(pages_ptr, value_off, valid, BF16, FMT, D)
    if FMT == FMT_FP8:
        scale_ptrs = pages_ptr.to(tl.pointer_type(tl.float32)) + scale_off // 4
        scale = tl.load(scale_ptrs, mask=valid, other=0.0)
    else:
        scale = tl.where(valid, 1.0, 0.0)
    return values, scale
