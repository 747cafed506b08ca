"""compress_norm_rope_store: the compressor's pooling, RMSNorm, RoPE and store.

A token at position p with (p + 1) % ratio == 0 completes block w = p // ratio. Its entry pools
NSLOT rows per channel with a softmax over score + ape:
  ratio 128 (c = 1): rows of positions 128w .. 128w + 127 (slot j <-> position p - 127 + j);
  ratio 4 (c = 2, overlap): 8 slots, slot j <-> position p - 7 + j; slots 0..3 (block w - 1) use
  the first half [:d] of the row, slots 4..7 (block w) the second half [d:]; positions < 0 are
  kv = 0, score = -inf.
A row comes from this batch when its position >= seq_start of the token (batch row
t - (p - position)), otherwise from the request's ring: state[state_slot, position % ring], which
holds [kv | score + ape]. Then RMSNorm(d) with weight, interleaved RoPE on the last 64 dims at
position w * ratio, and the entry is quantised into `pages` at out_loc (skipped when out_loc < 0).
Launches: when fewer tokens can complete a block than the batch holds (prefill), a first one lists
the completing tokens, so that the pooling launch starts programs only for them (a c128 entry's
128 slots split over two programs, merged by a combine launch that also stores the entries); a
last one writes every token's [kv | score + ape] row into its ring (for a split c128, the
combine launch does), so the pooling reads the rings as they were before the batch (programs
whose tokens write nothing stop after reading the slots).
"""

import torch
import triton
import triton.language as tl

from dsv4ray.cache.layout import check_pages, write_entries
from dsv4ray.cache.page_layout import PageLayout
from dsv4ray.kernels.entries import layout_args, store_entry

RING_MIN = {4: 8, 128: 128}


@triton.jit
def _online(m, den, acc, score, kv):
    """One [rows, D] tile folded into a per-channel online softmax (max, denominator, sum)."""
    m_new = tl.maximum(m, tl.max(score, axis=0))
    alpha = tl.exp(m - m_new)
    e = tl.exp(score - m_new[None, :])
    return m_new, den * alpha + tl.sum(e, axis=0), acc * alpha + tl.sum(e * kv, axis=0)


