"""indexer_topk: lightning-indexer scores over a request's paged C4 keys, then the causal top-k.

score(t, s) = sum_h relu(q[t, h] . k[s]) * weights[t, h] for s < bound[t] (SPEC_MODEL.md section 4);
the top-k positions in the request's C4 sequence come out in descending score, equal scores in
ascending s (the spec's tie rule: the lower entry index wins), padded with -1 when fewer than topk
are visible. Position s of request r lives at slot page_table[r, s // 64] * 64 + s % 64 of the
indexer pool.

The Triton path writes one int64 key per (t, s), key = (order-preserving int32 of the score) << 32 |
(2^32 - 1 - s), unique per row, so torch.topk over the keys yields exactly that order.
"""

import torch
import triton
import triton.language as tl

from dsv4ray.cache.layout import PageLayout, check_pages, hadamard_rotate, read_entries
from dsv4ray.kernels.bits import mma, mma_operand, use_bf16_mma
from dsv4ray.kernels.entries import layout_args, load_indexer_keys

MASKED_KEY = -(2**63)  # below every real key: s >= bound, or past the page table
MASKED_KEY_C = tl.constexpr(MASKED_KEY)
PAGES_PER_PROG = 8  # pages scored per program, reusing its q tile


REF_CHUNK = 64  # tokens scored at once by the torch reference


@triton.jit
def _score_keys(q, w, pages_ptr, page, s, valid, BF16_MMA: tl.constexpr, FMT: tl.constexpr,
                D: tl.constexpr, EPP: tl.constexpr, PAGE_BYTES: tl.constexpr,
                VALUE_BYTES: tl.constexpr, SCALE_OFF: tl.constexpr, SCALE_BYTES: tl.constexpr):
    """Sort keys [EPP] int64 of the positions s [EPP] on one page (MASKED_KEY where not valid)."""
    slots = page * EPP + tl.arange(0, EPP)
    k, k_scale = load_indexer_keys(pages_ptr, slots, valid, BF16_MMA, FMT, D, EPP, PAGE_BYTES,
                                   VALUE_BYTES, SCALE_OFF, SCALE_BYTES)  # [EPP, D], [EPP]
    dots = mma(q, tl.trans(k), BF16_MMA)  # [BLOCK_H, EPP]
    score = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0) * k_scale + 0.0  # + 0.0: -0 -> +0
    bits = score.to(tl.int32, bitcast=True)
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)  # int order == float order
    return tl.where(valid, (ordered << 32) | (0xFFFFFFFF - s), MASKED_KEY_C)


@triton.jit
def _indexer_keys_kernel(q_ptr, w_ptr, pages_ptr, page_table_ptr, req_ptr, bound_ptr, keys_ptr,
                         num_heads, stride_qt, stride_qh, stride_wt, stride_pt, num_page_cols,
                         BLOCK_H: tl.constexpr, PAGES_PER_PROG: tl.constexpr,
                         BF16_MMA: tl.constexpr, FMT: tl.constexpr, D: tl.constexpr,
                         EPP: tl.constexpr, PAGE_BYTES: tl.constexpr, VALUE_BYTES: tl.constexpr,
                         SCALE_OFF: tl.constexpr, SCALE_BYTES: tl.constexpr,
                         INDEXER: tl.constexpr):
    # program (token t, PAGES_PER_PROG page-table columns): q and weights are loaded once
    t = tl.program_id(0).to(tl.int64)
    bound = tl.minimum(tl.load(bound_ptr + t), num_page_cols * EPP)
    table_row = page_table_ptr + tl.load(req_ptr + t) * stride_pt
    h = tl.arange(0, BLOCK_H)
    q = tl.load(q_ptr + t * stride_qt + h[:, None] * stride_qh + tl.arange(0, D)[None, :],
                mask=(h < num_heads)[:, None], other=0.0)
    q = mma_operand(q, BF16_MMA)  # [BLOCK_H, D]
    w = tl.load(w_ptr + t * stride_wt + h, mask=h < num_heads, other=0.0)
    for i in range(PAGES_PER_PROG):
        j = tl.program_id(1).to(tl.int64) * PAGES_PER_PROG + i
        s = j * EPP + tl.arange(0, EPP)
        keys = tl.full((EPP,), MASKED_KEY_C, tl.int64)
        if j * EPP < bound:
            keys = _score_keys(q, w, pages_ptr, tl.load(table_row + j), s, s < bound, BF16_MMA, FMT,
                               D, EPP, PAGE_BYTES, VALUE_BYTES, SCALE_OFF, SCALE_BYTES)
        tl.store(keys_ptr + t * num_page_cols * EPP + s, keys, mask=(s < num_page_cols * EPP))


