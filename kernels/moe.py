"""Routed experts as two grouped GEMMs over the (token, slot) pairs sorted by expert, sync-free.

    fused_moe(x [N, hidden], ids [N, S] int64, weights [N, S] fp32, w13 [E, 2 * inter, hidden],
              w2 [E, hidden, inter], limit) -> [N, hidden] in x's dtype
    out[t] = sum_s weights[t, s] * expert_{ids[t, s]}(x[t]),
    expert_e(v) = w2[e] (silu(min(g, limit)) * clamp(u, -limit, limit)), g | u = w13[e] v

w13 holds each expert's gate rows (w1) then its up rows (w3). A slot may name any expert, the
shared expert included when the caller stacks it as one more expert with weight 1.

Plan (no host synchronisation, so a CUDA graph can capture it): `_align` sorts the N * S pairs by
expert and cuts each expert's run into blocks of BLOCK_M pairs; the number of blocks is bounded
by cdiv(N * S, BLOCK_M) + E, so the grid is fixed by the shapes and surplus programs exit. Then
`_gate_up_kernel` computes h = silu(min(x w1^T, limit)) * clamp(x w3^T) for a block of pairs and a
block of intermediate columns (one expert's weight tile read once per block of pairs), and
`_down_kernel` writes weights * (h w2^T) at each pair's own row; the S rows of a token are summed
last, in slot order. fp32 inputs multiply exactly ("ieee"); bf16 and fp16 on tensor cores with
fp32 accumulation.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _block(block_ptr, b):
    # (expert, first sorted pair, end of the expert's run) of block b; expert -1: no work
    row = block_ptr + 3 * b
    return tl.load(row), tl.load(row + 1), tl.load(row + 2)


@triton.jit
def _gate_up_kernel(x_ptr, w13_ptr, order_ptr, block_ptr, h_ptr, hidden, inter, num_slots, limit,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    IEEE: tl.constexpr):
    # program (block b, column block n): h[pairs of b, n] for the expert of b
    expert, first, end = _block(block_ptr, tl.program_id(0))
    if expert >= 0:
        r = first + tl.arange(0, BLOCK_M)
        r_ok = r < end
        pair = tl.load(order_ptr + r, mask=r_ok, other=0)
        token = (pair // num_slots).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < inter
        w_rows = expert.to(tl.int64) * 2 * inter + n
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < hidden
            xk = tl.load(x_ptr + token[:, None] * hidden + k[None, :],
                         mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(w13_ptr + w_rows[None, :] * hidden + k[:, None],
                         mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            wu = tl.load(w13_ptr + (w_rows + inter)[None, :] * hidden + k[:, None],
                         mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            acc_g += _dot(xk, wg, IEEE)
            acc_u += _dot(xk, wu, IEEE)
        gate = tl.minimum(acc_g, limit)
        up = tl.minimum(tl.maximum(acc_u, -limit), limit)
        h = gate * tl.sigmoid(gate) * up
        tl.store(h_ptr + r[:, None].to(tl.int64) * inter + n[None, :],
                 h.to(h_ptr.dtype.element_ty), mask=r_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, w2_ptr, order_ptr, block_ptr, weight_ptr, out_ptr, hidden, inter,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 IEEE: tl.constexpr):
    # program (block b, column block n): out[pair, n] = weight[pair] * h[sorted row] w2[e, n]^T
    expert, first, end = _block(block_ptr, tl.program_id(0))
    if expert >= 0:
        r = first + tl.arange(0, BLOCK_M)
        r_ok = r < end
        pair = tl.load(order_ptr + r, mask=r_ok, other=0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < hidden
        w_rows = expert.to(tl.int64) * hidden + n
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < inter
            hk = tl.load(h_ptr + r[:, None].to(tl.int64) * inter + k[None, :],
                         mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            wk = tl.load(w2_ptr + w_rows[None, :] * inter + k[:, None],
                         mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            acc += _dot(hk, wk, IEEE)
        w = tl.load(weight_ptr + pair, mask=r_ok, other=0.0)
        tl.store(out_ptr + pair[:, None] * hidden + n[None, :], acc * w[:, None],
                 mask=r_ok[:, None] & n_ok[None, :])


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Pairs per block: a decode batch's experts take one block each (every weight tile read
    once); large prefills take bigger blocks (fewer re-reads of each expert's weights)."""
    return 64 if num_pairs <= 64 * num_experts else 128


def align(ids: torch.Tensor, num_experts: int, block_m: int):
    """(order [P], blocks [B, 3] int32) for the P = ids.numel() pairs: order lists pair indices
    (token * S + slot) by expert; block b covers sorted pairs [first, end) of one expert, at most
    block_m of them; rows (expert, first, end) = (-1, 0, 0) are spare blocks. B is a function of
    P and E alone, and no value goes to the host."""
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    run_end = torch.cumsum(counts, 0)
    blocks_per = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks_per, 0)  # [E]: blocks of experts <= e
    num_blocks = triton.cdiv(num_pairs, block_m) + num_experts
    b = torch.arange(num_blocks, device=ids.device)
    expert = torch.searchsorted(block_end, b, right=True)  # expert of block b (E: spare)
    valid = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    local = b - (block_end[e] - blocks_per[e])
    first = run_end[e] - counts[e] + local * block_m
    end = torch.minimum(first + block_m, run_end[e])
    rows = [torch.where(valid, col, fill) for col, fill in ((expert, -1), (first, 0), (end, 0))]
    return order, torch.stack(rows, dim=1).to(torch.int32)


def fused_moe(x, ids, weights, w13, w2, limit: float) -> torch.Tensor:
    """See the module docstring."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    assert x.is_contiguous() and w13.is_contiguous() and w2.is_contiguous()
    assert w13.shape == (num_experts, 2 * inter, hidden), w13.shape
    assert w2.shape == (num_experts, hidden, inter), w2.shape
    assert ids.shape == weights.shape and ids.shape[0] == num_tokens, (ids.shape, weights.shape)
    assert x.dtype == w13.dtype == w2.dtype, (x.dtype, w13.dtype, w2.dtype)
    num_slots = ids.shape[1]
    out = torch.empty(num_tokens * num_slots, hidden, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out.view(0, hidden).to(x.dtype)
    block_m = block_m_for(ids.numel(), num_experts)
    order, blocks = align(ids, num_experts, block_m)
    h = torch.empty(ids.numel(), inter, dtype=x.dtype, device=x.device)
    ieee = x.dtype == torch.float32
    block_n, block_k = 64, 64
    grid = (blocks.shape[0],)
    _gate_up_kernel[(*grid, triton.cdiv(inter, block_n))](
        x, w13, order, blocks, h, hidden, inter, num_slots, limit, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee)
    _down_kernel[(*grid, triton.cdiv(hidden, block_n))](
        h, w2, order, blocks, weights.float().contiguous(), out, hidden, inter, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee)
    return out.view(num_tokens, num_slots, hidden).sum(dim=1).to(x.dtype)
