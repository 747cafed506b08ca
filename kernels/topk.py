"""topk_rows: per row of scores, the positions of the k largest in descending score, equal scores in
ascending position, -1 padded (the indexer's selection rule).

Scores arrive as order-preserving int32 (`ordered_int32`: integer order == float order), and
MASKED_SCORE (below every real score, -inf included) marks positions that must never be picked.

The Triton kernel runs one program per row. A radix select finds the exact k-th largest score u*
(RADIX_BITS bits a pass over the row, a histogram of the candidates' next digit each pass); one
compaction pass then keeps every score > u* and the first (in position order) of the scores == u*,
which is exactly the tie rule, and a sort of those k keys (score << 32 | ~position) orders them.
Each pass reads the row (4 bytes an entry) from L2; only k keys are sorted.
"""

import torch
import triton
import triton.language as tl

MASKED_SCORE = -(2**31)
MASKED_SCORE_C = tl.constexpr(MASKED_SCORE)
SIGN = tl.constexpr(-(2**31))  # xor with the sign bit: int32 order -> uint32 order
LOW32 = tl.constexpr(0xFFFFFFFF)
RADIX_BITS = 4


@triton.jit
def ordered_int32(score):
    """fp32 -> int32 with the same order (-0 and +0 map to one value); score must not be NaN."""
    bits = (score + 0.0).to(tl.int32, bitcast=True)  # + 0.0: -0 -> +0
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def ordered_int32_ref(score: torch.Tensor) -> torch.Tensor:
    """Torch twin of `ordered_int32`."""
    bits = (score + 0.0).view(torch.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _load_unsigned(row_ptr, idx, ok):
    x = tl.load(row_ptr + idx, mask=ok, other=MASKED_SCORE_C)
    return (x ^ SIGN).to(tl.uint32, bitcast=True)


@triton.jit
def _radix_pass(row_ptr, num_cols, prefix, need, SHIFT: tl.constexpr, CHUNK: tl.constexpr,
                RADIX_BITS: tl.constexpr):
    """Fix the digit at bit SHIFT of the need-th largest entry among those matching prefix above
    it -> (prefix with that digit, need among the entries that also match the new digit)."""
    NUM_BINS: tl.constexpr = 1 << RADIX_BITS
    HI_MASK: tl.constexpr = (0xFFFFFFFF << (SHIFT + RADIX_BITS)) & 0xFFFFFFFF
    bins = tl.arange(0, NUM_BINS)
    hist = tl.zeros((NUM_BINS,), tl.int32)
    for c0 in range(0, num_cols, CHUNK):
        idx = c0 + tl.arange(0, CHUNK)
        u = _load_unsigned(row_ptr, idx, idx < num_cols)
        match = (idx < num_cols) & ((u & HI_MASK) == prefix)  # agrees on the digits so far
        digit = tl.where(match, (u >> SHIFT) & (NUM_BINS - 1), 0).to(tl.int32)
        misses = tl.sum((~match).to(tl.int32), axis=0)  # counted in bin 0 by the histogram
        hist += tl.histogram(digit, NUM_BINS) - tl.where(bins == 0, misses, 0)
    at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # [bins]
    digit = tl.max(tl.where(at_or_above >= need, bins, -1), axis=0)
    need -= tl.sum(tl.where(bins > digit, hist, 0), axis=0)
    return prefix | (digit.to(tl.uint32) << SHIFT), need


@triton.jit
def _radix_select(row_ptr, num_cols, need, CHUNK: tl.constexpr, RADIX_BITS: tl.constexpr):
    """(u*, n): u* = the need-th largest entry of the row as uint32 order bits, n = how many entries
    equal to u* belong to the top `need` (1 <= need <= num_cols)."""
    prefix = tl.zeros((), tl.uint32)
    for i in tl.static_range(32 // RADIX_BITS):
        prefix, need = _radix_pass(row_ptr, num_cols, prefix, need, 32 - RADIX_BITS * (i + 1),
                                   CHUNK, RADIX_BITS)
    return prefix, need


@triton.jit(do_not_specialize=["num_cols", "topk"])
def _topk_rows_kernel(scores_ptr, out_ptr, buf_ptr, num_cols, topk, K_POW2: tl.constexpr,
                      CHUNK: tl.constexpr, RADIX_BITS: tl.constexpr):
    # program = one row; buf [rows, K_POW2] int64 scratch for the selected keys
    t = tl.program_id(0).to(tl.int64)
    row_ptr = scores_ptr + t * num_cols
    buf_row = buf_ptr + t * K_POW2
    need = tl.minimum(topk, num_cols)
    threshold, need_eq = _radix_select(row_ptr, num_cols, need, CHUNK, RADIX_BITS)
    count = tl.zeros((), tl.int32)
    taken_eq = tl.zeros((), tl.int32)
    for c0 in range(0, num_cols, CHUNK):
        idx = c0 + tl.arange(0, CHUNK)
        ok = idx < num_cols
        u = _load_unsigned(row_ptr, idx, ok)
        eq = ok & (u == threshold)
        eq_rank = taken_eq + tl.cumsum(eq.to(tl.int32), axis=0) - 1
        keep = (ok & (u > threshold)) | (eq & (eq_rank < need_eq))
        slot = count + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        score = (u.to(tl.int32, bitcast=True) ^ SIGN).to(tl.int64)
        tl.store(buf_row + slot, (score << 32) | (idx.to(tl.int64) ^ LOW32), mask=keep)
        taken_eq += tl.sum(eq.to(tl.int32), axis=0)
        count += tl.sum(keep.to(tl.int32), axis=0)
    tl.debug_barrier()  # the stores above come from every thread of the program
    k = tl.arange(0, K_POW2)
    keys = tl.sort(tl.load(buf_row + k, mask=k < count, other=MASKED_SCORE_C * 2**32),
                   descending=True)
    pos = tl.where((keys >> 32) == MASKED_SCORE_C, -1, (keys & LOW32) ^ LOW32)
    tl.store(out_ptr + t * topk + k, pos, mask=k < topk)


def topk_rows(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """scores int32 [T, L] (order-preserving, MASKED_SCORE = never) -> positions int64 [T, topk]:
    descending score, ties to the lower position, -1 padded (also for picked MASKED entries)."""
    assert scores.dtype == torch.int32 and scores.dim() == 2 and scores.is_contiguous()
    num_rows, num_cols = scores.shape
    out = torch.full((num_rows, topk), -1, dtype=torch.int64, device=scores.device)
    if num_rows == 0 or num_cols == 0 or topk == 0:
        return out
    # holds the `need` picks; a function of topk alone, so short contexts compile nothing new
    k_pow2 = max(16, triton.next_power_of_2(topk))
    buf = torch.empty(num_rows, k_pow2, dtype=torch.int64, device=scores.device)
    chunk, num_warps = _config()
    _topk_rows_kernel[(num_rows,)](scores, out, buf, num_cols, topk, K_POW2=k_pow2, CHUNK=chunk,
                                   RADIX_BITS=RADIX_BITS, num_warps=num_warps)
    return out


def _config() -> tuple:
    """(row entries per step of a pass, num_warps): each step's loads are one round trip, so
    long steps; 16 entries a thread keep sm_90 free of spills."""
    return 8192, 16


def topk_rows_ref(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Torch reference of topk_rows: keys score << 32 | ~position are unique, so torch.topk over
    them gives exactly the tie rule."""
    num_rows, num_cols = scores.shape
    out = torch.full((num_rows, topk), -1, dtype=torch.int64, device=scores.device)
    k = min(topk, num_cols)
    if k == 0 or num_rows == 0:
        return out
    pos = torch.arange(num_cols, device=scores.device)
    keys = (scores.to(torch.int64) << 32) | (pos ^ 0xFFFFFFFF)
    top = torch.topk(keys, k, dim=1, sorted=True).values
    out[:, :k] = torch.where((top >> 32) == MASKED_SCORE, -1, (top & 0xFFFFFFFF) ^ 0xFFFFFFFF)
    return out