def _check(q, weights, k_pages, page_table, req_idx, bound, layout) -> None:
    check_pages(k_pages, layout)
    if layout.kind != "indexer":
        raise ValueError(f"indexer_topk reads the indexer pool, got a {layout.kind} layout")
    num_tokens, num_heads = weights.shape
    assert q.dtype == torch.float32 and q.shape == (num_tokens, num_heads, layout.dim), q.shape
    assert weights.dtype == torch.float32 and weights.stride(1) == 1, (weights.dtype, weights.shape)
    assert page_table.dtype == torch.int64 and page_table.dim() == 2 and page_table.stride(1) == 1
    for name, t in (("req_idx", req_idx), ("bound", bound)):
        assert t.dtype == torch.int64 and t.shape == (num_tokens,) and t.is_contiguous(), (
            f"{name} must be contiguous int64 [T]")


def _rotated_queries(q: torch.Tensor, layout: PageLayout) -> torch.Tensor:
    # fp8 keys are stored Hadamard-rotated; rotating q too leaves every q.k unchanged
    return hadamard_rotate(q) if layout.dtype == "fp8" else q


def _topk_from_keys(keys: torch.Tensor, topk: int) -> torch.Tensor:
    num_tokens, num_cols = keys.shape
    out = torch.full((num_tokens, topk), -1, dtype=torch.int64, device=keys.device)
    k = min(topk, num_cols)
    if k == 0 or num_tokens == 0:
        return out
    top = torch.topk(keys, k, dim=1, sorted=True).values
    pos = 0xFFFFFFFF - (top & 0xFFFFFFFF)
    out[:, :k] = torch.where(top == MASKED_KEY, -1, pos)
    return out


def indexer_topk(q, weights, k_pages, page_table, req_idx, bound, topk: int,
                 layout: PageLayout) -> torch.Tensor:
    """Top-k C4 positions per token -> int64 [T, topk]: descending score, ties to the lower s.

    Rows are padded with -1 when fewer than topk entries are visible.

    q [T, H, 128] fp32: roped indexer queries (rotated here for the fp8 format). weights [T, H]
    fp32, the softmax scaling already applied. k_pages: uint8 [num_pages, layout.page_bytes], the
    indexer pool of one layer. page_table int64 [R, max_pages]: C4 page ids per request. req_idx
    int64 [T]: the token's page-table row. bound int64 [T]: visible entries (pos + 1) // 4 (at most
    max_pages * 64). On a GPU with bf16 / fp8 pages the dots use bf16 q (see bits.mma), so a
    near-tie may resolve differently from the fp32 reference.
    """
    _check(q, weights, k_pages, page_table, req_idx, bound, layout)
    q = _rotated_queries(q, layout).contiguous()
    num_tokens, num_heads = weights.shape
    num_page_cols = page_table.shape[1]
    keys = torch.empty(num_tokens, num_page_cols * layout.entries_per_page, dtype=torch.int64,
                       device=q.device)
    if num_tokens and num_page_cols:
        grid = (num_tokens, triton.cdiv(num_page_cols, PAGES_PER_PROG))
        _indexer_keys_kernel[grid](
            q, weights, k_pages, page_table, req_idx, bound, keys, num_heads, q.stride(0),
            q.stride(1), weights.stride(0), page_table.stride(0), num_page_cols,
            BLOCK_H=max(16, triton.next_power_of_2(num_heads)), PAGES_PER_PROG=PAGES_PER_PROG,
            BF16_MMA=use_bf16_mma(layout.dtype), num_warps=8 if layout.dtype == "fp32" else 4,
            **layout_args(layout))
    return _topk_from_keys(keys, topk)


def indexer_scores_ref(q, weights, k_pages, page_table, req_idx, bound, layout) -> torch.Tensor:
    """Dense scores [T, max_pages * 64] fp32, -inf where s >= bound (the reference's first half).

    Every request's keys are read once; tokens are scored in chunks of REF_CHUNK, so long CPU
    prefills stay small in memory.
    """
    _check(q, weights, k_pages, page_table, req_idx, bound, layout)
    epp = layout.entries_per_page
    s = torch.arange(page_table.shape[1] * epp, device=q.device)
    q = _rotated_queries(q, layout)
    slots = page_table[:, s // epp] * epp + s % epp  # [R, S]; pages -1 give slots < 0 (zeros)
    keys = read_entries(k_pages, slots, layout)  # [R, S, 128]
    scores = torch.empty(q.shape[0], s.numel(), device=q.device)
    for t0 in range(0, q.shape[0], REF_CHUNK):
        chunk = slice(t0, t0 + REF_CHUNK)
        dots = torch.einsum("thd,tsd->ths", q[chunk], keys[req_idx[chunk]])
        scores[chunk] = (dots.relu() * weights[chunk, :, None]).sum(1)
    return torch.where(s[None, :] < bound[:, None], scores, float("-inf"))


def indexer_topk_ref(q, weights, k_pages, page_table, req_idx, bound, topk: int,
                     layout: PageLayout) -> torch.Tensor:
    """Torch reference of indexer_topk: a stable descending sort keeps equal scores in s order."""
    scores = indexer_scores_ref(q, weights, k_pages, page_table, req_idx, bound, layout)
    order = torch.sort(scores, dim=1, descending=True, stable=True)
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int64, device=q.device)
    k = min(topk, scores.shape[1])
    out[:, :k] = torch.where(torch.isinf(order.values[:, :k]), -1, order.indices[:, :k])
    return out
