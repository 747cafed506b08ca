"""mHC mixing fused: the pre-mix (projection, Sinkhorn, collapse) and the post-mix, three launches.

The torch functions these replace are model/layers/mhc.py's ``hc_pre`` and ``hc_post`` (the
reference; tests compare the two). Shapes, with M = (2 + hc) * hc mix weights per token:

    mhc_pre(x [N, hc, hidden], fn [M, hc * hidden], base [M], scale [3], hc_eps, norm_eps, iters)
        -> post [N, hc] fp32, comb [N, hc, hc] fp32, collapsed [N, hidden] (x's dtype)
    mhc_post(x [N, hc, hidden], out [N, hidden], post [N, hc], comb [N, hc, hc])
        -> [N, hc, hidden] (x's dtype): stream j = post_j * out + sum_i comb[i, j] * x_i
    mhc_head(x [N, hc, hidden], fn [hc, hc * hidden], base [hc], scale [1], hc_eps, norm_eps)
        -> collapsed [N, hidden] (x's dtype): the pre-mix's collapse alone, with hc mix weights
        (the final collapse before the model norm, model/layers/mhc.py's ``hc_head``)

The pre-mix runs as a split-K projection (`_mix_kernel`: partial mixes and partial sums of
squares per K split, so a decode batch still spreads over the SMs) and `_pre_kernel`, which sums
the partials in split order, turns them into pre/post/comb (sigmoids, softmax and the Sinkhorn
rounds on [rows, hc, hc] tiles) and collapses the streams. The split count depends on the
projection width alone, never on N: a token's result does not depend on what shares its batch.
Everything computes in fp32 (on GPUs the projection of wide streams as three tf32 tensor-core
products, "tf32x3", whose error is fp32's; of narrow ones on CUDA cores); bf16 results are
rounded to nearest even as bits (kernels/bits.py).
"""

import torch
import triton
import triton.language as tl

from dsv4ray.kernels.bits import interpreting, store_rounded

SPLIT_K = 512  # projection columns per split
BLOCK_M = 16  # rows per projection program (tl.dot needs >= 16; the interpreter's choice too)
BLOCK_K = 128
# Streams of at most FMA_MAX_WIDTH values (small models): one row a program, fp32 products on
# CUDA cores, where a 16-row tile of a few mixes is mostly empty. Wider ones: 16-row tensor-core
# tiles ("tf32x3", fp32's error) that read each fn tile once for 16 rows. The path depends on
# the width alone, so a row's mix never depends on its batch.
FMA_MAX_WIDTH, MIX_ROWS = 2048, 1
PRE_ROWS = 2  # rows per pre-mix program (the interpreter, paying per op, takes 16)
BLOCK_D = 256  # hidden columns per program of the collapse and the post-mix


