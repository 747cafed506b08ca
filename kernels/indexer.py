"""indexer_topk: lightning-indexer scores over a request's paged C4 keys, then the causal top-k.

score(t, s) = sum_h relu(q[t, h] . k[s]) * weights[t, h] for s < bound[t];
the top-k positions in the request's C4 sequence come out in descending score, equal scores in
ascending s (the spec's tie rule: the lower entry index wins), padded with -1 when fewer than topk
are visible. Position s of request r lives at slot page_table[r, s // 64] * 64 + s % 64 of the
indexer pool.

The Triton path runs two kernels: `_indexer_scores_kernel` writes one order-preserving int32 per
(t, s) (topk.MASKED_SCORE for s >= bound), one program per (token, PAGES_PER_PROG pages) with the
token's 64-head q tile rotated once and kept in shared memory, every key page one [64 keys, 128] x
[128, heads] tensor-core product; then `topk.topk_rows` selects with the tie rule.
"""

import torch
import triton
import triton.language as tl

from dsv4ray.cache.layout import check_pages, hadamard_rotate, read_entries
from dsv4ray.cache.page_layout import PageLayout
from dsv4ray.kernels.bits import num_sms, use_bf16_mma
from dsv4ray.kernels.entries import (
    FMT_FP8,
    hadamard_rotate_rows,
    layout_args,
    load_indexer_keys,
)
from dsv4ray.kernels.topk import MASKED_SCORE_C, ordered_int32, topk_rows

REF_CHUNK = 64  # tokens scored at once by the torch reference


@triton.jit
def _score_page(
    q_t,
    w,
    pages_ptr,
    page,
    valid,
    TC: tl.constexpr,
    FMT: tl.constexpr,
    D: tl.constexpr,
    EPP: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    VALUE_BYTES: tl.constexpr,
    SCALE_OFF: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
):
    """Ordered int32 scores [EPP] of one page's keys (MASKED_SCORE where not valid)."""
    slots = page * EPP + tl.arange(0, EPP)
    k, k_scale = load_indexer_keys(
        pages_ptr, slots, valid, TC, FMT, D, EPP, PAGE_BYTES, VALUE_BYTES, SCALE_OFF, SCALE_BYTES
    )  # [EPP, D], [EPP]
    if TC:
        dots = tl.dot(k, q_t)  # [EPP, BLOCK_H]: keys on the wgmma M side, heads along N
    else:
        dots = tl.dot(k, q_t, input_precision="ieee")
    score = tl.sum(tl.maximum(dots, 0.0) * w[None, :], axis=1) * k_scale
    return tl.where(valid, ordered_int32(score), MASKED_SCORE_C)


@triton.jit(do_not_specialize=["stride_pt", "num_page_cols"])
def _indexer_scores_kernel(
    q_ptr,
    w_ptr,
    pages_ptr,
    page_table_ptr,
    req_ptr,
    bound_ptr,
    out_ptr,
    num_heads,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_pt,
    num_page_cols,
    BLOCK_H: tl.constexpr,
    PAGES_PER_PROG: tl.constexpr,
    TC: tl.constexpr,
    FMT: tl.constexpr,
    D: tl.constexpr,
    EPP: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    VALUE_BYTES: tl.constexpr,
    SCALE_OFF: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    INDEXER: tl.constexpr,
):
    # program (token t, PAGES_PER_PROG page-table columns from j0): visible pages are scored, the
    # rest of the range is written MASKED_SCORE without reading keys
    t = tl.program_id(0).to(tl.int64)
    bound = tl.minimum(tl.load(bound_ptr + t), num_page_cols * EPP).to(tl.int32)
    table_row = page_table_ptr + tl.load(req_ptr + t) * stride_pt
    out_row = out_ptr + t * num_page_cols * EPP
    h = tl.arange(0, BLOCK_H)
    q = tl.load(
        q_ptr + t * stride_qt + h[:, None] * stride_qh + tl.arange(0, D)[None, :],
        mask=(h < num_heads)[:, None],
        other=0.0,
    )  # [BLOCK_H, D] fp32
    if FMT == FMT_FP8:
        q = hadamard_rotate_rows(q, BLOCK_H)  # keys are stored rotated; q . k is unchanged
    if TC:
        q = q.to(tl.float16 if FMT == FMT_FP8 else tl.bfloat16)  # the keys' exact 16-bit type
    q_t = tl.trans(q)  # [D, BLOCK_H]
    w = tl.load(w_ptr + t * stride_wt + h, mask=h < num_heads, other=0.0)
    j0 = tl.program_id(1) * PAGES_PER_PROG
    j_end = tl.minimum(j0 + PAGES_PER_PROG, num_page_cols)
    j_seen = tl.maximum(tl.minimum(j_end, tl.cdiv(bound, EPP)), j0)
    for j in range(j0, j_seen):
        s = j * EPP + tl.arange(0, EPP)
        scores = _score_page(
            q_t,
            w,
            pages_ptr,
            tl.load(table_row + j),
            s < bound,
            TC,
            FMT,
            D,
            EPP,
            PAGE_BYTES,
            VALUE_BYTES,
            SCALE_OFF,
            SCALE_BYTES,
        )
        tl.store(out_row + s, scores)
    for j in range(j_seen, j_end):
        tl.store(out_row + j * EPP + tl.arange(0, EPP), tl.full((EPP,), MASKED_SCORE_C, tl.int32))


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
            f"{name} must be contiguous int64 [T]"
        )


