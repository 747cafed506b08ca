"""FP8 linear: the weight stays in e4m3 with block scales, the activations in bf16 (prefill chunks
may quantise theirs to FP8: kernels/fp8_act.py).

    fp8_linear(x [M, G * K], weight [G * N, K], scale, block=(bn, bk), groups=G) -> [M, G * N]
    group g: y[:, g N:(g + 1) N] = x[:, g K:(g + 1) K] @ dequant(W[g N:(g + 1) N])^T

x: bf16, fp16 or fp32, unit column stride; the result has x's dtype. weight: float8_e4m3fn (or its
uint8 bytes), row-major, one byte per value. scale [ceil(G N / bn), ceil(K / bk)]: one multiplier
per bn x bk block of the whole [G N, K] weight, fp32 or ue8m0 (float8_e8m0fnu or uint8 exponent
bytes). G = 1 is a plain linear; the attention's grouped output projection (wo_a) uses
G = o_groups, its G diagonal blocks in one launch.

Each program multiplies a BLOCK_M x BLOCK_N output tile over a range of K: e4m3 tiles are widened
in registers (exactly) and multiplied with the activations on tensor cores, fp32 accumulation, the
block scale applied to each K step's product (see kernels/quant_tiles.py). Tiles by M (a function
of M's bucket only, so a bucket compiles once):
  - M <= 16: 16 x 64 output tiles, K steps of 128 on 4 warps (at V4-Flash's linears on an H200
    4-25% faster than K steps of 64 on 8 warps, whose loop divides by the scale block every
    step); 16 < M <= 64: 64 x 128 tiles, K steps of 128 on 4 warps (in three sweeps on that
    H200 the best single shape for those six linears: 12-14% less time summed than 64 x 64 tiles
    with K steps of 64 on 8 warps, 0.6x to 1.2x per linear; fp32 x keeps those). Decode batches
    are memory-bound: every weight tile is read by one program (per tile of M rows); when the
    output tiles are too few to fill the GPU twice over, K is split across programs, each
    writing an fp32 partial [splits, M, G N] that `quant_tiles.sum_splits` adds in split order
    and stores in x's dtype (deterministic, no atomics, one launch);
  - M > 64: 128 x 128 tiles, K steps of 64, split only while the tiles are too few; from
    DEQUANT_ROWS rows of bf16 / fp16 x (prefill chunks) W is decoded into a scratch in x's dtype
    first (kernels/dequant.py) and multiplied there (cuBLAS on GPUs: the dequantised model's
    GEMM, bit for bit), since widening every tile in registers costs more than the products;
    or, asked for (act_fp8, EngineConfig.fp8_prefill) on GPUs with FP8 tensor cores, x is
    quantised per 1 x 128 block and multiplied in FP8 (kernels/fp8_act.py).
With one split the kernel writes the result directly (bf16 rounded to nearest even as bits). M and
the split are runtime values (not specialised): `compile_variants` compiles all of a layer's
variants up front.
"""

import torch
import triton
import triton.language as tl

from dsv4ray.kernels import fp8_act
from dsv4ray.kernels.bits import interpreting, store_rounded
from dsv4ray.kernels.dequant import dequantize
from dsv4ray.kernels.quant_tiles import (
    FMT_FP8,
    dequantize_ref,
    k_tile,
    kernel_bytes,
    load_x,
    scale_shape,
    split_k,
    sum_splits,
    weight_dot,
)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BUCKET_M = (16, 64)  # the largest M of each decode bucket; larger M takes the prefill tiles
DEQUANT_ROWS = 512  # 16-bit calls of at least this many rows multiply a decoded copy of W


