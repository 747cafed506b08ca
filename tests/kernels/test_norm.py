"""Fused norm and RoPE kernels against the model's torch norms and rotation."""

import pytest
import torch

from dsv4ray.config import RopeSpec
from dsv4ray.kernels.norm import norm_rope, rms_norm
from dsv4ray.kernels.testing import assert_close
from dsv4ray.model.layers.common import rms_norm as rms_norm_ref
from dsv4ray.model.layers.common import unweighted_rms_norm
from dsv4ray.model.layers.rope import apply_rope, rope_tables

EPS = 1e-6


def _tol(dtype):
    return (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 2**-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,dim", [(1, 64), (5, 256), (3, 320)])
def test_rms_norm_matches_the_model_norm(rows, dim, dtype, device):
    x = (torch.randn(rows, dim, device=device) * 4).to(dtype)
    w = torch.rand(dim, device=device) + 0.5
    assert_close("rms_norm", rms_norm(x, w, EPS), rms_norm_ref(x, w, EPS), *_tol(dtype))


def _tables(device, max_pos=600):
    rope = RopeSpec(dim=64, theta=10000.0)
    return rope_tables(rope, max_pos, device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,dim", [(1, 512), (3, 128)])
@pytest.mark.parametrize("mode", ["weighted", "unweighted", "rope only", "conjugate"])
def test_norm_rope_matches_norm_then_rotation(heads, dim, mode, dtype, device):
    cos_t, sin_t = _tables(device)
    positions = torch.tensor([0, 7, 599, 128, 3], device=device)
    x = (torch.randn(len(positions), heads, dim, device=device) * 3).to(dtype)
    w = torch.rand(dim, device=device) + 0.5
    cos, sin = cos_t[positions][:, None], sin_t[positions][:, None]
    if mode == "weighted":
        out = norm_rope(x, cos_t, sin_t, positions, weight=w, eps=EPS)
        ref = apply_rope(rms_norm_ref(x, w, EPS), cos, sin)
    elif mode == "unweighted":
        out = norm_rope(x, cos_t, sin_t, positions, eps=EPS)
        ref = apply_rope(unweighted_rms_norm(x.float(), EPS).to(dtype), cos, sin)
    elif mode == "rope only":
        out = norm_rope(x, cos_t, sin_t, positions, out_dtype=torch.float32)
        ref = apply_rope(x.float(), cos, sin)
    else:
        out = norm_rope(x, cos_t, sin_t, positions, conjugate=True)
        ref = apply_rope(x.float(), cos, -sin).to(dtype)
    assert out.dtype == ref.dtype
    assert_close(mode, out, ref, *_tol(out.dtype))


def test_norm_rope_of_no_tokens_is_empty(device):
    cos_t, sin_t = _tables(device)
    x = torch.zeros(0, 2, 128, device=device)
    out = norm_rope(x, cos_t, sin_t, torch.zeros(0, dtype=torch.int64, device=device), eps=EPS)
    assert out.shape == (0, 2, 128)
