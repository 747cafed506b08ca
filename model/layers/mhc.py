"""Manifold hyper-connections (mHC): hc_mult residual streams mixed around each sub-block.

The residual X is [..., hc, hidden]. Before a sub-block the streams give three weight sets from
one projection: ``pre`` collapses X into the sub-block input, ``post`` spreads its output over the
streams and ``comb`` (Sinkhorn-normalised, doubly stochastic) mixes the old streams.
"""

import torch
import torch.nn.functional as F

from dsv4ray.model.layers.common import unweighted_rms_norm


def hc_pre(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
    iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., hc, hidden] -> (post [..., hc], comb [..., hc, hc], collapsed [..., hidden])."""
    hc = x.shape[-2]
    mixes = _mixes(x, fn, norm_eps)  # [..., (2 + hc) * hc]
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    s_pre, s_post, s_comb = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * s_pre + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * s_post + post_b)
    comb_w = comb_w.view(*comb_w.shape[:-1], hc, hc)
    comb = torch.softmax(comb_w * s_comb + comb_b.view(hc, hc), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = (pre.unsqueeze(-1) * x).sum(dim=-2).to(x.dtype)
    return post, comb, collapsed


def hc_post(
    x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """Stream j = post_j * out + sum_i comb[i, j] * x_i; x [..., hc, hidden], out [..., hidden]."""
    dtype = x.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), x)
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed


def hc_head(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
) -> torch.Tensor:
    """Final collapse of the streams before the model norm: x [..., hc, hidden] -> [..., hidden]."""
    mixes = _mixes(x, fn, norm_eps)  # [..., hc]
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * x).sum(dim=-2).to(x.dtype)


def _mixes(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """The streams' mix weights: fn over the RMS-normalised flattened streams, in fp32."""
    return F.linear(unweighted_rms_norm(x.flatten(-2).float(), norm_eps), fn.float())
