"""Norms shared by every block. All of them compute in fp32 and keep their weight in fp32."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``weight * x * rsqrt(mean(x^2) + eps)`` in fp32, cast back to the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-vector scale without weight (query heads, the mHC mixer input)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def linear(dim_in: int, dim_out: int) -> nn.Linear:
    return nn.Linear(dim_in, dim_out, bias=False)


def uninitialised_embedding(num: int, dim: int) -> nn.Embedding:
    """An embedding table [num, dim] left empty: every model here gets its weights from a
    checkpoint or an explicit randomise. nn.Embedding's own normal_ init would be wasted, and on
    the meta device (where loaders build stages) it costs seconds of lazy imports in every
    process that builds one."""
    return nn.Embedding.from_pretrained(torch.empty(num, dim), freeze=False)
