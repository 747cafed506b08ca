"""topk_rows: per row of scores, the positions of the k largest in descending score, equal scores in
ascending position, -1 padded (the indexer's selection rule).

Scores arrive as order-preserving int32 (`ordered_int32`: integer order == float order), and
MASKED_SCORE (below every real score, -inf included) marks positions that must never be picked.

The Triton kernel runs one program per row. A radix select finds the exact k-th largest score u*
(RADIX_BITS bits a pass, a histogram of the candidates' next digit each pass); a last pass keeps
every score > u* and the first (in position order) of the scores == u*, which is exactly the
tie rule, and a sort of those k keys (score << 32 | ~position) orders them. A pass over the row
reads it (4 bytes an entry) from L2, so the passes over the row stop once at most NARROW entries
match the digits fixed so far (scores cluster in their top bits: about three passes of eight):
one more pass picks every entry above those digits (all in the top k) and copies the matching
ones, in position order, into a scratch row of their own, and the remaining digits and the last
pass read that alone. Given each row's visible length (the indexer's bound: the entries past it
are masked padding up to the page table's width, which under CUDA graphs is the context
bucket's), the passes read the visible entries alone, and a row of at most k of them skips the
select: every entry is kept.

A long row with few rows beside it (a 1M-token decode: 262,144 entries a row on one SM) is cut
into segments: the same kernel first selects each segment's top k candidates with the same rule,
equal scores kept in position order, then selects the row's top k among the candidates. The
row's top k is among its segments' (the order score, then lower position, is total), and the
candidates of equal score stay in position order, so the tie rule holds. Both passes are one
compiled kernel: the mode is a runtime argument, so a context that first needs segments compiles
nothing.
"""

import torch
import triton
import triton.language as tl

from dsv4ray.kernels.bits import num_sms

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
def _hi_mask(bits):
    """uint32 mask of the top `bits` bits (0 <= bits <= 32)."""
    return ((tl.full((), LOW32, tl.int64) << (32 - bits).to(tl.int64)) & LOW32).to(tl.uint32)


@triton.jit
def _radix_pass(src_ptr, num, prefix, need, bits, CHUNK: tl.constexpr, RADIX_BITS: tl.constexpr):
    """Among the num entries at src_ptr that match prefix on their top `bits` bits, fix the next
    digit of the need-th largest -> (prefix with that digit, need among the entries that also
    match it, how many entries match it)."""
    NUM_BINS: tl.constexpr = 1 << RADIX_BITS
    shift = (32 - RADIX_BITS - bits).to(tl.uint32)
    hi_mask = _hi_mask(bits)
    bins = tl.arange(0, NUM_BINS)
    hist = tl.zeros((NUM_BINS,), tl.int32)
    for c0 in range(0, num, CHUNK):
        idx = c0 + tl.arange(0, CHUNK)
        u = _load_unsigned(src_ptr, idx, idx < num)
        match = (idx < num) & ((u & hi_mask) == prefix)  # agrees on the digits so far
        digit = tl.where(match, (u >> shift) & (NUM_BINS - 1), 0).to(tl.int32)
        misses = tl.sum((~match).to(tl.int32), axis=0)  # counted in bin 0 by the histogram
        hist += tl.histogram(digit, NUM_BINS) - tl.where(bins == 0, misses, 0)
    at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # [bins]
    digit = tl.max(tl.where(at_or_above >= need, bins, -1), axis=0)
    need -= tl.sum(tl.where(bins > digit, hist, 0), axis=0)
    matched = tl.sum(tl.where(bins == digit, hist, 0), axis=0)
    return prefix | (digit.to(tl.uint32) << shift), need, matched


MODE_ROW, MODE_SEGMENT, MODE_CANDIDATES = 0, 1, 2  # the kernel's `mode` argument
SEGMENT_C, CANDIDATES_C = tl.constexpr(MODE_SEGMENT), tl.constexpr(MODE_CANDIDATES)
# a row's entries that still match the select's digits once at most this many do are copied
# into a scratch row of their own, and the remaining passes read that alone
NARROW = 2048


@triton.jit
def _keys(u, pos):
    """Sort keys score << 32 | ~position: descending key order is the selection order."""
    score = (u.to(tl.int32, bitcast=True) ^ SIGN).to(tl.int64)
    return (score << 32) | ((pos.to(tl.int64) & LOW32) ^ LOW32)


