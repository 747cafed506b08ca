"""hisparse_swap_in: each token's top-k C4 positions -> rows of its request's HiSparse hot buffer.

Index spaces (one C4 layer): a request slot s owns R hot rows, physical hot slot s * R + r (the
slot in the hot buffer's pages). Rows 0 .. R-2 are kept least recently used; row R-1 is reserved
for the entry the compressor wrote last. Per-slot state (int64, updated in place):

    row_pos [S, R]      logical C4 position each row holds (-1: empty)
    row_age [S, R - 1]  clock of each LRU row's last use (-1: never used)
    clock [S]           one tick per swap-in that touches the slot

For each token t whose req_slots[t] = s >= 0 (such tokens belong to distinct requests):
  1. new_pos[t] >= 0: the reserved row now holds that position (the compressor just wrote it);
  2. a top-k position held by the reserved row or an LRU row is a hit, and that row is used now;
  3. the misses, in top-k order, take the LRU rows not hit now, least recently used first (empty
     rows first, ties to the lower row); the caller copies host slot
     page_table[req_rows[t], c // 64] * 64 + c % 64 into each (miss_src -> miss_dst).
Outputs: phys [T, K] physical hot slots (-1 where topk is -1 or the token's req_slots is -1);
miss_src, miss_dst [T * K] (-1 padded: fixed sizes, so a captured step needs no host sync);
counters[0] += hits, counters[1] += misses. Top-k positions of a token are distinct, and R - 1 >= K
(a miss never evicts a row hit in the same step).

The Triton kernel runs one program per token: a hit scan over the rows (blocks of BLOCK_K top-k
positions against every row), a sort of the rows by (age, row), then the misses take the sorted
rows by their rank among the misses. The torch reference does the same per token, vectorised.
"""

import torch
import triton
import triton.language as tl

from dsv4ray.cache.hisparse import C4_PER_PAGE  # host slot = page * 64 + position % 64

_BIG = tl.constexpr(2**62)  # sort key of lanes past the last row


@triton.jit
def _hit_scan(
    topk_ptr, t, k0, num_k, active, pos, res_pos, rows, BLOCK_K: tl.constexpr, LP: tl.constexpr
):
    """Top-k block [k0, k0 + BLOCK_K): (index j, position p, at the reserved row, LRU hit row
    (LP: none), miss, eq [BLOCK_K, LP] of p against the rows)."""
    j = k0 + tl.arange(0, BLOCK_K)
    p = tl.load(topk_ptr + t * num_k + j, mask=j < num_k, other=-1)
    valid = tl.where(active, p >= 0, False)  # (not `&` with a scalar: the interpreter makes ints)
    at_res = valid & (p == res_pos)
    eq = (p[:, None] == pos[None, :]) & (valid & ~at_res)[:, None]
    hit_row = tl.min(tl.where(eq, rows[None, :], LP), axis=1)
    miss = valid & ~at_res & (hit_row == LP)
    return j, p, at_res, hit_row, miss, eq


