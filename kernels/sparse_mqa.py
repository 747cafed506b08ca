"""sparse_mqa: attention of each query token over its own list of paged KV entries (SPEC_MODEL.md
2.5).

One softmax per (token, head) over the union of the token's window entries and compressed entries;
the per-head sink joins only the denominator:
    o = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sink - m)),  s_j = (q . k_j) * scale (fp32),
with k_j = v_j = the dequantised 512-dim entry. Slot -1 means no key; a token with no keys gets o =
0. Decode and prefill both use it (prefill passes per-token slot lists). The rope de-rotation of o
and the output projection happen outside.
"""

import torch
import triton
import triton.language as tl

from dsv4ray.cache.layout import PageLayout, check_pages, read_entries
from dsv4ray.kernels.bits import mma, mma_operand, use_bf16_mma
from dsv4ray.kernels.entries import layout_args, load_kv_entries

REF_CHUNK = 64  # tokens per gather in the torch reference
# [16 heads, 512] q and accumulator, 16 keys per step, 4 warps: the largest tiles that compile for
# sm_90 without register spills (bf16 and fp8 pages); more heads run as more programs over the same
# keys
BLOCK_H, BLOCK_N, NUM_WARPS = 16, 16, 4


@triton.jit
def _attend(q, m, den, acc, pages_ptr, slots_ptr, num_slots, scale, BLOCK_N: tl.constexpr,
            BF16_MMA: tl.constexpr, FMT: tl.constexpr, D: tl.constexpr,
            EPP: tl.constexpr, PAGE_BYTES: tl.constexpr, VALUE_BYTES: tl.constexpr,
            SCALE_OFF: tl.constexpr, SCALE_BYTES: tl.constexpr):
    """Online-softmax update of (m, den [BLOCK_H], acc [BLOCK_H, D]) with one pool's slot list."""
    for n0 in range(0, num_slots, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        slots = tl.load(slots_ptr + n, mask=n < num_slots, other=-1)
        if tl.max(slots, axis=0) >= 0:
            kv = load_kv_entries(pages_ptr, slots, BF16_MMA, FMT, D, EPP, PAGE_BYTES, VALUE_BYTES,
                                 SCALE_OFF, SCALE_BYTES)  # [BLOCK_N, D]
            s = mma(q, tl.trans(kv), BF16_MMA) * scale  # [BLOCK_H, BLOCK_N]
            s = tl.where((slots >= 0)[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            den = den * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + mma(p, kv, BF16_MMA)
            m = m_new
    return m, den, acc


@triton.jit
def _sparse_mqa_kernel(q_ptr, o_ptr, sink_ptr, w_pages_ptr, w_slots_ptr, c_pages_ptr, c_slots_ptr,
                       num_heads, num_w, num_c, scale, stride_qt, stride_qh, stride_ot, stride_oh,
                       BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HAS_COMP: tl.constexpr,
                       BF16_MMA: tl.constexpr, D: tl.constexpr,
                       W_FMT: tl.constexpr, W_EPP: tl.constexpr, W_PAGE_BYTES: tl.constexpr,
                       W_VALUE_BYTES: tl.constexpr, W_SCALE_OFF: tl.constexpr,
                       W_SCALE_BYTES: tl.constexpr, C_FMT: tl.constexpr, C_EPP: tl.constexpr,
                       C_PAGE_BYTES: tl.constexpr, C_VALUE_BYTES: tl.constexpr,
                       C_SCALE_OFF: tl.constexpr, C_SCALE_BYTES: tl.constexpr):
    # program (token t, block of BLOCK_H heads); the running max starts at the sink, so it is finite
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, D)
    h_mask = (h < num_heads)[:, None]
    q_ptrs = q_ptr + t * stride_qt + h[:, None] * stride_qh + cols[None, :]
    q = tl.load(q_ptrs, mask=h_mask, other=0.0)
    q = mma_operand(q, BF16_MMA)  # [BLOCK_H, D], converted once for every dot below
    sink = tl.load(sink_ptr + h, mask=h < num_heads, other=0.0)
    m, den, acc = sink, tl.zeros((BLOCK_H,), tl.float32), tl.zeros((BLOCK_H, D), tl.float32)
    m, den, acc = _attend(q, m, den, acc, w_pages_ptr, w_slots_ptr + t * num_w, num_w, scale,
                          BLOCK_N, BF16_MMA, W_FMT, D, W_EPP, W_PAGE_BYTES, W_VALUE_BYTES,
                          W_SCALE_OFF, W_SCALE_BYTES)
    if HAS_COMP:
        m, den, acc = _attend(q, m, den, acc, c_pages_ptr, c_slots_ptr + t * num_c, num_c, scale,
                              BLOCK_N, BF16_MMA, C_FMT, D, C_EPP, C_PAGE_BYTES, C_VALUE_BYTES,
                              C_SCALE_OFF, C_SCALE_BYTES)
    o = acc / (den + tl.exp(sink - m))[:, None]
    tl.store(o_ptr + t * stride_ot + h[:, None] * stride_oh + cols[None, :], o, mask=h_mask)


def _check(q, window_pages, window_slots, comp_pages, comp_slots, sink, window_layout, comp_layout):
    num_tokens, num_heads, dim = q.shape
    assert q.dtype in (torch.float32, torch.bfloat16) and q.stride(2) == 1, (q.dtype, q.stride())
    assert dim == window_layout.dim == 512 and window_layout.kind == "window", window_layout
    check_pages(window_pages, window_layout)
    assert sink.dtype == torch.float32 and sink.shape == (num_heads,), (sink.dtype, sink.shape)
    assert window_slots.dtype == torch.int64 and window_slots.dim() == 2, window_slots.dtype
    assert window_slots.shape[0] == num_tokens and window_slots.is_contiguous(), window_slots.shape
    if (comp_pages is None) != (comp_slots is None):
        raise ValueError("comp_pages and comp_slots must be given together")
    if comp_pages is not None:
        assert comp_layout is not None and comp_layout.kind in ("c4", "c128"), comp_layout
        check_pages(comp_pages, comp_layout)
        assert comp_slots.dtype == torch.int64 and comp_slots.shape[0] == num_tokens
        assert comp_slots.dim() == 2 and comp_slots.is_contiguous(), comp_slots.shape


def sparse_mqa(q, window_pages, window_slots, comp_pages, comp_slots, sink, scale: float,
               window_layout: PageLayout, comp_layout: PageLayout | None = None) -> torch.Tensor:
    """Sparse MQA over per-token slot lists -> o [T, H, 512] fp32.

    q [T, H, 512] fp32 or bf16; window_pages / comp_pages: uint8 page buffers of one layer in
    window_layout / comp_layout (fp8: 448 e4m3 dims with ue8m0 scales per 64 + 64 bf16 rope dims);
    window_slots int64 [T, W], comp_slots int64 [T, K] physical slots, -1 = none (comp_pages,
    comp_slots and comp_layout may be None: window-only layers); sink [H] fp32; scale: the softmax
    scale. Scores and the weighted sum use bf16 tensor-core operands for bf16 / fp8 pages on a GPU
    (the values are exact in bf16; q and the probabilities are rounded) and fp32 for fp32 pages.
    """
    _check(q, window_pages, window_slots, comp_pages, comp_slots, sink, window_layout, comp_layout)
    num_tokens, num_heads, dim = q.shape
    o = torch.empty(num_tokens, num_heads, dim, dtype=torch.float32, device=q.device)
    if num_tokens == 0 or num_heads == 0:
        return o
    has_comp = comp_pages is not None
    comp_layout = comp_layout if has_comp else window_layout
    grid = (num_tokens, triton.cdiv(num_heads, BLOCK_H))
    _sparse_mqa_kernel[grid](
        q, o, sink, window_pages, window_slots, comp_pages if has_comp else window_pages,
        comp_slots if has_comp else window_slots, num_heads, window_slots.shape[1],
        comp_slots.shape[1] if has_comp else 0, scale, q.stride(0), q.stride(1), o.stride(0),
        o.stride(1), BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, HAS_COMP=has_comp,
        BF16_MMA=use_bf16_mma(window_layout.dtype) and use_bf16_mma(comp_layout.dtype), D=dim,
        num_warps=NUM_WARPS,
        **_layout_constexprs(window_layout, "W_"), **_layout_constexprs(comp_layout, "C_"))
    return o


def _layout_constexprs(layout: PageLayout, prefix: str) -> dict:
    args = layout_args(layout, prefix)
    del args[prefix + "D"], args[prefix + "INDEXER"]  # both pools hold d = 512 kv entries
    return args


def sparse_mqa_ref(q, window_pages, window_slots, comp_pages, comp_slots, sink, scale: float,
                   window_layout: PageLayout,
                   comp_layout: PageLayout | None = None) -> torch.Tensor:
    """Torch reference of sparse_mqa: gather, one softmax with the sink as an extra logit.

    Runs over chunks of REF_CHUNK tokens, so a long CPU prefill never gathers every token's keys.
    """
    _check(q, window_pages, window_slots, comp_pages, comp_slots, sink, window_layout, comp_layout)
    outs = [torch.zeros(0, q.shape[1], q.shape[2], device=q.device)]
    for t0 in range(0, q.shape[0], REF_CHUNK):
        chunk = slice(t0, t0 + REF_CHUNK)
        kv = read_entries(window_pages, window_slots[chunk], window_layout)  # [t, W, 512]
        slots = window_slots[chunk]
        if comp_pages is not None:
            kv = torch.cat((kv, read_entries(comp_pages, comp_slots[chunk], comp_layout)), 1)
            slots = torch.cat((slots, comp_slots[chunk]), 1)
        scores = torch.einsum("thd,tnd->thn", q[chunk].float(), kv) * scale
        scores = torch.where((slots >= 0)[:, None, :], scores, float("-inf"))
        sinks = sink[None, :, None].expand(scores.shape[0], -1, 1)
        probs = torch.softmax(torch.cat((scores, sinks), 2), dim=2)[..., :-1]
        outs.append(torch.einsum("thn,tnd->thd", probs, kv))
    return torch.cat(outs)
