"""RMS norms and RoPE fused into single passes over the rows they touch.

    rms_norm(x [N, D], weight [D], eps) -> [N, D] in x's dtype
        weight * x * rsqrt(mean(x^2) + eps), computed in fp32 (model/layers/common.py ``rms_norm``)
    norm_rope(x [T, H, D], cos [P, R/2], sin [P, R/2], positions [T], weight=None, eps=None,
              conjugate=False, out_dtype=None) -> [T, H, D]
        optionally the RMS norm of each head vector (weighted or not), then the interleaved RoPE of
        its last R channels at the token's position (pairs (2i, 2i + 1); ``conjugate`` rotates
        back, as the attention output's de-rotation does); the tables are whole, indexed here

They replace chains of small torch ops (upcast, square, mean, rsqrt, scale, split, rotate, stack,
concatenate, downcast) in the paged forward; the torch functions they equal are the references.
bf16 results are rounded to nearest even as bits (kernels/bits.py).
"""

import torch
import triton
import triton.language as tl

from dsv4ray.kernels.bits import interpreting, store_rounded


@triton.jit(do_not_specialize=["n"])
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    n,
    dim,
    eps,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK)
    ok = (rows < n)[:, None] & (d < dim)[None, :]
    offs = rows[:, None].to(tl.int64) * dim + d[None, :]
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / dim + eps)
    w = tl.load(w_ptr + d, mask=d < dim, other=0.0).to(tl.float32)
    store_rounded(y_ptr, offs, w[None, :] * (x * r[:, None]), ok, OUT_BF16)


@triton.jit(do_not_specialize=["num_vectors"])
def _norm_rope_kernel(
    x_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    y_ptr,
    num_vectors,
    num_heads,
    eps,
    D: tl.constexpr,
    R: tl.constexpr,
    ROWS: tl.constexpr,
    NORM: tl.constexpr,
    WEIGHTED: tl.constexpr,
    SIGN: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    # program over ROWS head vectors v = t * num_heads + h of x [T * H, D]: nope channels
    # [0, D - R), then the rope pairs
    v = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    v_ok = v < num_vectors
    row = v.to(tl.int64)[:, None] * D
    d = tl.arange(0, D)
    x = tl.load(x_ptr + row + d[None, :], mask=v_ok[:, None], other=0.0).to(tl.float32)
    if NORM:
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    else:
        r = tl.full((ROWS,), 1.0, tl.float32)
    y = x * r[:, None]
    if WEIGHTED:
        y = y * tl.load(w_ptr + d).to(tl.float32)[None, :]
    store_rounded(y_ptr, row + d[None, :], y, v_ok[:, None] & (d < D - R)[None, :], OUT_BF16)
    half = tl.arange(0, R // 2)
    even = (D - R + 2 * half)[None, :]
    x0 = tl.load(x_ptr + row + even, mask=v_ok[:, None], other=0.0).to(tl.float32) * r[:, None]
    x1 = tl.load(x_ptr + row + even + 1, mask=v_ok[:, None], other=0.0).to(tl.float32)
    x1 = x1 * r[:, None]
    if WEIGHTED:
        x0 = x0 * tl.load(w_ptr + even).to(tl.float32)
        x1 = x1 * tl.load(w_ptr + even + 1).to(tl.float32)
    pos = tl.load(pos_ptr + v // num_heads, mask=v_ok, other=0)[:, None]
    c = tl.load(cos_ptr + pos * (R // 2) + half[None, :])
    s = tl.load(sin_ptr + pos * (R // 2) + half[None, :]) * SIGN
    store_rounded(y_ptr, row + even, x0 * c - x1 * s, v_ok[:, None], OUT_BF16)
    store_rounded(y_ptr, row + even + 1, x1 * c + x0 * s, v_ok[:, None], OUT_BF16)


def _rows() -> int:
    """Vectors per program: a few on GPUs; more under the interpreter, which pays per op."""
    return 16 if interpreting() else 4


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x * rsqrt(mean(x^2) + eps) over the last dim, in fp32, returned in x's dtype."""
    assert x.is_contiguous() and weight.shape == (x.shape[-1],), (x.shape, weight.shape)
    y = torch.empty_like(x)
    dim = x.shape[-1]
    rows = x.numel() // dim if dim else 0
    if rows:
        _rms_norm_kernel[(triton.cdiv(rows, _rows()),)](
            x,
            weight,
            y,
            rows,
            dim,
            eps,
            ROWS=_rows(),
            BLOCK=triton.next_power_of_2(dim),
            OUT_BF16=x.dtype == torch.bfloat16,
        )
    return y


def norm_rope(x, cos, sin, positions, weight=None, eps=None, conjugate=False, out_dtype=None):
    """See the module docstring. eps=None: no norm; weight (fp32 or the model dtype) scales the
    normalised channels. out_dtype defaults to x's dtype."""
    num_tokens, num_heads, dim = x.shape
    rope_dim = 2 * cos.shape[-1]
    assert x.is_contiguous() and dim & (dim - 1) == 0 and rope_dim <= dim, (x.shape, x.stride())
    assert cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
    assert positions.dtype == torch.int64 and positions.shape == (num_tokens,), positions.shape
    assert weight is None or (eps is not None and weight.shape == (dim,)), "weight needs eps"
    out_dtype = out_dtype or x.dtype
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    num_vectors = num_tokens * num_heads
    if num_vectors:
        _norm_rope_kernel[(triton.cdiv(num_vectors, _rows()),)](
            x,
            x if weight is None else weight,
            cos,
            sin,
            positions.contiguous(),
            y,
            num_vectors,
            num_heads,
            0.0 if eps is None else eps,
            D=dim,
            R=rope_dim,
            ROWS=_rows(),
            NORM=eps is not None,
            WEIGHTED=weight is not None,
            SIGN=-1.0 if conjugate else 1.0,
            OUT_BF16=out_dtype == torch.bfloat16,
        )
    return y