def _rotated_queries(q: torch.Tensor, layout: PageLayout) -> torch.Tensor:
    # fp8 keys are stored Hadamard-rotated; rotating q too leaves every q.k unchanged
    return hadamard_rotate(q) if layout.dtype == "fp8" else q


PAGES_PER_PROG = (4, 8, 16, 32)  # every value _config can pick


def _config(num_tokens: int, num_page_cols: int, dtype: str, device) -> tuple:
    """(pages per program, num_warps): long page loops let the loads run ahead of the products
    and reuse the rotated q tile, as long as the grid still has ~4 programs per SM."""
    per_sm = triton.cdiv(num_tokens * num_page_cols, 4 * num_sms(device))
    pages_per_prog = min(PAGES_PER_PROG[-1], max(PAGES_PER_PROG[0], triton.next_power_of_2(per_sm)))
    return pages_per_prog, 8 if dtype == "fp32" else 4


def compile_variants(num_heads: int, layout: PageLayout, device) -> None:
    """Compiles the scores kernel at every PAGES_PER_PROG for these heads and pages on `device`.

    The pick follows tokens x page columns, which depend on how a step's chunks and page-table
    width fall, so prompts reach every value only by chance. Each launch here has tokens x
    columns = 4 SMs x p and reads no key (every bound is 0); the arguments have the strides and
    alignments a model's step passes.
    """
    device = torch.device(device)
    num_tokens = 4 * num_sms(device)
    pages = torch.zeros(1, layout.page_bytes, dtype=torch.uint8, device=device)
    q = torch.zeros(num_tokens, num_heads, layout.dim, dtype=torch.float32, device=device)
    weights = torch.zeros(num_tokens, num_heads, dtype=torch.float32, device=device)
    zeros = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    for pages_per_prog in PAGES_PER_PROG:
        table = torch.zeros(1, pages_per_prog, dtype=torch.int64, device=device)
        assert _config(num_tokens, pages_per_prog, layout.dtype, device)[0] == pages_per_prog
        indexer_scores(q, weights, pages, table, zeros, zeros, layout)


def indexer_scores(
    q, weights, k_pages, page_table, req_idx, bound, layout: PageLayout
) -> torch.Tensor:
    """Ordered int32 scores [T, max_pages * 64] (topk.MASKED_SCORE where s >= bound); arguments as
    in indexer_topk."""
    _check(q, weights, k_pages, page_table, req_idx, bound, layout)
    assert q.stride(2) == 1, "q rows must be contiguous"
    num_tokens, num_heads = weights.shape
    num_page_cols = page_table.shape[1]
    scores = torch.empty(
        num_tokens, num_page_cols * layout.entries_per_page, dtype=torch.int32, device=q.device
    )
    if num_tokens and num_page_cols:
        pages_per_prog, num_warps = _config(num_tokens, num_page_cols, layout.dtype, q.device)
        grid = (num_tokens, triton.cdiv(num_page_cols, pages_per_prog))
        _indexer_scores_kernel[grid](
            q,
            weights,
            k_pages,
            page_table,
            req_idx,
            bound,
            scores,
            num_heads,
            q.stride(0),
            q.stride(1),
            weights.stride(0),
            page_table.stride(0),
            num_page_cols,
            BLOCK_H=max(16, triton.next_power_of_2(num_heads)),
            PAGES_PER_PROG=pages_per_prog,
            TC=use_bf16_mma(layout.dtype),
            num_warps=num_warps,
            **layout_args(layout),
        )
    return scores


def indexer_topk(
    q, weights, k_pages, page_table, req_idx, bound, topk: int, layout: PageLayout
) -> torch.Tensor:
    """Top-k C4 positions per token -> int64 [T, topk]: descending score, ties to the lower s.

    Rows are padded with -1 when fewer than topk entries are visible.

    q [T, H, 128] fp32: roped indexer queries (rotated here for the fp8 format). weights [T, H]
    fp32, the softmax scaling already applied. k_pages: uint8 [num_pages, layout.page_bytes], the
    indexer pool of one layer. page_table int64 [R, max_pages]: C4 page ids per request. req_idx
    int64 [T]: the token's page-table row. bound int64 [T]: visible entries (pos + 1) // 4 (at most
    max_pages * 64). On a GPU the dots run on tensor cores with q rounded to the keys' 16-bit type
    (fp16 for fp8 pages, which holds e4m3 exactly, so |q| must stay below 65504; bf16 for bf16
    pages), so a near-tie may resolve differently from the fp32 reference.
    """
    scores = indexer_scores(q, weights, k_pages, page_table, req_idx, bound, layout)
    return topk_rows(scores, topk, lengths=bound)  # the padded columns past bound are not read


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


def indexer_topk_ref(
    q, weights, k_pages, page_table, req_idx, bound, topk: int, layout: PageLayout
) -> torch.Tensor:
    """Torch reference of indexer_topk: a stable descending sort keeps equal scores in s order."""
    scores = indexer_scores_ref(q, weights, k_pages, page_table, req_idx, bound, layout)
    order = torch.sort(scores, dim=1, descending=True, stable=True)
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int64, device=q.device)
    k = min(topk, scores.shape[1])
    out[:, :k] = torch.where(torch.isinf(order.values[:, :k]), -1, order.indices[:, :k])
    return out
