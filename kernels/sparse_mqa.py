"""sparse_mqa: attention of each query token over its own list of paged KV entries.

One softmax per (token, head) over the union of the token's window entries and compressed entries;
the per-head sink joins only the denominator:
    o = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sink - m)),  s_j = (q . k_j) * scale (fp32),
with k_j = v_j = the dequantised 512-dim entry. Slot -1 means no key; a token with no keys gets o =
0. Decode and prefill both use it (prefill passes per-token slot lists). The rope de-rotation of o
and the output projection happen outside.

GPU plan (flash decoding): one program per (token, key split, block of up to 64 heads). Every head
of the block shares each dequantised [BLOCK_N, 512] KV tile, so an entry is dequantised once per
head block, and both products run on tensor cores (bf16 operands, fp32 accumulation); fp32 pages
take exact fp32 products instead, broadcast over just the heads when there are at most
FMA_MAX_HEADS of them (a tensor-core tile would be mostly empty rows). The token's
key list (window then compressed) is cut into `num_splits` ranges when there are too few tokens to
fill the GPU; each split writes an unnormalised partial (m, den, acc) and `_combine_kernel` merges
them.
"""

import torch
import triton
import triton.language as tl

from dsv4ray.cache.layout import check_pages, read_entries
from dsv4ray.cache.page_layout import PageLayout
from dsv4ray.kernels.bits import interpreting, mma, mma_operand, num_sms, use_bf16_mma
from dsv4ray.kernels.entries import kv_scale_words, layout_args, load_kv_group

REF_CHUNK = 64  # tokens per step of the torch reference
# the reference scores a chunk against its distinct entries when they number at most this many
# times one token's list (shared windows); decode rows of different requests gather their own
SHARED_KEYS_RATIO = 4
LOG2E = 1.4426950408889634
LOG2E_C = tl.constexpr(LOG2E)
MAX_SPLITS = 8  # ...for key lists up to MAX_SPLITS * LONG_KEYS_PER_SPLIT keys
# past that a split holds at most this many keys while SMs are idle: a 1M-token context's C128
# layer reads 8,192 entries a token, which 8 splits left to 8 SMs at batch 1
LONG_KEYS_PER_SPLIT = 256
MIN_KEYS_PER_SPLIT = 128  # shorter splits spend more on partials than they save...
# ...unless under a quarter of the SMs would have a program: then splits of 32 keys pay (H200,
# stdlib-tiny decode at 145 keys, fp32 pages: batch 1 1.33x, batch 16 1.20x tok/s; at batch 64,
# where 2 splits of 72 keys would run, they were no faster than one)
LOW_FILL_KEYS_PER_SPLIT = 32


FMA_MAX_HEADS = 8  # exact fp32 with fewer heads: CUDA-core products over the real heads only


def _config(num_heads: int, bf16_mma: bool) -> tuple:
    """(BLOCK_H, BLOCK_N, num_warps, FMA). bf16 operands: the [64 heads, 512] fp32 accumulator
    over two warpgroups (wgmma), 64 keys a step (H200, bench/kernel_sweep.py: 76 us against 88 us
    with 32 at 64 tokens; the per-step softmax rescale and operand setup are paid per step); fp32
    pages (exact fp32 dots, no tensor cores): a dot's 16-row tiles that do not spill, or, for at
    most FMA_MAX_HEADS heads, broadcast products over a block of just the heads (a 16-row tile
    would be mostly empty rows); 64 keys a tile under the interpreter, which pays per op, not
    per key."""
    keys = 64 if interpreting() else 16
    if not bf16_mma:
        if num_heads <= FMA_MAX_HEADS:
            return max(2, triton.next_power_of_2(num_heads)), keys, 4, True
        return 16, keys, 4, False
    return min(64, max(16, triton.next_power_of_2(num_heads))), 64, 8, False