@triton.jit
def _emit(keep, u, pos, count, buf_row, cand_ptr, cand_pos_ptr, cand_row, mode):
    """Entries of one tile marked keep, in tile order, to the program's picks from slot count on
    (keys in buf_row, or with MODE_SEGMENT score and position at cand_row) -> the new count."""
    slot = count + tl.cumsum(keep.to(tl.int32), axis=0) - 1
    if mode == SEGMENT_C:
        tl.store(cand_ptr + cand_row + slot, u.to(tl.int32, bitcast=True) ^ SIGN, mask=keep)
        tl.store(cand_pos_ptr + cand_row + slot, pos.to(tl.int32), mask=keep)
    else:
        tl.store(buf_row + slot, _keys(u, pos), mask=keep)
    return count + tl.sum(keep.to(tl.int32), axis=0)


@triton.jit
def _positions(pos_ptr, idx, ok, stored, base):
    """Positions of the entries idx: read at pos_ptr where `stored`, else base + idx."""
    from_pos = (idx * 0 + stored) != 0  # [CHUNK]: a block under the interpreter too
    got = tl.load(pos_ptr + idx, mask=ok & from_pos, other=0)
    return tl.where(from_pos, got, base + idx)


@triton.jit
def _keep_pass(src_ptr, pos_ptr, num, stored, base, threshold, need_eq, count, buf_row, cand_ptr,
               cand_pos_ptr, cand_row, mode, CHUNK: tl.constexpr):  # fmt: skip
    """Every entry above threshold and the first need_eq (in order) equal to it -> the picks."""
    taken_eq = tl.zeros((), tl.int32)
    for c0 in range(0, num, CHUNK):
        idx = c0 + tl.arange(0, CHUNK)
        ok = idx < num
        u = _load_unsigned(src_ptr, idx, ok)
        eq = ok & (u == threshold)
        eq_rank = taken_eq + tl.cumsum(eq.to(tl.int32), axis=0) - 1
        keep = (ok & (u > threshold)) | (eq & (eq_rank < need_eq))
        pos = _positions(pos_ptr, idx, ok, stored, base)
        count = _emit(keep, u, pos, count, buf_row, cand_ptr, cand_pos_ptr, cand_row, mode)
        taken_eq += tl.sum(eq.to(tl.int32), axis=0)
    return count


@triton.jit
def _narrow(row_ptr, pos_ptr, num, stored, base, prefix, bits, scratch_u, scratch_pos, count,
            buf_row, cand_ptr, cand_pos_ptr, cand_row, mode, CHUNK: tl.constexpr):  # fmt: skip
    """One pass over the row: entries above prefix on their top `bits` bits are picks (all of
    them belong to the top k), those equal to it go to the scratch row in order (score bits and
    position) -> the new count of picks."""
    hi_mask = _hi_mask(bits)
    taken = tl.zeros((), tl.int32)
    for c0 in range(0, num, CHUNK):
        idx = c0 + tl.arange(0, CHUNK)
        ok = idx < num
        u = _load_unsigned(row_ptr, idx, ok)
        top = u & hi_mask
        pos = _positions(pos_ptr, idx, ok, stored, base)
        count = _emit(ok & (top > prefix), u, pos, count, buf_row, cand_ptr, cand_pos_ptr,
                      cand_row, mode)  # fmt: skip
        same = ok & (top == prefix)
        slot = taken + tl.cumsum(same.to(tl.int32), axis=0) - 1
        tl.store(scratch_u + slot, u.to(tl.int32, bitcast=True) ^ SIGN, mask=same)
        tl.store(scratch_pos + slot, pos.to(tl.int32), mask=same)
        taken += tl.sum(same.to(tl.int32), axis=0)
    return count


