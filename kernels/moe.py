"""Routed experts as two grouped GEMMs over the (token, slot) pairs grouped by expert, sync-free.

    fused_moe(x [N, hidden], ids [N, S] int64, weights [N, S] fp32, w13 [E, 2 * inter, hidden],
              w2 [E, hidden, inter], limit) -> [N, hidden] in x's dtype
    out[t] = sum_s weights[t, s] * expert_{ids[t, s]}(x[t]),
    expert_e(v) = w2[e] (silu(min(g, limit)) * clamp(u, -limit, limit)), g | u = w13[e] v

w13 holds each expert's gate rows (w1) then its up rows (w3). A slot may name any expert, the
shared expert included when the caller stacks it as one more expert with weight 1. Pairs are
numbered p = token * S + slot.

Plan (no host synchronisation, so a CUDA graph can capture it; grids are fixed by the shapes and
programs with no pairs exit at once): the pairs are grouped by expert, then `_gate_up_kernel`
computes h[p] = silu(min(x w1^T, limit)) * clamp(x w3^T) for a block of one expert's pairs and a
block of intermediate columns (the expert's weight tile is read once per block of pairs), and
`_down_kernel` writes weights[p] * (h[p] w2^T) at row p; the S rows of a token are summed last, in
slot order. Two ways to group, by the number of pairs P:
  - list (decode batches, P <= LIST_MAX_PAIRS): `_list_kernel` writes each expert's pairs in
    order into its own row of a [E, P] table (one launch); program (e, m) takes pairs
    [m * BLOCK_M, (m + 1) * BLOCK_M) of expert e's row;
  - sort (prefills): `align` sorts the pairs by expert and cuts each expert's run into blocks of
    BLOCK_M pairs (at most cdiv(P, BLOCK_M) + E blocks).
fp32 inputs multiply exactly ("ieee"); bf16 and fp16 on tensor cores with fp32 accumulation.
"""

import torch
import triton
import triton.language as tl

LIST_MAX_PAIRS = 1024


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _pairs(list_ptr, blocks_ptr, counts_ptr, num_pairs, LISTED: tl.constexpr,
           BLOCK_M: tl.constexpr):
    """(expert, pair ids [BLOCK_M], their mask, whether the program has any) of program_id(0)."""
    pid = tl.program_id(0)
    if LISTED:  # program (expert, m): row `expert` of the [E, P] list table
        blocks_per_expert = tl.cdiv(num_pairs, BLOCK_M)
        expert = pid // blocks_per_expert
        first = (pid % blocks_per_expert) * BLOCK_M
        end = tl.load(counts_ptr + expert)
        base = expert.to(tl.int64) * num_pairs
    else:  # block row (expert, first, end) over the sorted pairs; expert -1: a spare block
        expert = tl.load(blocks_ptr + 3 * pid)
        first = tl.load(blocks_ptr + 3 * pid + 1)
        end = tl.load(blocks_ptr + 3 * pid + 2)
        base = 0
    r = first + tl.arange(0, BLOCK_M)
    ok = r < end
    pair = tl.load(list_ptr + base + r, mask=ok, other=0).to(tl.int64)
    return expert, pair, ok, (expert >= 0) & (first < end)


