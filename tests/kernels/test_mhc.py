"""Fused mHC kernels against the model's torch mHC (model/layers/mhc.py)."""

import pytest
import torch

from dsv4ray.kernels.mhc import FMA_MAX_WIDTH, mhc_head, mhc_post, mhc_pre
from dsv4ray.kernels.testing import assert_close
from dsv4ray.model.layers.mhc import hc_head, hc_post, hc_pre

HC_EPS, NORM_EPS, ITERS = 1e-6, 1e-6, 20


def _params(hc: int, hidden: int, device):
    mix = (2 + hc) * hc
    fn = torch.randn(mix, hc * hidden, device=device) * (hc * hidden) ** -0.5
    base = torch.randn(mix, device=device) * 0.5
    scale = torch.rand(3, device=device) + 0.5
    return fn, base, scale


# (rows, hc, hidden): one row, odd rows, rows across projection blocks, a projection wider than
# one K split (2 splits) with a hidden size off the column block, and one wider than
# FMA_MAX_WIDTH (tensor-core tiles on GPUs)
CASES = [(1, 2, 64), (7, 4, 128), (37, 2, 256), (5, 4, 320), (3, 4, 640)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hc,hidden", CASES)
def test_mhc_pre_matches_the_torch_mix(rows, hc, hidden, dtype, device):
    assert max(h * d for _, h, d in CASES) > FMA_MAX_WIDTH >= min(h * d for _, h, d in CASES)
    fn, base, scale = _params(hc, hidden, device)
    x = (torch.randn(rows, hc, hidden, device=device) * 3).to(dtype)
    post, comb, collapsed = mhc_pre(x, fn, base, scale, HC_EPS, NORM_EPS, ITERS)
    ref_post, ref_comb, ref_collapsed = hc_pre(x, fn, base, scale, HC_EPS, NORM_EPS, ITERS)
    assert collapsed.dtype == dtype
    assert_close("post", post, ref_post, 1e-5, 1e-5)
    assert_close("comb", comb, ref_comb, 1e-5, 1e-5)
    # bf16: the collapse may round the other way when the fp32 sums differ in the last bit
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 2**-7)
    assert_close("collapsed", collapsed, ref_collapsed, *tol)
    assert torch.allclose(comb.sum(dim=-2), torch.ones_like(comb.sum(dim=-2)), atol=1e-3)


def test_mhc_pre_result_of_a_row_does_not_depend_on_its_batch(device):
    """A token's mix is computed in the same order whatever else shares the batch."""
    fn, base, scale = _params(4, 320, device)
    x = torch.randn(40, 4, 320, device=device)
    alone = mhc_pre(x[3:4].contiguous(), fn, base, scale, HC_EPS, NORM_EPS, ITERS)
    batched = mhc_pre(x, fn, base, scale, HC_EPS, NORM_EPS, ITERS)
    for a, b in zip(alone, batched):
        assert torch.equal(a[0], b[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hc,hidden", CASES)
def test_mhc_head_matches_the_torch_head_collapse(rows, hc, hidden, dtype, device):
    """The final collapse (hc mix weights, one scale) before the model norm, and a row's result
    does not depend on the other rows (a verification row collapses as a decode row does)."""
    fn = torch.randn(hc, hc * hidden, device=device) * (hc * hidden) ** -0.5
    base, scale = torch.randn(hc, device=device) * 0.5, torch.rand(1, device=device) + 0.5
    x = (torch.randn(rows, hc, hidden, device=device) * 3).to(dtype)
    y = mhc_head(x, fn, base, scale, HC_EPS, NORM_EPS)
    assert y.dtype == dtype and y.shape == (rows, hidden)
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 2**-7)
    assert_close("collapsed", y, hc_head(x, fn, base, scale, HC_EPS, NORM_EPS), *tol)
    assert torch.equal(mhc_head(x[:1].contiguous(), fn, base, scale, HC_EPS, NORM_EPS)[0], y[0])


def test_mhc_pre_of_no_rows_is_empty(device):
    fn, base, scale = _params(2, 64, device)
    post, comb, collapsed = mhc_pre(
        torch.zeros(0, 2, 64, device=device), fn, base, scale, HC_EPS, NORM_EPS, ITERS
    )
    assert post.shape == (0, 2) and comb.shape == (0, 2, 2) and collapsed.shape == (0, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hc,hidden", CASES)
def test_mhc_post_matches_the_torch_mix(rows, hc, hidden, dtype, device):
    fn, base, scale = _params(hc, hidden, device)
    x = torch.randn(rows, hc, hidden, device=device).to(dtype)
    out = torch.randn(rows, hidden, device=device).to(dtype)
    post, comb, _ = hc_pre(x, fn, base, scale, HC_EPS, NORM_EPS, ITERS)
    y = mhc_post(x, out, post, comb)
    # the torch mix rounds each bf16 product and sum; the kernel rounds once
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 2**-6)
    assert_close("streams", y, hc_post(x, out, post, comb), *tol)
