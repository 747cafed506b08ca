"""Linears at a few rows, batch-invariant: y [M, N] = x [M, K] @ W [N, K]^T for M <= 16.

    small_linear(x [M, K], weight [N, K]) -> [M, N] in x's dtype
    small_linear(x [M, G * K], weight [N, K], groups=G) -> [M, N]: block-diagonal over G groups,
        y[m, n] = x[m, g K : (g + 1) K] . W[n] with g = n // (N / G) (the attention's grouped
        output projection)

Decode and verification steps multiply 1-16 rows by every dense linear. cuBLAS picks its
algorithm by M (a gemv at one row; at four, split-K GEMMs of two launches each), so a row's result
depends on how many rows share the call, and a four-row step pays two launches per linear. Here
one launch computes every row: each program owns BLOCK_N output columns, loads each [BLOCK_N,
BLOCK_K] weight tile once and adds every row's products with it to that row's sum (BLOCK_M rows,
masked past M), each row summed over K in BLOCK_K tiles in a fixed order. Row m's result is
therefore a function of row m alone, whatever M is, so a verification step computes each row's
linears bit for bit as a one-row decode step does. Only latency-bound weights (K <=
MAX_K, at most MAX_WEIGHT elements) fit; others stay with torch. bench/mtp.py measures what it
does to decoding with and without drafts.

fp32 and bf16 (bf16 results rounded to nearest even as bits: the interpreter's cast truncates).
The reference is torch's product in fp32 (``small_linear_ref``); sums in another order differ from
it in the last bits only.
"""

import torch
import triton
import triton.language as tl

from dsv4ray.kernels.bits import interpreting, store_rounded

SMALL_M = 16  # the rows one program holds; larger M goes to torch (cuBLAS)
# Latency-bound weights only: each program walks all of K, so a long K (or a weight of many
# megabytes, which cuBLAS reads with split K at full bandwidth) stays with torch.
MAX_K, MAX_WEIGHT = 2048, 1 << 20
BLOCK_N, BLOCK_K, NUM_WARPS = 8, 128, 4  # chosen by timing 1- and 4-row calls on an H100
# the interpreter pays per program and op, not per element: wide tiles (same sums in order)
INTERPRETED_BLOCK_N, INTERPRETED_BLOCK_K = 256, 256
DTYPES = (torch.float32, torch.bfloat16)


@triton.jit(do_not_specialize=["M"])
def _small_linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_om, group_n,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUPED: tl.constexpr, OUT_BF16: tl.constexpr):  # fmt: skip
    # program n tile: out[m, n] for every row m, each weight tile loaded once for all rows;
    # GROUPED: column n reads x's columns [g K, (g + 1) K) of its group g = n // group_n. Row m's
    # sum: per K tile tl.sum(w * x_m) in fp32 (bf16 widens exactly), tiles added in K order,
    # whatever M and BLOCK_M are
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w_rows = w_ptr + n.to(tl.int64)[:, None] * K
    x_cols = (n // group_n)[:, None] * K  # [BLOCK_N, 1]
    rows = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        for m in tl.static_range(BLOCK_M):
            k_ok = (k < K) & (tl.zeros((BLOCK_K,), dtype=tl.int32) + m < M)
            if GROUPED:  # [BLOCK_N, BLOCK_K]: each output column's own group of x
                x = tl.load(
                    x_ptr + m * stride_xm + x_cols + k[None, :],
                    mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0,
                ).to(tl.float32)
            else:  # [1, BLOCK_K]
                x = tl.load(x_ptr + m * stride_xm + k, mask=k_ok, other=0.0).to(tl.float32)
                x = x[None, :]
            acc = tl.where(rows[:, None] == m, acc + tl.sum(w * x, axis=1)[None, :], acc)
    store_rounded(out_ptr, rows[:, None] * stride_om + n[None, :], acc,
                  (rows < M)[:, None] & n_ok[None, :], OUT_BF16)  # fmt: skip


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``small_linear`` takes this product: few rows, one float dtype for both, a
    latency-bound weight."""
    small = weight.shape[1] <= MAX_K and weight.numel() <= MAX_WEIGHT
    return small and x.shape[0] <= SMALL_M and x.dtype == weight.dtype and x.dtype in DTYPES


def small_linear(x: torch.Tensor, weight: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """x [M, groups * K] (M <= SMALL_M) and weight [N, K] -> [M, N] (module docstring)."""
    if not fits(x, weight):
        raise ValueError(f"small_linear takes <= {SMALL_M} rows of fp32 or bf16 in the weight's "
                         f"dtype and weights of K <= {MAX_K}, <= {MAX_WEIGHT} elements; got "
                         f"{tuple(x.shape)} {x.dtype} and {tuple(weight.shape)} "
                         f"{weight.dtype}")  # fmt: skip
    n, k = weight.shape
    if groups < 1 or n % groups:
        raise ValueError(f"groups={groups} does not divide the weight's {n} rows")
    if x.shape[1] != groups * k:
        raise ValueError(f"x {tuple(x.shape)} does not match weight {tuple(weight.shape)} in "
                         f"{groups} group(s)")  # fmt: skip
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    block_n, block_k = (INTERPRETED_BLOCK_N, INTERPRETED_BLOCK_K) if interpreting() else (
        BLOCK_N, BLOCK_K)  # fmt: skip
    rows = x.shape[0]
    block_m = 1 if rows == 1 else 4 if rows <= 4 else SMALL_M  # three compiled variants
    grid = (triton.cdiv(n, block_n),)
    _small_linear_kernel[grid](x, weight.contiguous(), out, rows, n, k, x.stride(0), out.stride(0),
                               n // groups, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                               GROUPED=groups > 1, OUT_BF16=x.dtype == torch.bfloat16,
                               num_warps=NUM_WARPS)  # fmt: skip
    return out


def small_linear_ref(x: torch.Tensor, weight: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """The torch reference: the product in fp32 (group by group), in x's dtype."""
    n, k = weight.shape
    xg = x.float().view(x.shape[0], groups, k).transpose(0, 1)  # [G, M, K]
    wg = weight.float().view(groups, n // groups, k)  # [G, N/G, K]
    return torch.bmm(xg, wg.transpose(1, 2)).transpose(0, 1).reshape(x.shape[0], n).to(x.dtype)
