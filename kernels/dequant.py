"""Stored FP8 / FP4 weights decoded into a 16-bit (or fp32) scratch, for calls big enough that
tensor-core GEMMs on the decoded copy beat decoding tiles in registers (prefill chunks).

    dequantize(w [E, rows, cols'], scale, fmt, block, out [n, rows, cols], first=0, counts=None)
    out[e] = decode(w[first + e]) for e < n, skipping experts whose counts[first + e] is 0

Formats as kernels/quant_tiles.py describes them (fp8: e4m3 with block scales; fp4: packed e2m1
with a ue8m0 scale per 32 values). The values are decoded exactly in fp32 and rounded once to
out's dtype as the loader does when it dequantises at load (model/quant.py), so a GEMM on the
decoded copy is the dequantised model's GEMM: FP4 values and FP8 values under power-of-two scales
are exact in bf16 (a plain cast), FP8 under fp32 scales rounds to nearest even as bits (the
interpreter's casts truncate). A 2-D weight [rows, cols'] is one expert.
"""

import torch
import triton
import triton.language as tl

from dsv4ray.kernels.quant_tiles import (
    FORMATS,
    FP4_GROUP,
    fp4_f32,
    kernel_bytes,
    load_scale,
    scale_shape,
    store_rounded,
)

# a few rows of many columns: at V4-Flash's expert shape on an H200 (a development sweep) FP4
# decoding into bf16 writes as fast as a copy of the output with 8 x 1024 tiles, at 0.4 of that
# with 32 x 256
BLOCK_ROWS, BLOCK_COLS = 8, 1024


@triton.jit(do_not_specialize=["first"])
def _dequant_kernel(
    w_ptr,
    s_ptr,
    counts_ptr,
    out_ptr,
    first,
    rows,
    cols,
    stride_we,
    stride_wr,
    stride_se,
    stride_sr,
    stride_sc,
    stride_oe,
    block_n,
    block_k,
    FMT: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    COUNTED: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # program (expert e of the call, row block, column block): out[e, r, c] for BLOCK_C columns
    e = tl.program_id(0).to(tl.int64)
    expert = first + e
    todo = True
    if COUNTED:
        todo = tl.load(counts_ptr + expert) > 0
    if todo:
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = r < rows
        w_row = w_ptr + expert * stride_we + r.to(tl.int64) * stride_wr  # [R]
        s_base = s_ptr + expert * stride_se
        o_row = out_ptr + e * stride_oe + r.to(tl.int64) * cols
        if FMT == 2:
            s_row = s_base + r.to(tl.int64) * stride_sr
            _fp4_tile(w_row, s_row, stride_sc, o_row, r_ok, cols, BLOCK_C)
        else:  # FP8: e4m3 times its block's scale
            c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
            mask = r_ok[:, None] & (c < cols)[None, :]
            byte = tl.load(w_row[:, None] + c[None, :], mask=mask, other=0)
            value = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            s_ptrs = (
                s_base
                + (r // block_n).to(tl.int64)[:, None] * stride_sr
                + (c // block_k)[None, :] * stride_sc
            )
            store_rounded(o_row[:, None], c[None, :], value * load_scale(s_ptrs, mask, SCALE_BYTES),
                          mask, ROUND_BF16)  # fmt: skip


@triton.jit
def _fp4_tile(w_row, s_row, stride_sc, o_row, r_ok, cols, BLOCK_C: tl.constexpr):
    """Columns [BLOCK_C) of program_id(2) of rows w_row -> o_row: byte j holds columns 2j (low
    nibble) and 2j + 1 (high nibble), joined side by side into one contiguous store. Each value
    is a power of two times a code of two significant bits, exact in bf16, so the plain cast
    stores it unrounded (the interpreter's truncating cast included)."""
    j = tl.program_id(2) * (BLOCK_C // 2) + tl.arange(0, BLOCK_C // 2)
    mask = r_ok[:, None] & (2 * j < cols)[None, :]
    byte = tl.load(w_row[:, None] + j[None, :], mask=mask, other=0)
    s_ptrs = s_row[:, None] + (j // 16)[None, :] * stride_sc
    s_byte = tl.load(s_ptrs, mask=mask, other=0).to(tl.int32)
    low, high = fp4_f32(byte, s_byte)
    value = tl.reshape(tl.join(low, high), (w_row.shape[0], BLOCK_C))
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    tl.store(o_row[:, None] + c[None, :], value.to(o_row.dtype.element_ty),
             mask=r_ok[:, None] & (c < cols)[None, :])  # fmt: skip


def dequantize(
    w: torch.Tensor,
    scale: torch.Tensor,
    fmt: str,
    block: tuple[int, int],
    out: torch.Tensor,
    first: int = 0,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """See the module docstring. w and scale may be views with strided experts (rows within an
    expert contiguous; the scales row- or group-major, `quant_tiles.group_major_scales`); out
    [n, rows, cols] (or [rows, cols] for a 2-D w) likewise."""
    assert fmt in ("fp8", "fp4"), fmt
    w3, s3 = (w, scale) if w.dim() == 3 else (w[None], scale[None])
    o3 = out if out.dim() == 3 else out[None]
    n, rows, cols = o3.shape
    assert w3.shape[1] == rows and w3.shape[2] == (cols // 2 if fmt == "fp4" else cols), w.shape
    assert s3.shape[1:] == scale_shape(fmt, rows, cols, block), (scale.shape, w.shape, block)
    assert w3.stride(2) == 1 and w3.stride(1) == w3.shape[2], w.stride()
    assert s3.stride(2) == 1 or s3.stride(1) == 1, scale.stride()  # row- or group-major
    assert o3.stride(2) == 1 and o3.stride(1) == cols, out.stride()
    assert fmt != "fp4" or cols % FP4_GROUP == 0, cols
    if out.numel() == 0:
        return out
    grid = (n, triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(cols, BLOCK_COLS))
    _dequant_kernel[grid](
        kernel_bytes(w3),
        kernel_bytes(s3),
        counts if counts is not None else o3,
        o3,
        first,
        rows,
        cols,
        w3.stride(0),
        w3.stride(1),
        s3.stride(0),
        s3.stride(1),
        s3.stride(2),
        o3.stride(0),
        block[0],
        block[1],
        FMT=FORMATS[fmt],
        SCALE_BYTES=scale.element_size() == 1,
        COUNTED=counts is not None,
        # FP8 times a power-of-two scale is exact in bf16 as well; fp32 scales round
        ROUND_BF16=out.dtype == torch.bfloat16 and fmt == "fp8" and scale.element_size() != 1,
        BLOCK_R=BLOCK_ROWS,
        BLOCK_C=BLOCK_COLS,
    )
    return out
