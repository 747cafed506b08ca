"""The network over paged caches: the reference's modules, with attention reading the pools.

Same parameters and math as model/reference.py, but the window KV, compressed entries, indexer
keys and compressor state live in a stage's pools (cache/pools.py) and every cache operation goes
through kernels/dispatch (Triton on CUDA, torch references elsewhere). A step runs the flattened
tokens of all scheduled requests at once; worker/batch.py holds their per-token index lists.
"""

from __future__ import annotations

import torch

from dsv4ray.cache.layer_mapping import LayerInfo
from dsv4ray.cache.pools import StagePools
from dsv4ray.kernels import dispatch
from dsv4ray.model.block import Block
from dsv4ray.model.layers.attention import Attention
from dsv4ray.model.layers.compressor import Compressor
from dsv4ray.worker import ops
from dsv4ray.worker.batch import BatchMeta
from dsv4ray.worker.host.hisparse_io import c4_cache


def paged_block(
    block: Block, x: torch.Tensor, meta: BatchMeta, pools: StagePools, topk: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, hc, hidden] -> (x, running top-k [T, k] of logical C4 positions or None)."""
    info = pools.info(block.spec.layer_id)
    post, comb, collapsed = ops.pre_mix(block, x, "attn")
    attn_in = ops.rms_norm(collapsed, block.attn_norm)
    out, layer_topk = paged_attention(block.attn, attn_in, meta, pools, info, topk)
    x = ops.post_mix(x, out, post, comb)
    post, comb, collapsed = ops.pre_mix(block, x, "ffn")
    ffn_in = ops.rms_norm(collapsed, block.ffn_norm)
    x = ops.post_mix(x, ops.moe(block.ffn, ffn_in, meta.token_ids, meta.static), post, comb)
    return x, (layer_topk if layer_topk is not None else topk)


def paged_attention(
    attn: Attention,
    x: torch.Tensor,
    meta: BatchMeta,
    pools: StagePools,
    info: LayerInfo,
    prev_topk: torch.Tensor | None,
):
    """x [T, hidden] -> (out [T, hidden], this layer's top-k or None)."""
    spec, cfg = attn.spec, attn.cfg
    tables = meta.ropes.get(spec.rope)  # (cos, sin) [P, R/2]
    cos_t, sin_t = tables
    qr = ops.rms_norm(attn.wq_a(x), attn.q_norm)
    q = attn.wq_b(qr).unflatten(-1, (attn.heads, attn.dim))
    q = ops.norm_rope(q, tables, meta.positions, eps=cfg.rms_norm_eps)  # [T, H, 512]
    kv = ops.norm_rope(
        attn.wkv(x).unsqueeze(1),
        tables,
        meta.positions,
        attn.kv_norm.eps,
        attn.kv_norm.weight,
        out_dtype=torch.float32,
    )  # [T, 1, 512]
    window = pools.window[info.local_id]
    dispatch.store_kv(kv.squeeze(1), window, meta.window_store, pools.layouts["window"])
    comp_pages = comp_slots = comp_layout = topk = None
    ratio = spec.compress_ratio
    if ratio == 4:
        kind, c4 = "c4", c4_cache(pools, meta, info)  # all on the device, or HiSparse hot rows
        state = pools.c4_state[info.compress_layer_id]
        _compress(
            attn.compressor,
            x,
            meta,
            state,
            c4.pages,
            pools.layouts[kind],
            c4.out_loc,
            cos_t,
            sin_t,
        )
        c4.written()
        topk = (
            _indexer(attn, x, qr, meta, pools, info, tables)
            if info.indexer_layer_id is not None
            else prev_topk
        )
        if topk is None:
            raise RuntimeError(f"layer {spec.layer_id} shares a top-k but none reached it")
        (comp_pages, comp_slots), comp_layout = c4.read(topk), pools.layouts[kind]
    elif ratio == 128:
        comp_pages = pools.c128[info.compress_layer_id]
        state = pools.c128_state[info.compress_layer_id]
        _compress(
            attn.compressor,
            x,
            meta,
            state,
            comp_pages,
            pools.layouts["c128"],
            meta.c128_out,
            cos_t,
            sin_t,
        )
        comp_slots, comp_layout = meta.c128_slots, pools.layouts["c128"]
    o = dispatch.sparse_mqa(
        q,
        window,
        meta.window_slots,
        comp_pages,
        comp_slots,
        attn.attn_sink.float(),
        attn.dim**-0.5,
        pools.layouts["window"],
        comp_layout,
    )
    o = ops.norm_rope(o, tables, meta.positions, conjugate=True, out_dtype=x.dtype)
    return attn.project_out(o.unsqueeze(0)).squeeze(0), (topk if ratio == 4 else None)


def _compress(comp: Compressor, x, meta: BatchMeta, state, pages, layout, out_loc, cos_t, sin_t):
    kv_state, score_state = state
    dispatch.compress_norm_rope_store(
        comp.wkv(x).float().contiguous(),
        comp.wgate(x).float().contiguous(),
        meta.positions,
        meta.state_slots,
        meta.seq_start,
        kv_state,
        score_state,
        comp.ape.float(),
        comp.norm.weight.float(),
        comp.norm.eps,
        cos_t,
        sin_t,
        out_loc,
        pages,
        layout,
        comp.ratio,
    )


def _indexer(
    attn: Attention,
    x,
    qr,
    meta: BatchMeta,
    pools: StagePools,
    info: LayerInfo,
    tables,
) -> torch.Tensor:
    """The lightning indexer over the paged indexer keys -> logical C4 positions [T, topk]."""
    idx = attn.indexer
    cos_t, sin_t = tables
    pages, layout = pools.indexer[info.indexer_layer_id], pools.layouts["indexer"]
    _compress(
        idx.compressor,
        x,
        meta,
        pools.indexer_state[info.indexer_layer_id],
        pages,
        layout,
        meta.c4_out,
        cos_t,
        sin_t,
    )
    q = idx.wq_b(qr).unflatten(-1, (idx.heads, idx.head_dim))
    q = ops.norm_rope(q, tables, meta.positions, out_dtype=torch.float32)  # [T, heads, 128]
    weights = idx.weights_proj(x).float() * (idx.heads**-0.5 * idx.head_dim**-0.5)
    return dispatch.indexer_topk(
        q,
        weights.contiguous(),
        pages,
        meta.page_table,
        meta.req_rows,
        meta.c4_bound,
        idx.topk,
        layout,
    )