@triton.jit(do_not_specialize=["num_pairs"])
def _list_kernel(ids_ptr, list_ptr, counts_ptr, num_pairs, BLOCK: tl.constexpr):
    # program e: the pairs routed to expert e, in pair order, at list[e, 0:count]
    e = tl.program_id(0)
    count = 0
    for p0 in range(0, num_pairs, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        hit = (tl.load(ids_ptr + p, mask=p < num_pairs, other=-1) == e).to(tl.int32)
        pos = count + tl.cumsum(hit, axis=0) - 1
        tl.store(list_ptr + e.to(tl.int64) * num_pairs + pos, p, mask=hit > 0)
        count += tl.sum(hit, axis=0)
    tl.store(counts_ptr + e, count)


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(x_ptr, w13_ptr, list_ptr, blocks_ptr, counts_ptr, h_ptr, num_pairs, hidden,
                    inter, num_slots, limit, LISTED: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    # program (pair block, column block n): h[pairs, n] for the pairs' expert
    expert, pair, ok, active = _pairs(list_ptr, blocks_ptr, counts_ptr, num_pairs, LISTED,
                                      BLOCK_M)
    if active:
        token = pair // num_slots
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < inter
        w_rows = expert.to(tl.int64) * 2 * inter + n
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < hidden
            xk = tl.load(x_ptr + token[:, None] * hidden + k[None, :],
                         mask=ok[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(w13_ptr + w_rows[None, :] * hidden + k[:, None],
                         mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            wu = tl.load(w13_ptr + (w_rows + inter)[None, :] * hidden + k[:, None],
                         mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            acc_g += _dot(xk, wg, IEEE)
            acc_u += _dot(xk, wu, IEEE)
        gate = tl.minimum(acc_g, limit)
        up = tl.minimum(tl.maximum(acc_u, -limit), limit)
        h = gate * tl.sigmoid(gate) * up
        tl.store(h_ptr + pair[:, None] * inter + n[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(h_ptr, w2_ptr, list_ptr, blocks_ptr, counts_ptr, weight_ptr, out_ptr, num_pairs,
                 hidden, inter, LISTED: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    # program (pair block, column block n): out[pair, n] = weight[pair] * h[pair] w2[e, n]^T
    expert, pair, ok, active = _pairs(list_ptr, blocks_ptr, counts_ptr, num_pairs, LISTED,
                                      BLOCK_M)
    if active:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < hidden
        w_rows = expert.to(tl.int64) * hidden + n
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < inter
            hk = tl.load(h_ptr + pair[:, None] * inter + k[None, :],
                         mask=ok[:, None] & k_ok[None, :], other=0.0)
            wk = tl.load(w2_ptr + w_rows[None, :] * inter + k[:, None],
                         mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            acc += _dot(hk, wk, IEEE)
        w = tl.load(weight_ptr + pair, mask=ok, other=0.0)
        tl.store(out_ptr + pair[:, None] * hidden + n[None, :], acc * w[:, None],
                 mask=ok[:, None] & n_ok[None, :])


def align(ids: torch.Tensor, num_experts: int, block_m: int):
    """(order [P], blocks [B, 3] int32) for the P = ids.numel() pairs: order lists pair indices by
    expert; block b covers sorted pairs [first, end) of one expert, at most block_m of them; rows
    (expert, first, end) = (-1, 0, 0) are spare blocks. B is a function of P and E alone, and no
    value goes to the host."""
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    order = torch.argsort(flat.to(torch.int32), stable=True)
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


def list_pairs(ids: torch.Tensor, num_experts: int):
    """(table [E, P] int64, counts [E] int32): row e lists the pairs routed to expert e in pair
    order (entries past counts[e] are unused). One launch, no value goes to the host."""
    flat = ids.reshape(-1).contiguous()
    num_pairs = flat.numel()
    table = torch.empty(num_experts, num_pairs, dtype=torch.int64, device=ids.device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    _list_kernel[(num_experts,)](flat, table, counts, num_pairs, BLOCK=256)
    return table, counts


def _tiles(listed: bool) -> dict:
    """Tile shapes: decode batches stream each expert's weights once (a 64-pair block is a whole
    expert's share of up to 64 tokens); prefills reuse wider tiles on tensor cores."""
    if listed:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


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
    num_slots, num_pairs = ids.shape[1], ids.numel()
    if num_tokens == 0:
        return torch.empty(0, hidden, dtype=x.dtype, device=x.device)
    listed = num_pairs <= LIST_MAX_PAIRS
    tiles = _tiles(listed)
    if listed:
        pair_list, counts = list_pairs(ids, num_experts)
        blocks = counts  # unused
        num_blocks = num_experts * triton.cdiv(num_pairs, tiles["BLOCK_M"])
    else:
        pair_list, blocks = align(ids, num_experts, tiles["BLOCK_M"])
        counts = blocks  # unused
        num_blocks = blocks.shape[0]
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    ieee = x.dtype == torch.float32
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, tiles["BLOCK_N"]))](
        x, w13, pair_list, blocks, counts, h, num_pairs, hidden, inter, num_slots, limit,
        LISTED=listed, IEEE=ieee, **tiles)
    _down_kernel[(num_blocks, triton.cdiv(hidden, tiles["BLOCK_N"]))](
        h, w2, pair_list, blocks, counts, weights.float().contiguous(), out, num_pairs, hidden,
        inter, LISTED=listed, IEEE=ieee, **tiles)
    return out.view(num_tokens, num_slots, hidden).sum(dim=1).to(x.dtype)