@triton.jit(do_not_specialize=["n"])
def _mix_kernel(
    x_ptr,
    fn_ptr,
    part_ptr,
    sq_ptr,
    n,
    width,
    num_mix,
    split_len,
    MIX_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FMA: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # program (row block, split s): part[s, rows, :] = x[rows, K_s] @ fn[:, K_s]^T and
    # sq[s, rows] = sum x[rows, K_s]^2, with K_s = [s * split_len, (s + 1) * split_len); a row's
    # sums are in K order whatever else its block holds. FMA: fp32 products on CUDA cores;
    # else tl.dot at PRECISION
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(1)
    mix = tl.arange(0, MIX_PAD)
    row_ok, mix_ok = rows < n, mix < num_mix
    acc = tl.zeros((BLOCK_M, MIX_PAD), tl.float32)
    sq = tl.zeros((BLOCK_M,), tl.float32)
    k_lo = split * split_len
    for k0 in range(k_lo, tl.minimum(k_lo + split_len, width), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < width
        xk = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * width + k[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        fk = tl.load(
            fn_ptr + mix[:, None] * width + k[None, :],
            mask=mix_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        sq += tl.sum(xk * xk, axis=1)
        if FMA:
            acc += tl.sum(xk[:, None, :] * fk[None, :, :], axis=2)
        else:
            acc += tl.dot(xk, tl.trans(fk), input_precision=PRECISION)
    out_rows = split * n + rows
    tl.store(part_ptr + out_rows[:, None] * MIX_PAD + mix[None, :], acc, mask=row_ok[:, None])
    tl.store(sq_ptr + out_rows, sq, mask=row_ok)


@triton.jit(do_not_specialize=["n"])
def _pre_kernel(
    x_ptr,
    part_ptr,
    sq_ptr,
    base_ptr,
    scale_ptr,
    post_ptr,
    comb_ptr,
    out_ptr,
    n,
    hidden,
    num_splits,
    hc_eps,
    norm_eps,
    ITERS: tl.constexpr,
    HC: tl.constexpr,
    MIX_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    OUT_BF16: tl.constexpr,
    HEAD: tl.constexpr,
):
    # HEAD: the mixes are the hc pre weights alone (base [hc], scale [1]); only the collapse
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n
    i = tl.arange(0, HC)
    ok2 = row_ok[:, None]
    ok3 = row_ok[:, None, None]
    pre_off = rows[:, None] * MIX_PAD + i[None, :]  # [ROWS, HC]
    comb_off = rows[:, None, None] * MIX_PAD + 2 * HC + i[None, :, None] * HC + i[None, None, :]
    pre_w = tl.zeros((ROWS, HC), tl.float32)
    post_w = tl.zeros((ROWS, HC), tl.float32)
    comb_w = tl.zeros((ROWS, HC, HC), tl.float32)
    sq = tl.zeros((ROWS,), tl.float32)
    for s in range(num_splits):  # split order: the same sums for a row whatever its batch
        part = part_ptr + s * n * MIX_PAD
        pre_w += tl.load(part + pre_off, mask=ok2, other=0.0)
        if not HEAD:
            post_w += tl.load(part + pre_off + HC, mask=ok2, other=0.0)
            comb_w += tl.load(part + comb_off, mask=ok3, other=0.0)
        sq += tl.load(sq_ptr + s * n + rows, mask=row_ok, other=0.0)
    r = 1.0 / tl.sqrt(sq / (HC * hidden) + norm_eps)
    s_pre = tl.load(scale_ptr)
    pre = tl.sigmoid(pre_w * r[:, None] * s_pre + tl.load(base_ptr + i)[None, :]) + hc_eps
    if not HEAD:
        s_post, s_comb = tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)
        post = 2 * tl.sigmoid(post_w * r[:, None] * s_post + tl.load(base_ptr + HC + i)[None, :])
        b_comb = tl.load(base_ptr + 2 * HC + i[:, None] * HC + i[None, :])
        logits = comb_w * r[:, None, None] * s_comb + b_comb[None, :, :]
        e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
        comb = e / tl.sum(e, axis=2)[:, :, None] + hc_eps
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
        for _ in range(ITERS - 1):
            comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
            comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
        if tl.program_id(1) == 0:  # every column block derives the weights; one stores them
            tl.store(post_ptr + rows[:, None] * HC + i[None, :], post, mask=ok2)
            tl.store(
                comb_ptr + rows[:, None, None] * HC * HC + i[None, :, None] * HC + i[None, None, :],
                comb,
                mask=ok3,
            )
    x_rows = rows[:, None, None].to(tl.int64) * HC * hidden + i[None, :, None] * hidden
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    xt = tl.load(
        x_ptr + x_rows + d[None, None, :], mask=ok3 & (d < hidden)[None, None, :], other=0.0
    ).to(tl.float32)
    collapsed = tl.sum(pre[:, :, None] * xt, axis=1)  # [ROWS, BLOCK_D]
    store_rounded(
        out_ptr,
        rows[:, None].to(tl.int64) * hidden + d[None, :],
        collapsed,
        ok2 & (d < hidden)[None, :],
        OUT_BF16,
    )


@triton.jit(do_not_specialize=["n"])
def _post_kernel(
    x_ptr,
    out_ptr,
    post_ptr,
    comb_ptr,
    y_ptr,
    n,
    hidden,
    HC: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    # program (rows, column block):
    # y[m, j, d] = post[m, j] out[m, d] + sum_i comb[m, i, j] x[m, i, d]
    m = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    i = tl.arange(0, HC)
    m_ok = m < n
    m64 = m.to(tl.int64)
    post = tl.load(post_ptr + m64[:, None] * HC + i[None, :], mask=m_ok[:, None], other=0.0)
    comb = tl.load(
        comb_ptr + m64[:, None, None] * HC * HC + i[None, :, None] * HC + i[None, None, :],
        mask=m_ok[:, None, None],
        other=0.0,
    )  # [ROWS, i, j]
    ok = m_ok[:, None, None] & (d < hidden)[None, None, :]
    streams = m64[:, None, None] * HC * hidden + i[None, :, None] * hidden + d[None, None, :]
    x = tl.load(x_ptr + streams, mask=ok, other=0.0).to(tl.float32)  # [ROWS, HC (i), BLOCK_D]
    out = tl.load(
        out_ptr + m64[:, None] * hidden + d[None, :],
        mask=m_ok[:, None] & (d < hidden)[None, :],
        other=0.0,
    ).to(tl.float32)
    mixed = tl.sum(comb[:, :, :, None] * x[:, :, None, :], axis=1)  # [ROWS, HC (j), BLOCK_D]
    y = post[:, :, None] * out[:, None, :] + mixed
    store_rounded(y_ptr, streams, y, ok, OUT_BF16)


def _check_x(x: torch.Tensor) -> None:
    assert x.dim() == 3 and x.is_contiguous(), (x.shape, x.stride())
    assert x.dtype in (torch.float32, torch.bfloat16, torch.float16), x.dtype
    hc = x.shape[1]
    assert hc >= 1 and hc & (hc - 1) == 0, f"hc_mult must be a power of two, got {hc}"


def num_splits(width: int) -> int:
    """K splits of the mix projection: a function of its width alone (batch-invariant sums)."""
    return triton.cdiv(width, SPLIT_K)


def mhc_pre(x, fn, base, scale, hc_eps: float, norm_eps: float, iters: int):
    """(post [N, hc] fp32, comb [N, hc, hc] fp32, collapsed [N, hidden] in x's dtype); see the
    module docstring. fn, base and scale may be fp32 or the model dtype (read as fp32)."""
    _check_x(x)
    n, hc, hidden = x.shape
    num_mix = (2 + hc) * hc
    assert base.shape == (num_mix,) and scale.shape == (3,), (base.shape, scale.shape)
    post = torch.empty(n, hc, dtype=torch.float32, device=x.device)
    comb = torch.empty(n, hc, hc, dtype=torch.float32, device=x.device)
    return post, comb, _collapse(x, fn, base, scale, hc_eps, norm_eps, iters, post, comb)


def mhc_head(x, fn, base, scale, hc_eps: float, norm_eps: float) -> torch.Tensor:
    """collapsed [N, hidden] in x's dtype; see the module docstring."""
    _check_x(x)
    hc = x.shape[1]
    assert base.shape == (hc,) and scale.shape == (1,), (base.shape, scale.shape)
    return _collapse(x, fn, base, scale, hc_eps, norm_eps, 1, None, None)


def _collapse(x, fn, base, scale, hc_eps, norm_eps, iters, post, comb) -> torch.Tensor:
    """The mix projection and the pre kernel; post and comb None: the head's collapse alone."""
    n, hc, hidden = x.shape
    width, num_mix = hc * hidden, base.shape[0]
    assert fn.shape == (num_mix, width) and fn.is_contiguous(), fn.shape
    mix_pad = max(16, triton.next_power_of_2(num_mix))
    splits = num_splits(width)
    collapsed = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    if n == 0:
        return collapsed
    part = torch.empty(splits, n, mix_pad, dtype=torch.float32, device=x.device)
    sq = torch.empty(splits, n, dtype=torch.float32, device=x.device)
    fma = width <= FMA_MAX_WIDTH
    block_m = MIX_ROWS if fma and not interpreting() else BLOCK_M
    _mix_kernel[(triton.cdiv(n, block_m), splits)](
        x,
        fn,
        part,
        sq,
        n,
        width,
        num_mix,
        SPLIT_K,
        MIX_PAD=mix_pad,
        BLOCK_M=block_m,
        BLOCK_K=BLOCK_K,
        FMA=fma,
        PRECISION="ieee" if interpreting() else "tf32x3",
    )
    rows = 16 if interpreting() else PRE_ROWS
    block_d = min(BLOCK_D, triton.next_power_of_2(hidden))
    head = post is None  # then the kernel stores no post/comb: the partials stand in as pointers
    _pre_kernel[(triton.cdiv(n, rows), triton.cdiv(hidden, block_d))](
        x,
        part,
        sq,
        base.float().contiguous(),
        scale.float().contiguous(),
        part if head else post,
        part if head else comb,
        collapsed,
        n,
        hidden,
        splits,
        hc_eps,
        norm_eps,
        ITERS=iters,
        HC=hc,
        MIX_PAD=mix_pad,
        ROWS=rows,
        BLOCK_D=block_d,
        OUT_BF16=x.dtype == torch.bfloat16,
        HEAD=head,
    )
    return collapsed


def mhc_post(x, out, post, comb):
    """[N, hc, hidden] in x's dtype: stream j = post_j * out + sum_i comb[i, j] * x_i."""
    _check_x(x)
    n, hc, hidden = x.shape
    assert out.shape == (n, hidden) and out.is_contiguous(), out.shape
    assert post.shape == (n, hc) and comb.shape == (n, hc, hc), (post.shape, comb.shape)
    assert post.dtype == comb.dtype == torch.float32, (post.dtype, comb.dtype)
    y = torch.empty_like(x)
    if n == 0:
        return y
    block_d = min(BLOCK_D, triton.next_power_of_2(hidden))
    rows = 16 if interpreting() else 1
    _post_kernel[(triton.cdiv(n, rows), triton.cdiv(hidden, block_d))](
        x,
        out,
        post.contiguous(),
        comb.contiguous(),
        y,
        n,
        hidden,
        HC=hc,
        ROWS=rows,
        BLOCK_D=block_d,
        OUT_BF16=x.dtype == torch.bfloat16,
    )
    return y