def num_splits_for(num_tokens: int, num_head_blocks: int, num_keys: int, device) -> int:
    """Key splits per token: enough programs for every SM, each split >= MIN_KEYS_PER_SPLIT keys
    (LOW_FILL_KEYS_PER_SPLIT when fewer programs than a quarter of the SMs would run), at most
    MAX_SPLITS unless that leaves splits of over LONG_KEYS_PER_SPLIT keys."""
    programs = max(1, num_tokens * num_head_blocks)
    want = max(1, num_sms(device) // programs)
    min_keys = LOW_FILL_KEYS_PER_SPLIT if want >= 4 else MIN_KEYS_PER_SPLIT
    cap = max(MAX_SPLITS, num_keys // LONG_KEYS_PER_SPLIT)
    return max(1, min(want, cap, num_keys // min_keys))


@triton.jit
def _kv_groups(
    pages_ptr,
    slots,
    BF16_MMA: tl.constexpr,
    FMT: tl.constexpr,
    EPP: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    VALUE_BYTES: tl.constexpr,
    SCALE_OFF: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
):
    """The dequantised entries at slots [N] as eight 64-dim groups [N, 64]: each group is one
    plain load with one scale per entry, so no tile wider than 64 columns is dequantised at once
    (the kernel is at its register limit: docs/benchmarks.md, kernels against the copy
    ceiling)."""
    value_off, lo, hi = kv_scale_words(
        pages_ptr, slots, FMT, EPP, PAGE_BYTES, VALUE_BYTES, SCALE_OFF, SCALE_BYTES
    )
    ok = slots >= 0
    k0 = load_kv_group(pages_ptr, value_off, lo, hi, ok, 0, BF16_MMA, FMT)
    k1 = load_kv_group(pages_ptr, value_off, lo, hi, ok, 1, BF16_MMA, FMT)
    k2 = load_kv_group(pages_ptr, value_off, lo, hi, ok, 2, BF16_MMA, FMT)
    k3 = load_kv_group(pages_ptr, value_off, lo, hi, ok, 3, BF16_MMA, FMT)
    k4 = load_kv_group(pages_ptr, value_off, lo, hi, ok, 4, BF16_MMA, FMT)
    k5 = load_kv_group(pages_ptr, value_off, lo, hi, ok, 5, BF16_MMA, FMT)
    k6 = load_kv_group(pages_ptr, value_off, lo, hi, ok, 6, BF16_MMA, FMT)
    k7 = load_kv_group(pages_ptr, value_off, lo, hi, ok, 7, BF16_MMA, FMT)
    return k0, k1, k2, k3, k4, k5, k6, k7


@triton.jit
def _dot(a, b, BF16_MMA: tl.constexpr, FMA: tl.constexpr):
    """a [M, K] @ b [K, N] in fp32: `mma`, or FMA: broadcast products summed over K."""
    if FMA:
        return tl.sum(a[:, :, None] * b[None, :, :], axis=1)
    return mma(a, b, BF16_MMA)


@triton.jit
def _scores(q, k, BF16_MMA: tl.constexpr, FMA: tl.constexpr):
    """q [BLOCK_H, 512] . k [BLOCK_N, 512] -> [BLOCK_H, BLOCK_N], each an 8-tuple of 64-dim
    groups."""
    s = _dot(q[0], tl.trans(k[0]), BF16_MMA, FMA)
    for g in tl.static_range(1, 8):
        s += _dot(q[g], tl.trans(k[g]), BF16_MMA, FMA)
    return s


@triton.jit
def _rescale_add(acc, alpha, p, k, BF16_MMA: tl.constexpr, FMA: tl.constexpr):
    """acc [BLOCK_H, 64] * alpha [BLOCK_H] + p [BLOCK_H, BLOCK_N] @ k [BLOCK_N, 64]."""
    return acc * alpha[:, None] + _dot(p, k, BF16_MMA, FMA)


@triton.jit
def _attend(
    q,
    m,
    den,
    acc,
    pages_ptr,
    slots_ptr,
    lo,
    hi,
    qk_scale,
    BLOCK_N: tl.constexpr,
    BF16_MMA: tl.constexpr,
    FMA: tl.constexpr,
    FMT: tl.constexpr,
    EPP: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    VALUE_BYTES: tl.constexpr,
    SCALE_OFF: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
):
    """Online-softmax update (log2 units) of m, den [BLOCK_H] and the accumulator acc (8 groups
    [BLOCK_H, 64]) with the keys slots_ptr[lo:hi] of one pool. One pipeline stage: prefetching
    the next keys' gathered rows costs registers this loop does not have."""
    for n0 in tl.range(lo, hi, BLOCK_N, num_stages=1):
        n = n0 + tl.arange(0, BLOCK_N)
        slots = tl.load(slots_ptr + n, mask=n < hi, other=-1)
        k = _kv_groups(
            pages_ptr, slots, BF16_MMA, FMT, EPP, PAGE_BYTES, VALUE_BYTES, SCALE_OFF, SCALE_BYTES
        )
        s = _scores(q, k, BF16_MMA, FMA)
        s = tl.where((slots >= 0)[None, :], s * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        den = den * alpha + tl.sum(p, axis=1)
        acc = (
            _rescale_add(acc[0], alpha, p, k[0], BF16_MMA, FMA),
            _rescale_add(acc[1], alpha, p, k[1], BF16_MMA, FMA),
            _rescale_add(acc[2], alpha, p, k[2], BF16_MMA, FMA),
            _rescale_add(acc[3], alpha, p, k[3], BF16_MMA, FMA),
            _rescale_add(acc[4], alpha, p, k[4], BF16_MMA, FMA),
            _rescale_add(acc[5], alpha, p, k[5], BF16_MMA, FMA),
            _rescale_add(acc[6], alpha, p, k[6], BF16_MMA, FMA),
            _rescale_add(acc[7], alpha, p, k[7], BF16_MMA, FMA),
        )
        m = m_new
    return m, den, acc


@triton.jit
def _load_q(q_ptr, row, h, h_mask, G: tl.constexpr, BF16_MMA: tl.constexpr):
    # [BLOCK_H, 64] dims of group G of q, in the operand dtype of `mma`
    q = tl.load(
        q_ptr + row + h[:, None] + G * 64 + tl.arange(0, 64)[None, :], mask=h_mask, other=0.0
    )
    return mma_operand(q, BF16_MMA)


@triton.jit
def _store_rows(ptr, rows, mask, x, C0: tl.constexpr, W: tl.constexpr):
    # x [BLOCK_H, W] at columns [C0, C0 + W) of the rows starting at ptr + rows [BLOCK_H]
    tl.store(ptr + rows[:, None] + C0 + tl.arange(0, W)[None, :], x, mask=mask)


@triton.jit(do_not_specialize=["num_w", "num_c", "split_len"])
def _sparse_mqa_kernel(
    q_ptr,
    o_ptr,
    part_ptr,
    part_stats_ptr,
    sink_ptr,
    w_pages_ptr,
    w_slots_ptr,
    c_pages_ptr,
    c_slots_ptr,
    num_heads,
    num_w,
    num_c,
    split_len,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_COMP: tl.constexpr,
    SPLIT: tl.constexpr,
    BF16_MMA: tl.constexpr,
    FMA: tl.constexpr,
    D: tl.constexpr,
    W_FMT: tl.constexpr,
    W_EPP: tl.constexpr,
    W_PAGE_BYTES: tl.constexpr,
    W_VALUE_BYTES: tl.constexpr,
    W_SCALE_OFF: tl.constexpr,
    W_SCALE_BYTES: tl.constexpr,
    C_FMT: tl.constexpr,
    C_EPP: tl.constexpr,
    C_PAGE_BYTES: tl.constexpr,
    C_VALUE_BYTES: tl.constexpr,
    C_SCALE_OFF: tl.constexpr,
    C_SCALE_BYTES: tl.constexpr,
):
    # program (token t, split k, head block): keys [k * split_len, (k + 1) * split_len) of the
    # token's list (window keys first); the running max starts at the sink, so it is finite
    t = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < num_heads
    q_row, q_mask = t * stride_qt, h_ok[:, None]
    qh = h * stride_qh
    q = (
        _load_q(q_ptr, q_row, qh, q_mask, 0, BF16_MMA),
        _load_q(q_ptr, q_row, qh, q_mask, 1, BF16_MMA),
        _load_q(q_ptr, q_row, qh, q_mask, 2, BF16_MMA),
        _load_q(q_ptr, q_row, qh, q_mask, 3, BF16_MMA),
        _load_q(q_ptr, q_row, qh, q_mask, 4, BF16_MMA),
        _load_q(q_ptr, q_row, qh, q_mask, 5, BF16_MMA),
        _load_q(q_ptr, q_row, qh, q_mask, 6, BF16_MMA),
        _load_q(q_ptr, q_row, qh, q_mask, 7, BF16_MMA),
    )
    sink = tl.load(sink_ptr + h, mask=h_ok, other=0.0) * LOG2E_C
    m, den = sink, tl.zeros((BLOCK_H,), tl.float32)
    zero = tl.zeros((BLOCK_H, 64), tl.float32)
    acc = (zero, zero, zero, zero, zero, zero, zero, zero)
    lo = split * split_len
    hi = lo + split_len
    m, den, acc = _attend(
        q,
        m,
        den,
        acc,
        w_pages_ptr,
        w_slots_ptr + t * num_w,
        lo,
        tl.minimum(hi, num_w),
        qk_scale,
        BLOCK_N,
        BF16_MMA,
        FMA,
        W_FMT,
        W_EPP,
        W_PAGE_BYTES,
        W_VALUE_BYTES,
        W_SCALE_OFF,
        W_SCALE_BYTES,
    )
    if HAS_COMP:
        m, den, acc = _attend(
            q,
            m,
            den,
            acc,
            c_pages_ptr,
            c_slots_ptr + t * num_c,
            tl.maximum(lo - num_w, 0),
            tl.minimum(hi - num_w, num_c),
            qk_scale,
            BLOCK_N,
            BF16_MMA,
            FMA,
            C_FMT,
            C_EPP,
            C_PAGE_BYTES,
            C_VALUE_BYTES,
            C_SCALE_OFF,
            C_SCALE_BYTES,
        )
    if SPLIT:  # partial [T, splits, H, D] and stats [T, splits, 2, H]: (m, den), log2 units
        row = (t * tl.num_programs(1) + split) * num_heads
        out_ptr, rows, scale = part_ptr, (row + h) * D, tl.full((BLOCK_H,), 1.0, tl.float32)
        tl.store(part_stats_ptr + 2 * row + h, m, mask=h_ok)
        tl.store(part_stats_ptr + 2 * row + num_heads + h, den, mask=h_ok)
    else:
        out_ptr, rows, scale = o_ptr, t * stride_ot + h * stride_oh, 1.0 / (den + tl.exp2(sink - m))
    for g in tl.static_range(8):
        _store_rows(out_ptr, rows, q_mask, acc[g] * scale[:, None], g * 64, 64)


@triton.jit(do_not_specialize=["num_splits"])
def _combine_kernel(
    o_ptr,
    part_ptr,
    part_stats_ptr,
    sink_ptr,
    num_heads,
    num_splits,
    stride_ot,
    stride_oh,
    BLOCK_H: tl.constexpr,
    D: tl.constexpr,
):
    # program (token t, head block): o = sum_k 2^(m_k - M) acc_k / (sum_k 2^(m_k - M) den_k +
    # 2^(sink - M)) with M = max_k m_k (every m_k >= sink, so all terms are finite)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < num_heads
    cols = tl.arange(0, D)
    sink = tl.load(sink_ptr + h, mask=h_ok, other=0.0) * LOG2E_C
    m, den, acc = sink, tl.zeros((BLOCK_H,), tl.float32), tl.zeros((BLOCK_H, D), tl.float32)
    for k in range(num_splits):
        row = (t * num_splits + k) * num_heads
        m_k = tl.load(part_stats_ptr + 2 * row + h, mask=h_ok, other=0.0)
        den_k = tl.load(part_stats_ptr + 2 * row + num_heads + h, mask=h_ok, other=0.0)
        acc_k = tl.load(
            part_ptr + (row + h[:, None]) * D + cols[None, :], mask=h_ok[:, None], other=0.0
        ).to(tl.float32)
        m_new = tl.maximum(m, m_k)
        alpha, beta = tl.exp2(m - m_new), tl.exp2(m_k - m_new)
        den = den * alpha + den_k * beta
        acc = acc * alpha[:, None] + acc_k * beta[:, None]
        m = m_new
    o = acc / (den + tl.exp2(sink - m))[:, None]
    tl.store(o_ptr + t * stride_ot + h[:, None] * stride_oh + cols[None, :], o, mask=h_ok[:, None])


def _check(q, window_pages, window_slots, comp_pages, comp_slots, sink, window_layout, comp_layout):
    num_tokens, num_heads, dim = q.shape
    assert q.dtype in (torch.float32, torch.bfloat16) and q.stride(2) == 1, (q.dtype, q.stride())
    assert dim == window_layout.dim == 512 and window_layout.kind == "window", window_layout
    check_pages(window_pages, window_layout)
    assert sink.dtype == torch.float32 and sink.shape == (num_heads,), (sink.dtype, sink.shape)
    assert sink.is_contiguous(), "sink must be contiguous"
    assert window_slots.dtype == torch.int64 and window_slots.dim() == 2, window_slots.dtype
    assert window_slots.shape[0] == num_tokens and window_slots.is_contiguous(), window_slots.shape
    if (comp_pages is None) != (comp_slots is None):
        raise ValueError("comp_pages and comp_slots must be given together")
    if comp_pages is not None:
        assert comp_layout is not None and comp_layout.kind in ("c4", "c128"), comp_layout
        check_pages(comp_pages, comp_layout)
        assert comp_slots.dtype == torch.int64 and comp_slots.shape[0] == num_tokens
        assert comp_slots.dim() == 2 and comp_slots.is_contiguous(), comp_slots.shape


def sparse_mqa(
    q,
    window_pages,
    window_slots,
    comp_pages,
    comp_slots,
    sink,
    scale: float,
    window_layout: PageLayout,
    comp_layout: PageLayout | None = None,
) -> torch.Tensor:
    """Sparse MQA over per-token slot lists -> o [T, H, 512] fp32.

    q [T, H, 512] fp32 or bf16; window_pages / comp_pages: uint8 page buffers of one layer in
    window_layout / comp_layout (fp8: 448 e4m3 dims with ue8m0 scales per 64 + 64 bf16 rope dims);
    window_slots int64 [T, W], comp_slots int64 [T, K] physical slots, -1 = none (comp_pages,
    comp_slots and comp_layout may be None: window-only layers); sink [H] fp32; scale: the softmax
    scale. Scores and the weighted sum use bf16 tensor-core operands for bf16 / fp8 pages on a GPU
    (the values are exact in bf16; q and the probabilities are rounded) and fp32 for fp32 pages.
    """
    return sparse_mqa_split(
        q,
        window_pages,
        window_slots,
        comp_pages,
        comp_slots,
        sink,
        scale,
        window_layout,
        comp_layout,
        None,
    )


def sparse_mqa_split(
    q,
    window_pages,
    window_slots,
    comp_pages,
    comp_slots,
    sink,
    scale: float,
    window_layout: PageLayout,
    comp_layout: PageLayout | None,
    num_splits: int | None,
) -> torch.Tensor:
    """sparse_mqa with an explicit number of key splits (None: `num_splits_for` picks)."""
    _check(q, window_pages, window_slots, comp_pages, comp_slots, sink, window_layout, comp_layout)
    num_tokens, num_heads, dim = q.shape
    o = torch.empty(num_tokens, num_heads, dim, dtype=torch.float32, device=q.device)
    if num_tokens == 0 or num_heads == 0:
        return o
    has_comp = comp_pages is not None
    comp_layout = comp_layout if has_comp else window_layout
    bf16_mma = use_bf16_mma(window_layout.dtype) and use_bf16_mma(comp_layout.dtype)
    block_h, block_n, num_warps, fma = _config(num_heads, bf16_mma)
    num_w, num_c = window_slots.shape[1], comp_slots.shape[1] if has_comp else 0
    head_blocks = triton.cdiv(num_heads, block_h)
    if num_splits is None:
        num_splits = num_splits_for(num_tokens, head_blocks, num_w + num_c, q.device)
    split_len = triton.cdiv(triton.cdiv(max(num_w + num_c, 1), num_splits), block_n) * block_n
    if bf16_mma:  # a bf16 q tile loaded as is stays in shared memory as the wgmma A operand
        q = q.to(torch.bfloat16)
    part = stats = o  # unused placeholders when there is one split
    if num_splits > 1:  # bf16 partials on tensor-core paths: half the traffic, error << bf16 p
        part = torch.empty(
            num_tokens,
            num_splits,
            num_heads,
            dim,
            device=q.device,
            dtype=torch.bfloat16 if bf16_mma else torch.float32,
        )
        stats = torch.empty(num_tokens, num_splits, 2, num_heads, device=q.device)
    _sparse_mqa_kernel[(num_tokens, num_splits, head_blocks)](
        q,
        o,
        part,
        stats,
        sink,
        window_pages,
        window_slots,
        comp_pages if has_comp else window_pages,
        comp_slots if has_comp else window_slots,
        num_heads,
        num_w,
        num_c,
        split_len,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        o.stride(0),
        o.stride(1),
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        HAS_COMP=has_comp,
        SPLIT=num_splits > 1,
        BF16_MMA=bf16_mma,
        FMA=fma,
        D=dim,
        num_warps=num_warps,
        **_layout_constexprs(window_layout, "W_"),
        **_layout_constexprs(comp_layout, "C_"),
    )
    if num_splits > 1:
        _combine_kernel[(num_tokens, triton.cdiv(num_heads, 16))](
            o,
            part,
            stats,
            sink,
            num_heads,
            num_splits,
            o.stride(0),
            o.stride(1),
            BLOCK_H=16,
            D=dim,
            num_warps=4,
        )
    return o


def _layout_constexprs(layout: PageLayout, prefix: str) -> dict:
    args = layout_args(layout, prefix)
    del args[prefix + "D"], args[prefix + "INDEXER"]  # both pools hold d = 512 kv entries
    return args


def sparse_mqa_ref(
    q,
    window_pages,
    window_slots,
    comp_pages,
    comp_slots,
    sink,
    scale: float,
    window_layout: PageLayout,
    comp_layout: PageLayout | None = None,
) -> torch.Tensor:
    """Torch reference of sparse_mqa: one softmax with the sink as an extra logit.

    Runs over chunks of REF_CHUNK tokens. When the tokens of a chunk share most of their keys (a
    prefill chunk: overlapping windows), each distinct entry is read and scored once (scores
    [t, H, U] against the U distinct entries; each token's list picks its columns); otherwise
    (decode rows of different requests) each token's own entries are gathered.
    """
    _check(q, window_pages, window_slots, comp_pages, comp_slots, sink, window_layout, comp_layout)
    pools = [(window_pages, window_slots, window_layout)]
    if comp_pages is not None:
        pools.append((comp_pages, comp_slots, comp_layout))
    outs = [torch.zeros(0, q.shape[1], q.shape[2], device=q.device)]
    for t0 in range(0, q.shape[0], REF_CHUNK):
        chunk = [(pages, slots[t0 : t0 + REF_CHUNK], layout) for pages, slots, layout in pools]
        slots = torch.cat([s for _, s, _ in chunk], 1)  # [t, n]
        distinct = [torch.unique(s.clamp_min(-1), return_inverse=True) for _, s, _ in chunk]
        qc = q[t0 : t0 + REF_CHUNK].float()
        if sum(d.numel() for d, _ in distinct) <= SHARED_KEYS_RATIO * slots.shape[1]:
            outs.append(_attend_distinct(qc, chunk, distinct, slots, sink, scale))
        else:
            kv = torch.cat([read_entries(p, s, lay) for p, s, lay in chunk], 1)  # [t, n, 512]
            probs = _probs(torch.einsum("thd,tnd->thn", qc, kv) * scale, slots, sink)
            outs.append(torch.einsum("thn,tnd->thd", probs, kv))
    return torch.cat(outs)


def _attend_distinct(q, chunk, distinct, slots, sink, scale: float) -> torch.Tensor:
    """q [t, H, 512] over the distinct entries of each pool (torch.unique of the chunk's slots,
    -1 read as zeros) -> o [t, H, 512]."""
    kv, cols, offset = [], [], 0
    for (pages, _, layout), (keys, inverse) in zip(chunk, distinct, strict=True):
        kv.append(read_entries(pages, keys, layout))
        cols.append(inverse + offset)
        offset += keys.numel()
    kv = torch.cat(kv)  # [U, 512]
    t, h = slots.shape[0], q.shape[1]
    cols = torch.cat(cols, 1)[:, None, :].expand(t, h, -1)  # [t, H, n]
    probs = _probs(torch.einsum("thd,ud->thu", q, kv).gather(2, cols) * scale, slots, sink)
    weights = torch.zeros(t, h, kv.shape[0], device=q.device).scatter_add_(2, cols, probs)
    return torch.einsum("thu,ud->thd", weights, kv)


def _probs(scores, slots, sink) -> torch.Tensor:
    """Softmax of scores [t, H, n] (slots < 0 masked) with the sink as an extra logit."""
    scores = torch.where((slots >= 0)[:, None, :], scores, float("-inf"))
    sinks = sink[None, :, None].expand(scores.shape[0], -1, 1)
    return torch.softmax(torch.cat((scores, sinks), 2), dim=2)[..., :-1]