@triton.jit(
    do_not_specialize=["len_ptr", "num_cols", "topk", "row_stride", "seg_len", "mode", "use_len"]
)
def _topk_rows_kernel(
    scores_ptr,
    pos_ptr,
    len_ptr,
    out_ptr,
    cand_ptr,
    cand_pos_ptr,
    buf_ptr,
    scratch_ptr,
    num_cols,
    topk,
    row_stride,
    seg_len,
    mode,
    use_len,
    K_POW2: tl.constexpr,
    CHUNK: tl.constexpr,
    RADIX_BITS: tl.constexpr,
    NARROW: tl.constexpr,
):
    # program (row t, segment g) over entries [g * seg_len, + seg_len) of row t (num_cols in all).
    # mode MODE_ROW: one segment; out [rows, topk] int64 <- positions = entry indexes.
    # MODE_SEGMENT: cand / cand_pos [rows, segments * topk] int32 <- the segment's top-k scores
    #   and positions in position order within each score, MASKED_SCORE past them.
    # MODE_CANDIDATES: the row is those candidates, positions read from pos_ptr; out as MODE_ROW.
    # buf [rows, K_POW2] int64 scratch for the selected keys; scratch [programs, 2, NARROW] int32
    # for the entries a long range narrows to (scores, positions). use_len: entries from len[t]
    # on count as MASKED_SCORE and are never read (len [rows] int64, at most num_cols).
    t = tl.program_id(0).to(tl.int64)
    base = tl.program_id(1).to(tl.int64) * seg_len
    row_ptr = scores_ptr + t * row_stride + base
    row_len = num_cols
    if use_len != 0:
        row_len = tl.minimum(tl.load(len_ptr + t), num_cols).to(tl.int32)
    n = tl.maximum(tl.minimum(row_len - base, seg_len), 0).to(tl.int32)
    need = tl.minimum(topk, n)
    buf_row = buf_ptr + t * K_POW2
    cand_row = (t * tl.cdiv(num_cols, seg_len) + tl.program_id(1)) * topk  # MODE_SEGMENT's slots
    program = t * tl.num_programs(1) + tl.program_id(1)
    scratch_u = scratch_ptr + program * 2 * NARROW
    # the entries still in play: src (num of them, positions at src_pos where `stored`)
    src, src_pos, num = row_ptr, pos_ptr + t * row_stride + base, n
    stored = (mode == CANDIDATES_C).to(tl.int32)
    count = tl.zeros((), tl.int32)
    prefix = tl.zeros((), tl.uint32)
    bits = tl.zeros((), tl.int32)
    if need < n:
        # radix passes over the whole range while more than NARROW entries match the digits
        # fixed so far, then one pass that picks the entries above them and copies those equal
        # into the scratch row, where the remaining passes run
        matched = n
        while (matched > NARROW) & (bits < 32):
            prefix, need, matched = _radix_pass(src, num, prefix, need, bits, CHUNK, RADIX_BITS)
            bits += RADIX_BITS
        if (n > NARROW) & (matched <= NARROW):
            count = _narrow(src, src_pos, num, stored, base, prefix, bits, scratch_u,
                            scratch_u + NARROW, count, buf_row, cand_ptr, cand_pos_ptr, cand_row,
                            mode, CHUNK)  # fmt: skip
            tl.debug_barrier()  # the scratch row comes from every thread of the program
            src, src_pos, num, stored = scratch_u, scratch_u + NARROW, matched, stored * 0 + 1
        while bits < 32:  # src: at most NARROW entries
            prefix, need, matched = _radix_pass(src, num, prefix, need, bits, NARROW, RADIX_BITS)
            bits += RADIX_BITS
    else:  # the whole range is picked: u >= 0 keeps every entry, no select pass
        need = n
    if num <= NARROW:  # a short range or the scratch row: small tiles
        count = _keep_pass(src, src_pos, num, stored, base, prefix, need, count, buf_row,
                           cand_ptr, cand_pos_ptr, cand_row, mode, NARROW)  # fmt: skip
    else:
        count = _keep_pass(src, src_pos, num, stored, base, prefix, need, count, buf_row,
                           cand_ptr, cand_pos_ptr, cand_row, mode, CHUNK)  # fmt: skip
    k = tl.arange(0, K_POW2)
    if mode == SEGMENT_C:  # a short last segment: the rest of its k slots pick nothing
        pad = (k >= count) & (k < topk)
        tl.store(cand_ptr + cand_row + k, tl.full((K_POW2,), MASKED_SCORE_C, tl.int32), mask=pad)
        tl.store(cand_pos_ptr + cand_row + k, tl.zeros((K_POW2,), tl.int32), mask=pad)
    else:
        tl.debug_barrier()  # the stores above come from every thread of the program
        keys = tl.sort(
            tl.load(buf_row + k, mask=k < count, other=MASKED_SCORE_C * 2**32), descending=True
        )
        pos = tl.where((keys >> 32) == MASKED_SCORE_C, -1, (keys & LOW32) ^ LOW32)
        tl.store(out_ptr + t * topk + k, pos, mask=k < topk)