@triton.jit
def _pool_part(
    kv_ptr,
    score_ptr,
    state_kv_ptr,
    state_score_ptr,
    ape_ptr,
    t,
    p,
    seq_start,
    ring_base,
    ring,
    first,
    RATIO: tl.constexpr,
    NSLOT: tl.constexpr,
    NROWS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    CD: tl.constexpr,
    D: tl.constexpr,
):
    """Online softmax over slots first .. first + NROWS - 1 of token t's block, per channel:
    (running max, denominator, weighted sum), each [D] fp32."""
    cols = tl.arange(0, D)
    m = tl.full((D,), float("-inf"), tl.float32)
    den = tl.zeros((D,), tl.float32)
    acc = tl.zeros((D,), tl.float32)
    first_q = p - (NSLOT - 1) + first
    if (first_q >= 0) & (first_q >= seq_start):
        # every slot of the range in this batch (a prefill's usual case): a plain streaming
        # loop, no ring, which the compiler can pipeline
        for r0 in range(0, NROWS, BLOCK_R):
            j = first + r0 + tl.arange(0, BLOCK_R)
            offs = ((j // RATIO) * D)[:, None] + cols[None, :]  # ratio 4: slots 4..7 read [d:]
            batch_offs = (t - (NSLOT - 1) + j)[:, None] * CD + offs
            kv = tl.load(kv_ptr + batch_offs)
            score = tl.load(score_ptr + batch_offs) + tl.load(
                ape_ptr + ((first_q + r0 + tl.arange(0, BLOCK_R)) % RATIO)[:, None] * CD + offs
            )
            m, den, acc = _online(m, den, acc, score, kv)
    else:
        for r0 in range(0, NROWS, BLOCK_R):
            j = first + r0 + tl.arange(0, BLOCK_R)
            q = p - (NSLOT - 1) + j  # [BLOCK_R] positions of the slots
            offs = ((j // RATIO) * D)[:, None] + cols[None, :]
            from_batch = ((q >= 0) & (q >= seq_start))[:, None]
            from_ring = ((q >= 0) & (q < seq_start))[:, None]
            batch_offs = (t - (p - q))[:, None] * CD + offs
            ring_offs = (ring_base + q % ring)[:, None] * CD + offs
            kv = tl.where(
                from_batch,
                tl.load(kv_ptr + batch_offs, mask=from_batch, other=0.0),
                tl.load(state_kv_ptr + ring_offs, mask=from_ring, other=0.0),
            )
            score = tl.load(score_ptr + batch_offs, mask=from_batch, other=0.0) + tl.load(
                ape_ptr + (q % RATIO)[:, None] * CD + offs, mask=from_batch, other=0.0
            )
            score = tl.where(
                from_batch,
                score,
                tl.load(state_score_ptr + ring_offs, mask=from_ring, other=float("-inf")),
            )
            m, den, acc = _online(m, den, acc, score, kv)
    return m, den, acc


@triton.jit
def _norm_rope(x, norm_w_ptr, cos_ptr, sin_ptr, rope_pos, eps, D: tl.constexpr):
    """RMSNorm(D) with weight, then interleaved RoPE of pairs (2i, 2i+1) in the last 64 dims."""
    cols = tl.arange(0, D)
    x = x * tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps) * tl.load(norm_w_ptr + cols)
    x_even, x_odd = tl.split(tl.reshape(x, (D // 2, 2)))
    pair = tl.arange(0, D // 2) - (D // 2 - 32)  # index into the 32 rope frequencies; < 0: no rope
    is_rope = pair >= 0
    cos = tl.load(cos_ptr + rope_pos * 32 + pair, mask=is_rope, other=1.0)
    sin = tl.load(sin_ptr + rope_pos * 32 + pair, mask=is_rope, other=0.0)
    y_even = x_even * cos - x_odd * sin
    y_odd = x_odd * cos + x_even * sin
    return tl.reshape(tl.join(y_even, y_odd), (D,))


@triton.jit(do_not_specialize=["num_tokens"])
def _completions_kernel(
    pos_ptr, out_loc_ptr, list_ptr, count_ptr, num_tokens, RATIO: tl.constexpr, BLOCK: tl.constexpr
):
    # program = BLOCK tokens: appends the block-completing ones with out_loc >= 0 to list (in any
    # order across programs: each entry is independent) and adds them to count
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = t < num_tokens
    p = tl.load(pos_ptr + t, mask=ok, other=0)
    done = ok & ((p + 1) % RATIO == 0) & (tl.load(out_loc_ptr + t, mask=ok, other=-1) >= 0)
    base = tl.atomic_add(count_ptr, tl.sum(done.to(tl.int32), axis=0))
    tl.store(list_ptr + base + tl.cumsum(done.to(tl.int32), axis=0) - 1, t, mask=done)


@triton.jit(do_not_specialize=["num_tokens"])
def _compress_kernel(
    kv_ptr,
    score_ptr,
    pos_ptr,
    state_slot_ptr,
    seq_start_ptr,
    state_kv_ptr,
    state_score_ptr,
    ape_ptr,
    norm_w_ptr,
    cos_ptr,
    sin_ptr,
    out_loc_ptr,
    pages_ptr,
    list_ptr,
    count_ptr,
    eps,
    ring,
    num_tokens,
    COMPACT: tl.constexpr,
    RATIO: tl.constexpr,
    NSLOT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    CD: tl.constexpr,
    FMT: tl.constexpr,
    D: tl.constexpr,
    EPP: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    VALUE_BYTES: tl.constexpr,
    SCALE_OFF: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    INDEXER: tl.constexpr,
):
    # programs walk the tokens: COMPACT: list[i] for i < count (strided over the grid), else token
    # i itself, skipped unless it completes a block with out_loc >= 0
    if COMPACT:
        num = tl.load(count_ptr)
    else:
        num = num_tokens
    for i in range(tl.program_id(0), num, tl.num_programs(0)):
        if COMPACT:
            t = tl.load(list_ptr + i).to(tl.int64)
        else:
            t = tl.cast(i, tl.int64)
        p = tl.load(pos_ptr + t)
        out_loc = tl.load(out_loc_ptr + t)
        if ((p + 1) % RATIO == 0) & (out_loc >= 0):
            _, den, acc = _pool_part(
                kv_ptr, score_ptr, state_kv_ptr, state_score_ptr, ape_ptr, t, p,
                tl.load(seq_start_ptr + t), tl.load(state_slot_ptr + t) * ring, ring, 0, RATIO,
                NSLOT, NSLOT, BLOCK_R, CD, D,
            )  # fmt: skip
            x = _norm_rope(acc / den, norm_w_ptr, cos_ptr, sin_ptr, p + 1 - RATIO, eps, D)
            store_entry(
                pages_ptr,
                out_loc,
                x,
                FMT,
                D,
                EPP,
                PAGE_BYTES,
                VALUE_BYTES,
                SCALE_OFF,
                SCALE_BYTES,
                INDEXER,
            )


@triton.jit
def _partial_kernel(
    kv_ptr,
    score_ptr,
    pos_ptr,
    state_slot_ptr,
    seq_start_ptr,
    state_kv_ptr,
    state_score_ptr,
    ape_ptr,
    list_ptr,
    count_ptr,
    part_ptr,
    ring,
    RATIO: tl.constexpr,
    NSLOT: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    CD: tl.constexpr,
    D: tl.constexpr,
):
    # programs walk (entry, part) pairs: part s of list[e] pools slots s * NSLOT / SPLIT onwards
    # into part[e, s] = [max | denominator | weighted sum], [3, D] fp32
    cols = tl.arange(0, D)
    for i in range(tl.program_id(0), tl.load(count_ptr) * SPLIT, tl.num_programs(0)):
        e = i // SPLIT
        t = tl.load(list_ptr + e).to(tl.int64)
        m, den, acc = _pool_part(
            kv_ptr, score_ptr, state_kv_ptr, state_score_ptr, ape_ptr, t, tl.load(pos_ptr + t),
            tl.load(seq_start_ptr + t), tl.load(state_slot_ptr + t) * ring, ring,
            (i % SPLIT) * (NSLOT // SPLIT), RATIO, NSLOT, NSLOT // SPLIT, BLOCK_R, CD, D,
        )  # fmt: skip
        base = part_ptr + tl.cast(i, tl.int64) * 3 * D + cols
        tl.store(base, m)
        tl.store(base + D, den)
        tl.store(base + 2 * D, acc)


@triton.jit(do_not_specialize=["num_tokens"])
def _combine_kernel(
    kv_ptr,
    score_ptr,
    pos_ptr,
    state_slot_ptr,
    state_kv_ptr,
    state_score_ptr,
    ape_ptr,
    norm_w_ptr,
    cos_ptr,
    sin_ptr,
    out_loc_ptr,
    pages_ptr,
    list_ptr,
    count_ptr,
    part_ptr,
    eps,
    num_tokens,
    ring,
    RATIO: tl.constexpr,
    SPLIT: tl.constexpr,
    CD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    FMT: tl.constexpr,
    D: tl.constexpr,
    EPP: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    VALUE_BYTES: tl.constexpr,
    SCALE_OFF: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    INDEXER: tl.constexpr,
):
    # programs walk the listed entries: each merges its SPLIT parts (parts whose slots were all
    # empty carry max -inf and weigh nothing), then RMSNorm, RoPE and the store; then the token
    # blocks' ring rows (the pooling, a launch before, has read the rings)
    offs = tl.arange(0, SPLIT)[:, None] * 3 * D + tl.arange(0, D)[None, :]  # [SPLIT, D]
    for e in range(tl.program_id(0), tl.load(count_ptr), tl.num_programs(0)):
        t = tl.load(list_ptr + e).to(tl.int64)
        base = part_ptr + tl.cast(e, tl.int64) * SPLIT * 3 * D + offs
        m_part = tl.load(base)
        m = tl.max(m_part, axis=0)
        w = tl.where(m_part == float("-inf"), 0.0, tl.exp(m_part - m[None, :]))
        den = tl.sum(tl.load(base + D) * w, axis=0)
        acc = tl.sum(tl.load(base + 2 * D) * w, axis=0)
        p = tl.load(pos_ptr + t)
        x = _norm_rope(acc / den, norm_w_ptr, cos_ptr, sin_ptr, p + 1 - RATIO, eps, D)
        store_entry(
            pages_ptr,
            tl.load(out_loc_ptr + t),
            x,
            FMT,
            D,
            EPP,
            PAGE_BYTES,
            VALUE_BYTES,
            SCALE_OFF,
            SCALE_BYTES,
            INDEXER,
        )
    for block in range(tl.program_id(0), tl.cdiv(num_tokens, BLOCK_T), tl.num_programs(0)):
        _write_ring_block(
            kv_ptr, score_ptr, pos_ptr, state_slot_ptr, state_kv_ptr, state_score_ptr, ape_ptr,
            block, num_tokens, ring, RATIO, CD, BLOCK_T,
        )  # fmt: skip


@triton.jit
def _write_ring_block(
    kv_ptr,
    score_ptr,
    pos_ptr,
    state_slot_ptr,
    state_kv_ptr,
    state_score_ptr,
    ape_ptr,
    block,
    num_tokens,
    ring,
    RATIO: tl.constexpr,
    CD: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Tokens block * BLOCK_T onwards: token t writes its ring row unless token t + ring (same
    request, position p + ring) does. In a prefill most blocks hold no writer: they stop after
    the slot loads instead of issuing masked row loads."""
    t = tl.cast(block, tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    state_slot = tl.load(state_slot_ptr + t, mask=t < num_tokens, other=-1)
    later = t + ring
    later_slot = tl.load(state_slot_ptr + later, mask=later < num_tokens, other=-1)
    writes = (t < num_tokens) & (later_slot != state_slot)
    if tl.max(writes.to(tl.int32), axis=0) > 0:
        write = writes[:, None]
        p = tl.load(pos_ptr + t, mask=t < num_tokens, other=0)
        cols = tl.arange(0, CD)[None, :]
        row = ((state_slot * ring + p % ring) * CD)[:, None]
        score = tl.load(score_ptr + t[:, None] * CD + cols, mask=write, other=0.0) + tl.load(
            ape_ptr + (p % RATIO)[:, None] * CD + cols, mask=write, other=0.0
        )
        kv = tl.load(kv_ptr + t[:, None] * CD + cols, mask=write)
        tl.store(state_kv_ptr + row + cols, kv, mask=write)
        tl.store(state_score_ptr + row + cols, score, mask=write)


@triton.jit(do_not_specialize=["num_tokens"])
def _state_write_kernel(
    kv_ptr,
    score_ptr,
    pos_ptr,
    state_slot_ptr,
    state_kv_ptr,
    state_score_ptr,
    ape_ptr,
    num_tokens,
    ring,
    RATIO: tl.constexpr,
    CD: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # program = BLOCK_T tokens' ring rows
    _write_ring_block(
        kv_ptr, score_ptr, pos_ptr, state_slot_ptr, state_kv_ptr, state_score_ptr, ape_ptr,
        tl.program_id(0), num_tokens, ring, RATIO, CD, BLOCK_T,
    )  # fmt: skip


def _config(ratio: int, dim: int) -> tuple:
    """(BLOCK_R rows a step, num_warps): four warps measured fastest on an H200 at prefill and
    decode (c4 prefill's pooling 77 us against 103 us with eight)."""
    return 8, 4


def _ring_block(ratio: int, cd: int) -> int:
    """Tokens per program of the ring writes ([BLOCK_T, cd] fp32 tiles): a c128 prefill's are
    written by its combine launch, where four tokens a program measured fastest on an H200
    (16 x 1,024 tokens: 36.6-38.1 us against 38.3-39.7 us with eight, over five builds)."""
    return 4 if ratio == 128 else max(1, 4096 // cd)


def _split(ratio: int) -> int:
    """Programs that share one listed entry's slots (a power of two dividing its slot count):
    a c128 prefill lists one entry per 128 tokens, few programs for the device's memory
    bandwidth (an H200, 16 x 1024 tokens: 46 us in one program an entry, 38.5 us in two, 39.5 us
    in four, the ring writes in the combine launch); c4's 8 slots stay in one program."""
    return 2 if ratio == 128 else 1


def _check_args(
    kv,
    score,
    positions,
    state_slots,
    seq_start,
    state_kv,
    state_score,
    ape,
    norm_weight,
    cos,
    sin,
    out_loc,
    pages,
    layout,
    ratio,
    rotate,
):
    if ratio not in RING_MIN:
        raise ValueError(f"ratio must be 4 or 128, got {ratio}")
    if layout.kind not in (("c4", "indexer") if ratio == 4 else ("c128",)):
        raise ValueError(f"a ratio-{ratio} compressor cannot store into the {layout.kind} pool")
    is_rotated = layout.kind == "indexer" and layout.dtype == "fp8"
    if rotate is not None and rotate != is_rotated:
        raise ValueError(
            f"rotate={rotate} but the {layout.kind}/{layout.dtype} format is "
            f"{'always' if is_rotated else 'never'} Hadamard-rotated"
        )
    check_pages(pages, layout)
    num_tokens, cd = kv.shape[0], (2 if ratio == 4 else 1) * layout.dim
    for name, t in (
        ("kv", kv),
        ("score", score),
        ("ape", ape),
        ("state_kv", state_kv),
        ("state_score", state_score),
        ("norm_weight", norm_weight),
        ("cos", cos),
        ("sin", sin),
    ):
        assert t.dtype == torch.float32 and t.is_contiguous(), f"{name} must be contiguous fp32"
    assert kv.shape == score.shape == (num_tokens, cd), (kv.shape, score.shape, cd)
    assert ape.shape == (ratio, cd), ape.shape
    assert norm_weight.shape == (layout.dim,), norm_weight.shape
    assert state_kv.shape == state_score.shape and state_kv.shape[2] == cd, state_kv.shape
    ring = state_kv.shape[1]
    assert ring >= RING_MIN[ratio], f"ring of {ring} rows < {RING_MIN[ratio]}"
    assert cos.shape == sin.shape and cos.shape[1] == 32, (cos.shape, sin.shape)
    for name, t in (
        ("positions", positions),
        ("state_slots", state_slots),
        ("seq_start", seq_start),
        ("out_loc", out_loc),
    ):
        assert t.dtype == torch.int64 and t.shape == (num_tokens,) and t.is_contiguous(), (
            f"{name} must be contiguous int64 [T]"
        )


def compress_norm_rope_store(
    kv,
    score,
    positions,
    state_slots,
    seq_start,
    state_kv,
    state_score,
    ape,
    norm_weight,
    eps,
    cos,
    sin,
    out_loc,
    pages,
    layout: PageLayout,
    ratio: int,
    rotate: bool | None = None,
) -> None:
    """Pool, normalise, rotate and store compressed entries; then add the tokens' rows to the rings.

    kv, score [T, c*d] fp32 (c = 2 for ratio 4, 1 for ratio 128; d = layout.dim): the wkv / wgate
    outputs, ape not yet added. positions, state_slots (the request's ring), seq_start (position of
    the request's first token in this batch), out_loc (physical slot in `pages` or -1) int64 [T]; a
    request's tokens are contiguous and consecutive. state_kv, state_score [S, ring, c*d] fp32 (ring
    >= 8 for ratio 4, >= 128 for ratio 128; empty rows kv = 0, score = -inf). ape [ratio, c*d],
    norm_weight [d], cos, sin [P, 32] fp32 (row = position). pages: uint8 [num_pages,
    layout.page_bytes] in layout's format; `rotate` (optional) must match the format: only fp8
    indexer entries are Hadamard-rotated before quantisation.
    """
    args = (
        kv,
        score,
        positions,
        state_slots,
        seq_start,
        state_kv,
        state_score,
        ape,
        norm_weight,
        cos,
        sin,
        out_loc,
        pages,
        layout,
        ratio,
        rotate,
    )
    _check_args(*args)
    num_tokens, ring = kv.shape[0], state_kv.shape[1]
    if num_tokens == 0:
        return
    nslot = 2 * ratio if ratio == 4 else ratio
    block_r, num_warps = _config(ratio, layout.dim)
    # at most T // ratio + (requests in the batch <= ring rows) tokens complete a block: when that
    # bound is below T, list them first so that no program is launched for the others (c128
    # prefill, 16 x 1024 tokens on an H200: 115 us -> 77 us)
    bound = num_tokens // ratio + state_kv.shape[0]
    compact = bound < num_tokens
    entries = count = positions  # placeholders without the list
    if compact:
        entries = torch.empty(num_tokens, dtype=torch.int64, device=kv.device)
        count = torch.zeros(1, dtype=torch.int32, device=kv.device)
        _completions_kernel[(triton.cdiv(num_tokens, 1024),)](
            positions, out_loc, entries, count, num_tokens, RATIO=ratio, BLOCK=1024, num_warps=4
        )
    split = _split(ratio) if compact else 1
    if split > 1:
        _split_pool(args, eps, entries, count, bound, split, block_r, num_warps)
    else:
        _compress_kernel[(min(bound, num_tokens),)](
            kv,
            score,
            positions,
            state_slots,
            seq_start,
            state_kv,
            state_score,
            ape,
            norm_weight,
            cos,
            sin,
            out_loc,
            pages,
            entries,
            count,
            eps,
            ring,
            num_tokens,
            COMPACT=compact,
            RATIO=ratio,
            NSLOT=nslot,
            BLOCK_R=block_r,
            CD=kv.shape[1],
            num_warps=num_warps,
            **layout_args(layout),
        )
    if split > 1:  # the combine launch wrote the rings
        return
    block_t = _ring_block(ratio, kv.shape[1])
    _state_write_kernel[(triton.cdiv(num_tokens, block_t),)](
        kv,
        score,
        positions,
        state_slots,
        state_kv,
        state_score,
        ape,
        num_tokens,
        ring,
        RATIO=ratio,
        CD=kv.shape[1],
        BLOCK_T=block_t,
        num_warps=4,
    )


def _split_pool(args: tuple, eps: float, entries, count, bound: int, split: int, block_r: int,
                num_warps: int) -> None:  # fmt: skip
    """The listed entries pooled by ``split`` programs each, then merged and stored, and every
    token's ring row written, in the merging launch. args: compress_norm_rope_store's checked
    arguments (eps apart)."""
    (kv, score, positions, state_slots, seq_start, state_kv, state_score, ape, norm_weight,
     cos, sin, out_loc, pages, layout, ratio, _) = args  # fmt: skip
    nslot, d = (2 * ratio if ratio == 4 else ratio), layout.dim
    block_r = min(block_r, nslot // split)  # a program's rows never reach the next part's
    parts = torch.empty(bound * split, 3, d, dtype=torch.float32, device=kv.device)
    _partial_kernel[(bound * split,)](
        kv,
        score,
        positions,
        state_slots,
        seq_start,
        state_kv,
        state_score,
        ape,
        entries,
        count,
        parts,
        state_kv.shape[1],
        RATIO=ratio,
        NSLOT=nslot,
        SPLIT=split,
        BLOCK_R=block_r,
        CD=kv.shape[1],
        D=d,
        num_warps=num_warps,
    )
    num_tokens, block_t = kv.shape[0], _ring_block(ratio, kv.shape[1])
    _combine_kernel[(max(bound, triton.cdiv(num_tokens, block_t)),)](
        kv,
        score,
        positions,
        state_slots,
        state_kv,
        state_score,
        ape,
        norm_weight,
        cos,
        sin,
        out_loc,
        pages,
        entries,
        count,
        parts,
        eps,
        num_tokens,
        state_kv.shape[1],
        RATIO=ratio,
        SPLIT=split,
        CD=kv.shape[1],
        BLOCK_T=block_t,
        num_warps=num_warps,
        **layout_args(layout),
    )


def reset_state(state_kv: torch.Tensor, state_score: torch.Tensor, slots: torch.Tensor) -> None:
    """Empty the rings of `slots` (int64 [N]): kv = 0, score = -inf (both backends)."""
    state_kv.index_fill_(0, slots, 0.0)
    state_score.index_fill_(0, slots, float("-inf"))


def _rms_norm_rope(x, norm_weight, eps, cos, sin):
    """x [C, d] -> RMSNorm with weight, interleaved RoPE of the last 64 dims (cos, sin [C, 32])."""
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_weight
    pairs = x[:, -64:].reshape(-1, 32, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), -1).reshape(-1, 64)
    return torch.cat((x[:, :-64], rotated), 1)


def compress_entries_ref(
    kv,
    score,
    positions,
    state_slots,
    seq_start,
    state_kv,
    state_score,
    ape,
    norm_weight,
    eps,
    cos,
    sin,
    ratio,
):
    """The entries this batch completes: (token indices [C] int64, fp32 entries [C, d])."""
    d = kv.shape[1] // (2 if ratio == 4 else 1)
    nslot, ring = (2 * ratio if ratio == 4 else ratio), state_kv.shape[1]
    done = ((positions + 1) % ratio == 0).nonzero()[:, 0]
    if done.numel() == 0:  # most decode steps complete no entry
        return done, kv.new_empty(0, d, dtype=torch.float32)
    p = positions[done][:, None]
    j = torch.arange(nslot, device=kv.device)
    q = p - (nslot - 1) + j  # [C, nslot]
    cols = ((j // ratio) * d)[:, None] + torch.arange(d, device=kv.device)  # [nslot, d]
    in_batch = (q >= seq_start[done][:, None])[..., None]
    valid = (q >= 0)[..., None]
    batch_rows = (done[:, None] - (p - q)).clamp(0, max(kv.shape[0] - 1, 0))[..., None]
    ring_rows = state_slots[done][:, None, None], (q % ring)[..., None]
    kv_rows = torch.where(in_batch, kv[batch_rows, cols], state_kv[ring_rows + (cols,)])
    score_rows = torch.where(
        in_batch,
        score[batch_rows, cols] + ape[(q % ratio)[..., None], cols],
        state_score[ring_rows + (cols,)],
    )
    kv_rows = torch.where(valid, kv_rows, 0.0)
    weights = torch.softmax(torch.where(valid, score_rows, float("-inf")), dim=1)
    pooled = (weights * kv_rows).sum(1)
    rope_pos = p[:, 0] + 1 - ratio
    return done, _rms_norm_rope(pooled, norm_weight, eps, cos[rope_pos], sin[rope_pos])


def compress_norm_rope_store_ref(
    kv,
    score,
    positions,
    state_slots,
    seq_start,
    state_kv,
    state_score,
    ape,
    norm_weight,
    eps,
    cos,
    sin,
    out_loc,
    pages,
    layout: PageLayout,
    ratio: int,
    rotate: bool | None = None,
) -> None:
    """Torch reference of compress_norm_rope_store (same arguments, same effects)."""
    args = (
        kv,
        score,
        positions,
        state_slots,
        seq_start,
        state_kv,
        state_score,
        ape,
        norm_weight,
        cos,
        sin,
        out_loc,
        pages,
        layout,
        ratio,
        rotate,
    )
    _check_args(*args)
    done, entries = compress_entries_ref(
        kv,
        score,
        positions,
        state_slots,
        seq_start,
        state_kv,
        state_score,
        ape,
        norm_weight,
        eps,
        cos,
        sin,
        ratio,
    )
    if done.numel():
        write_entries(pages, out_loc[done], entries, layout)
    num_tokens, ring = kv.shape[0], state_kv.shape[1]
    later = torch.arange(ring, num_tokens + ring, device=kv.device)
    later_slot = torch.cat((state_slots, torch.full((ring,), -1, device=kv.device)))[later]
    keep = later_slot != state_slots
    slot, pos = state_slots[keep], positions[keep]
    state_kv[slot, pos % ring] = kv[keep]
    state_score[slot, pos % ring] = score[keep] + ape[pos % ratio]
