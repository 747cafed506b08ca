"""The paged forward's fused ops: Triton kernels on the triton backend, the model's torch functions
otherwise (kernels/dispatch.py picks the backend once).

Each op is one kernel (or two) on GPUs where the model's torch code is a chain of small ones:
mHC (kernels/mhc.py), norms and RoPE (kernels/norm.py), the routed and shared experts
(kernels/moe.py). The torch side is the reference these kernels are tested against, and what CPU
machines run.
"""

from __future__ import annotations

import torch

from dsv4ray.kernels import dispatch
from dsv4ray.kernels import mhc as mhc_kernels
from dsv4ray.kernels import moe as moe_kernels
from dsv4ray.kernels import norm as norm_kernels
from dsv4ray.model.block import Block
from dsv4ray.model.layers.common import RMSNorm, unweighted_rms_norm
from dsv4ray.model.layers.common import rms_norm as torch_rms_norm
from dsv4ray.model.layers.mhc import hc_post
from dsv4ray.model.layers.moe import MoE
from dsv4ray.model.layers.rope import apply_rope


def fused() -> bool:
    return dispatch.backend() == "triton"


def prepare(blocks) -> None:
    """One-time weight layouts the fused ops read: each MoE's experts stacked (the experts'
    parameters become views, so nothing is held twice). Call before sizing pools."""
    if fused():
        for block in blocks:
            block.ffn.stack_experts()


def pre_mix(block: Block, x: torch.Tensor, site: str):
    """mHC before a sublayer: (post [T, hc], comb [T, hc, hc], collapsed [T, hidden])."""
    if not fused():
        return block.pre_mix(x, site)
    c = block.cfg
    return mhc_kernels.mhc_pre(
        x.contiguous(),
        getattr(block, f"hc_{site}_fn"),
        getattr(block, f"hc_{site}_base"),
        getattr(block, f"hc_{site}_scale"),
        c.hc_eps,
        c.rms_norm_eps,
        c.hc_sinkhorn_iters,
    )


def post_mix(x, out, post, comb) -> torch.Tensor:
    """mHC after a sublayer: x [T, hc, hidden], out [T, hidden] -> the new streams."""
    if not fused():
        return hc_post(x, out, post, comb)
    return mhc_kernels.mhc_post(x.contiguous(), out.contiguous(), post, comb)


def rms_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    if not fused():
        return norm(x)
    return norm_kernels.rms_norm(x.contiguous(), norm.weight, norm.eps)


def norm_rope(x, tables, positions, eps=None, weight=None, conjugate=False, out_dtype=None):
    """x [T, H, D]: the RMS norm of each head vector (eps given; weighted when weight is), then
    RoPE on its last channels at positions (conjugate: the de-rotation), in out_dtype (default
    x's). tables: the (cos, sin) [P, R/2] fp32 tables of the layer's rope."""
    cos_t, sin_t = tables
    out_dtype = out_dtype or x.dtype
    if fused():
        return norm_kernels.norm_rope(
            x.contiguous(), cos_t, sin_t, positions, weight, eps, conjugate, out_dtype
        )
    if eps is None:
        y = x.to(out_dtype)
    elif weight is None:
        y = unweighted_rms_norm(x, eps)
    else:
        y = torch_rms_norm(x, weight, eps)
    cos, sin = cos_t[positions][:, None], sin_t[positions][:, None]
    return apply_rope(y, cos, -sin if conjugate else sin).to(out_dtype)


def moe(ffn: MoE, x: torch.Tensor, token_ids: torch.Tensor, static: bool) -> torch.Tensor:
    """Routed + shared experts of x [T, hidden]. static: no host synchronisation (CUDA graphs;
    the fused path never synchronises)."""
    if not fused():
        return ffn.forward_static(x, token_ids) if static else ffn(x, token_ids)
    weights, ids = ffn.gate(x, token_ids)
    w13, w2 = ffn.stack_experts()
    if ffn.shared_in_stack:
        ids = torch.cat([ids, torch.full_like(ids[:, :1], len(ffn.experts))], dim=1)
        weights = torch.cat([weights, torch.ones_like(weights[:, :1])], dim=1)
    out = moe_kernels.fused_moe(x.contiguous(), ids, weights, w13, w2, ffn.limit)
    return out if ffn.shared_in_stack else out + ffn.shared_experts(x)