@triton.jit
def _swap_in_kernel(
    topk_ptr,
    req_slot_ptr,
    new_pos_ptr,
    page_table_ptr,
    req_row_ptr,
    row_pos_ptr,
    row_age_ptr,
    clock_ptr,
    counter_ptr,
    phys_ptr,
    src_ptr,
    dst_ptr,
    num_k,
    stride_pt,
    NUM_ROWS: tl.constexpr,
    LP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EPP: tl.constexpr,
):
    # program = token t; LRU rows 0 .. NUM_ROWS - 2 in lanes [0, LP), the reserved row apart
    NUM_LRU: tl.constexpr = NUM_ROWS - 1
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(req_slot_ptr + t)
    active = slot >= 0
    slot = tl.maximum(slot, 0)
    base = slot * NUM_ROWS
    rows = tl.arange(0, LP)
    in_rows = rows < NUM_LRU
    pos = tl.load(row_pos_ptr + base + rows, mask=in_rows, other=-2)
    new_pos = tl.load(new_pos_ptr + t)
    res_pos = tl.where(new_pos >= 0, new_pos, tl.load(row_pos_ptr + base + NUM_LRU))
    tl.store(row_pos_ptr + base + NUM_LRU, new_pos, mask=tl.where(active, new_pos >= 0, False))
    row_hit = tl.zeros([LP], tl.int32)
    num_hits = tl.zeros((), tl.int64)
    num_miss = tl.zeros((), tl.int64)
    for k0 in range(0, num_k, BLOCK_K):  # pass 1: hits
        j, p, at_res, hit_row, miss, eq = _hit_scan(
            topk_ptr, t, k0, num_k, active, pos, res_pos, rows, BLOCK_K, LP
        )
        row_hit = tl.maximum(row_hit, tl.max(eq.to(tl.int32), axis=0))
        hit = hit_row < LP
        phys = tl.where(at_res, base + NUM_LRU, tl.where(hit, base + hit_row, -1))
        tl.store(phys_ptr + t * num_k + j, phys, mask=(j < num_k) & ~miss)  # misses: pass 2
        num_hits += tl.sum((at_res | hit).to(tl.int64), axis=0)
        num_miss += tl.sum(miss.to(tl.int64), axis=0)
    now = tl.load(clock_ptr + slot) + 1
    age = tl.load(row_age_ptr + slot * NUM_LRU + rows, mask=in_rows, other=0)
    age = tl.where(row_hit > 0, now, age)  # rows hit now sort after every other row
    key = (age + 1) * LP + rows  # >= 0 (ages >= -1), so % LP gives the row back
    order = tl.sort(tl.where(in_rows, key, _BIG))  # [LP] keys by LRU rank
    table = page_table_ptr + tl.load(req_row_ptr + t) * stride_pt
    taken = tl.zeros((), tl.int64)
    for k0 in range(0, num_k, BLOCK_K):  # pass 2: the misses take rows in LRU order
        j, p, at_res, hit_row, miss, eq = _hit_scan(
            topk_ptr, t, k0, num_k, active, pos, res_pos, rows, BLOCK_K, LP
        )
        rank = taken + tl.cumsum(miss.to(tl.int64), axis=0) - 1
        pick = tl.where(rows[None, :] == rank[:, None], order[None, :] % LP, 0)
        victim = tl.sum(pick, axis=1)
        host = tl.load(table + p // EPP, mask=miss, other=0) * EPP + p % EPP
        tl.store(phys_ptr + t * num_k + j, base + victim, mask=miss)
        tl.store(src_ptr + t * num_k + j, tl.where(miss, host, -1), mask=j < num_k)
        tl.store(dst_ptr + t * num_k + j, tl.where(miss, base + victim, -1), mask=j < num_k)
        tl.store(row_pos_ptr + base + victim, p, mask=miss)
        taken += tl.sum(miss.to(tl.int64), axis=0)
    last = tl.sum(tl.where(rows == num_miss - 1, order, 0), axis=0)  # key of the last victim
    victim_row = tl.where(num_miss > 0, key <= last, False)
    tl.store(
        row_age_ptr + slot * NUM_LRU + rows,
        tl.where(victim_row, now, age),
        mask=tl.where(active, in_rows, False),
    )
    tl.store(clock_ptr + slot, now, mask=active)
    tl.atomic_add(counter_ptr, num_hits, mask=active)
    tl.atomic_add(counter_ptr + 1, num_miss, mask=active)


def _check(topk, req_slots, new_pos, page_table, req_rows, row_pos, row_age, clock, counters):
    num_tokens, num_k = topk.shape
    for name, t in (("req_slots", req_slots), ("new_pos", new_pos), ("req_rows", req_rows)):
        if t.numel() != num_tokens:
            raise ValueError(f"{name} has {t.numel()} entries but topk has {num_tokens} rows")
    tensors = (topk, req_slots, new_pos, page_table, req_rows, row_pos, row_age, clock, counters)
    for t in tensors:
        assert t.dtype == torch.int64 and t.is_contiguous(), (t.dtype, t.shape)
    num_slots, num_rows = row_pos.shape
    assert row_age.shape == (num_slots, num_rows - 1) and clock.shape == (num_slots,)
    assert counters.shape == (2,), counters.shape
    if num_rows - 1 < num_k:
        raise ValueError(
            f"{num_rows} hot rows keep {num_rows - 1} LRU rows, fewer than the top-k ({num_k})"
        )


def hisparse_swap_in(
    topk, req_slots, new_pos, page_table, req_rows, row_pos, row_age, clock, counters
):
    """Hot rows of each token's top-k (see the module docstring) -> (phys, miss_src, miss_dst).

    topk int64 [T, K] logical C4 positions (-1: none); req_slots, new_pos, req_rows int64 [T]
    (req_slots -1: the token does not use the hot buffer); page_table int64 [R, P] full page ids;
    row_pos [S, R_hot], row_age [S, R_hot - 1], clock [S], counters [2] int64, on topk's device,
    updated in place. Index arrays of different lengths raise ValueError.
    """
    _check(topk, req_slots, new_pos, page_table, req_rows, row_pos, row_age, clock, counters)
    num_tokens, num_k = topk.shape
    phys = torch.empty(num_tokens, num_k, dtype=torch.int64, device=topk.device)
    src = torch.empty(num_tokens * num_k, dtype=torch.int64, device=topk.device)
    dst = torch.empty_like(src)
    if num_tokens == 0 or num_k == 0:
        return phys, src, dst
    num_rows = row_pos.shape[1]
    lanes = triton.next_power_of_2(num_rows - 1)
    block_k = max(1, min(triton.next_power_of_2(num_k), 4096 // lanes))
    _swap_in_kernel[(num_tokens,)](
        topk,
        req_slots,
        new_pos,
        page_table,
        req_rows,
        row_pos,
        row_age,
        clock,
        counters,
        phys,
        src,
        dst,
        num_k,
        page_table.stride(0),
        NUM_ROWS=num_rows,
        LP=lanes,
        BLOCK_K=block_k,
        EPP=C4_PER_PAGE,
        num_warps=4,
    )
    return phys, src, dst


def hisparse_swap_in_ref(
    topk, req_slots, new_pos, page_table, req_rows, row_pos, row_age, clock, counters
):
    """Torch reference of hisparse_swap_in (same arguments, same outputs and state updates)."""
    _check(topk, req_slots, new_pos, page_table, req_rows, row_pos, row_age, clock, counters)
    num_tokens, num_k = topk.shape
    if num_tokens == 0 or num_k == 0:  # the kernel launches nothing either
        empty = torch.empty(num_tokens * num_k, dtype=torch.int64, device=topk.device)
        return empty.view(num_tokens, num_k), empty.clone(), empty.clone()
    num_lru = row_pos.shape[1] - 1  # >= num_k >= 1
    active = req_slots >= 0
    slot = req_slots.clamp(min=0)
    fresh = active & (new_pos >= 0)
    row_pos[slot[fresh], num_lru] = new_pos[fresh]
    res_pos = torch.where(new_pos >= 0, new_pos, row_pos[slot, num_lru])
    pos = row_pos[slot, :num_lru]  # [T, L]
    valid = (topk >= 0) & active[:, None]
    at_res = valid & (topk == res_pos[:, None])
    eq = (topk[:, :, None] == pos[:, None, :]) & (valid & ~at_res)[:, :, None]  # [T, K, L]
    rows = torch.arange(num_lru, device=topk.device)
    hit_row = torch.where(eq, rows, num_lru).amin(-1)
    hit = eq.any(-1)
    miss = valid & ~at_res & ~hit
    now = clock[slot] + 1
    age = torch.where(eq.any(1), now[:, None], row_age[slot])  # [T, L]
    lanes = triton.next_power_of_2(num_lru)
    key = (age + 1) * lanes + rows
    order = key.sort(dim=1).values
    rank = miss.long().cumsum(1) - 1
    victim = order.gather(1, rank.clamp(min=0)) % lanes
    num_miss = miss.sum(1)
    last = order.gather(1, (num_miss - 1).clamp(min=0)[:, None])  # key of the last victim
    base = (slot * (num_lru + 1))[:, None]
    phys = torch.where(at_res, base + num_lru, torch.where(hit, base + hit_row, -1))
    phys = torch.where(miss, base + victim, phys)
    page = page_table[req_rows[:, None], (topk.clamp(min=0) // C4_PER_PAGE)]
    host = page * C4_PER_PAGE + topk.clamp(min=0) % C4_PER_PAGE
    src = torch.where(miss, host, -1).reshape(-1)
    dst = torch.where(miss, base + victim, -1).reshape(-1)
    victim_row = (num_miss[:, None] > 0) & (key <= last)
    row_age[slot[active]] = torch.where(victim_row, now[:, None], age)[active]
    row_pos[slot[:, None].expand_as(topk)[miss], victim[miss]] = topk[miss]
    clock[slot[active]] = now[active]
    counters[0] += (at_res | hit).sum()
    counters[1] += miss.sum()
    return phys, src, dst