def topk_rows(
    scores: torch.Tensor,
    topk: int,
    segments: int | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """scores int32 [T, L] (order-preserving, MASKED_SCORE = never) -> positions int64 [T, topk]:
    descending score, ties to the lower position, -1 padded (also for picked MASKED entries).
    segments: programs per row in the first pass (None: `num_segments`). lengths int64 [T]: row
    t's entries from lengths[t] on are MASKED_SCORE (the caller's promise; they are not read), so
    a row padded past its visible entries costs what its visible entries cost, and a row of at
    most topk of them is picked whole without a select pass."""
    assert scores.dtype == torch.int32 and scores.dim() == 2 and scores.is_contiguous()
    num_rows, num_cols = scores.shape
    if lengths is not None:
        assert lengths.dtype == torch.int64 and tuple(lengths.shape) == (num_rows,), lengths.shape
    out = torch.full((num_rows, topk), -1, dtype=torch.int64, device=scores.device)
    if num_rows == 0 or num_cols == 0 or topk == 0:
        return out
    # holds the `need` picks; a function of topk alone, so short contexts compile nothing new
    k_pow2 = max(16, triton.next_power_of_2(topk))
    buf = torch.empty(num_rows, k_pow2, dtype=torch.int64, device=scores.device)
    chunk, num_warps = _config()
    if segments is None:
        segments = num_segments(num_rows, num_cols, topk, scores.device)
    seg_len = triton.cdiv(num_cols, max(1, segments))
    segments = triton.cdiv(num_cols, seg_len)  # none empty
    consts = dict(
        K_POW2=k_pow2, CHUNK=chunk, RADIX_BITS=RADIX_BITS, NARROW=NARROW, num_warps=num_warps
    )
    lens, use_len = (lengths, 1) if lengths is not None else (out, 0)
    if segments == 1:
        _topk_rows_kernel[(num_rows, 1)](scores, scores, lens, out, scores, scores, buf,
                                         _scratch(scores, num_rows, num_cols), num_cols, topk,
                                         num_cols, num_cols, MODE_ROW, use_len,
                                         **consts)  # fmt: skip
        return out
    cand = torch.empty(num_rows, segments * topk, dtype=torch.int32, device=scores.device)
    cand_pos = torch.empty_like(cand)
    _topk_rows_kernel[(num_rows, segments)](
        scores,
        scores,
        lens,
        out,
        cand,
        cand_pos,
        buf,
        _scratch(scores, num_rows * segments, seg_len),
        num_cols,
        topk,
        num_cols,
        seg_len,
        MODE_SEGMENT,
        use_len,
        **consts,
    )
    width = segments * topk
    _topk_rows_kernel[(num_rows, 1)](cand, cand_pos, out, out, cand, cand_pos, buf,
                                     _scratch(scores, num_rows, width), width, topk, width, width,
                                     MODE_CANDIDATES, 0, **consts)  # fmt: skip
    return out


def _scratch(scores: torch.Tensor, programs: int, length: int) -> torch.Tensor:
    """The narrowed entries' rows [programs, 2, NARROW] int32 of programs over ranges of `length`
    entries (none needed when a range is no longer than NARROW)."""
    if length <= NARROW:
        return scores  # never read or written
    return torch.empty(programs, 2, NARROW, dtype=torch.int32, device=scores.device)


def num_segments(num_rows: int, num_cols: int, topk: int, device) -> int:
    """First-pass programs per row. A pass costs about the same for any part of a chunk, so
    segments pay when they cut the chunks one program reads: chunks(L / S) + chunks(S * k)
    below chunks(L). Only while rows are too few to fill the SMs; at most two programs per SM."""
    chunk = _config()[0]
    whole = triton.cdiv(num_cols, chunk)
    if whole <= 2 or 2 * num_rows > num_sms(device):
        return 1
    best, best_cost = 1, whole
    segments = 2
    while segments * num_rows <= 2 * num_sms(device) and segments <= num_cols // topk:
        cost = triton.cdiv(triton.cdiv(num_cols, segments), chunk) + triton.cdiv(
            segments * topk, chunk
        )
        if cost < best_cost:
            best, best_cost = segments, cost
        segments *= 2
    return best


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