@triton.jit(do_not_specialize=["M", "k_per_split", "num_splits"])
def _fp8_linear_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    part_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_sn,
    block_n,
    block_k,
    k_per_split,
    num_splits,
    SCALE_BYTES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    # program (m tile, n tile * num_splits + split, group g): out[m, g N + n] over one K range
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = (tl.program_id(1) // num_splits) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1) % num_splits
    g = tl.program_id(2).to(tl.int64)
    m_ok, n_ok = m < M, n < N
    w_rows = g * N + n  # rows of the whole [G N, K] weight
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm + g * K
    k_start = tl.multiple_of(split * k_per_split, BLOCK_K)  # k_per_split: whole K steps
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        xa, xb = load_x(x_rows, m_ok[:, None], k0, K, FMT_FP8, BLOCK_K)
        acc += weight_dot(
            xa,
            xb,
            k0,
            K,
            w_ptr,
            w_rows,
            n_ok,
            K,
            s_ptr,
            w_rows // block_n,
            stride_sn,
            block_k,
            FMT_FP8,
            SCALE_BYTES,
            BLOCK_K,
            IEEE,
        )
    width = tl.num_programs(2) * N  # G N: the output's row length
    offs = m.to(tl.int64)[:, None] * width + w_rows[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if num_splits == 1:
        store_rounded(out_ptr, offs, acc, mask, OUT_BF16)
    else:
        tl.store(part_ptr + split.to(tl.int64) * M * width + offs, acc, mask=mask)


def tiles(num_rows: int, fp32: bool = False) -> dict:
    """Tile shapes for M = num_rows (see the module docstring); fp32 x (exact products, a test
    configuration) keeps 64 x 64 tiles with K steps of 64 at 17-64 rows, where the wider 16-bit
    tiles would hold four times the operand bytes."""
    if num_rows <= BUCKET_M[0]:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    if num_rows <= BUCKET_M[1] and fp32:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3)
    if num_rows <= BUCKET_M[1]:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


def _check(x, weight, scale, block, groups) -> tuple[int, int]:
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    assert x.dtype in DTYPES, x.dtype
    assert weight.dim() == 2 and weight.is_contiguous() and weight.element_size() == 1
    assert weight.dtype in (torch.float8_e4m3fn, torch.uint8), weight.dtype
    assert scale.is_contiguous() and scale.dtype in (
        torch.float32,
        torch.float8_e8m0fnu,
        torch.uint8,
    ), scale.dtype
    rows, k = weight.shape
    assert rows % groups == 0 and x.shape[1] == groups * k, (x.shape, weight.shape, groups)
    assert tuple(scale.shape) == scale_shape("fp8", rows, k, block), (scale.shape, weight.shape)
    return rows // groups, k


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    groups: int = 1,
    act_fp8: bool | None = False,
) -> torch.Tensor:
    """See the module docstring. act_fp8: quantise x to FP8 and multiply on FP8 tensor cores
    (kernels/fp8_act.py); None: for calls of more than BUCKET_M[-1] rows (prefill chunks) where
    the GPU and the shapes allow it (EngineConfig.fp8_prefill)."""
    n, k = _check(x, weight, scale, block, groups)
    num_rows = x.shape[0]
    if act_fp8 is None:
        act_fp8 = num_rows > BUCKET_M[-1] and uses_fp8_act(x, k, block, groups)
    if act_fp8:
        return fp8_act.fp8_act_linear(x, weight, scale, block, groups)
    if num_rows >= DEQUANT_ROWS and x.dtype != torch.float32:
        return _dequantized_linear(x, weight, scale, block, groups)
    out = torch.empty(num_rows, groups * n, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    t = tiles(num_rows, x.dtype == torch.float32)
    t["BLOCK_K"] = k_tile(t["BLOCK_K"], block[1])
    grid_mn = triton.cdiv(num_rows, t["BLOCK_M"]) * triton.cdiv(n, t["BLOCK_N"])
    k_per_split, splits = split_k(grid_mn * groups, k, t["BLOCK_K"], x.device)
    part = torch.empty(
        (splits if splits > 1 else 1, num_rows if splits > 1 else 1, groups * n),
        dtype=torch.float32,
        device=x.device,
    )
    grid = (triton.cdiv(num_rows, t["BLOCK_M"]), triton.cdiv(n, t["BLOCK_N"]) * splits, groups)
    _fp8_linear_kernel[grid](
        x,
        kernel_bytes(weight),
        kernel_bytes(scale),
        out,
        part,
        num_rows,
        n,
        k,
        x.stride(0),
        scale.shape[1],
        block[0],
        block[1],
        k_per_split,
        splits,
        SCALE_BYTES=scale.element_size() == 1,
        IEEE=x.dtype == torch.float32 or interpreting(),
        OUT_BF16=x.dtype == torch.bfloat16,
        **t,
    )
    if splits > 1:
        sum_splits(part, out)
    return out


def _dequantized_linear(x, weight, scale, block, groups: int) -> torch.Tensor:
    """x @ W^T with W decoded into a scratch in x's dtype first (kernels/dequant.py): the
    dequantised model's own GEMM (cuBLAS on GPUs), groups as one batched GEMM."""
    w = dequantize(weight, scale, "fp8", block, torch.empty(weight.shape, dtype=x.dtype,
                                                            device=x.device))  # fmt: skip
    if groups == 1:
        return torch.nn.functional.linear(x, w)
    k = weight.shape[1]
    y = torch.bmm(x.reshape(-1, groups, k).transpose(0, 1), w.view(groups, -1, k).transpose(1, 2))
    return y.transpose(0, 1).reshape(x.shape[0], -1)


def uses_fp8_act(x: torch.Tensor, k: int, block: tuple[int, int], groups: int) -> bool:
    """Whether a prefill-sized call with x [M, G K] runs on FP8 activations (fp8_act.fits on a
    GPU with FP8 tensor cores)."""
    return fp8_act.supported(x.device) and fp8_act.fits(x, k, block, groups)


def fp8_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    groups: int = 1,
) -> torch.Tensor:
    """The torch reference: dequantise to fp32, multiply each group in fp32, cast to x's dtype."""
    n, k = _check(x, weight, scale, block, groups)
    w = dequantize_ref(weight, scale, "fp8", block).view(groups, n, k)
    xg = x.float().view(-1, groups, k).transpose(0, 1)  # [G, M, K]
    y = torch.bmm(xg, w.transpose(1, 2))  # [G, M, N]
    return y.transpose(0, 1).reshape(x.shape[0], groups * n).to(x.dtype)


def compile_variants(
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    groups: int,
    dtype: torch.dtype,
    fp8_prefill: bool = False,
) -> None:
    """Runs the kernels once per M bucket (and once split, once not; with fp8_prefill both
    FP8-activation tiles) so that serving compiles nothing (M and the split count are not
    specialised, so one call per tile shape suffices)."""
    k = weight.shape[1]
    act = [(BUCKET_M[1] + 1, None), (fp8_act.SMALL_M + 1, None)] if fp8_prefill else []
    plain = [(rows, False) for rows in (1, BUCKET_M[0] + 1, BUCKET_M[1] + 1, DEQUANT_ROWS)]
    for num_rows, act_fp8 in [*plain, *act]:
        x = torch.zeros(num_rows, groups * k, dtype=dtype, device=weight.device)
        fp8_linear(x, weight, scale, block, groups, act_fp8)
