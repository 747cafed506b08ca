"""The few-row linear against its torch reference (fp32 and bf16, ragged shapes), its
batch invariance (a row's bits do not depend on how many rows share the call), and the ops layer
binding it to a block's dense linears."""

import pytest
import torch

from dsv4ray.kernels import small_linear as sl
from dsv4ray.kernels.testing import assert_close


def _operands(rows, n, k, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype).to(device)
    return x, w


def _sum_bound(x, w):
    """The largest sum of |products| of an output: reordered fp32 sums differ by ulps of it."""
    return (x.float().abs().cpu() @ w.float().abs().cpu().t()).max().item()


@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("n,k", [(200, 130), (1024, 64)], ids=["ragged", "wide"])
def test_fp32_matches_reference(rows, n, k, device):
    x, w = _operands(rows, n, k, torch.float32, device)
    out = sl.small_linear(x, w)
    atol = 4e-7 * _sum_bound(x, w)
    assert_close("small_linear fp32", out, sl.small_linear_ref(x, w), atol, 0)


def test_bf16_is_the_fp32_sum_rounded(device):
    """bf16 results: the fp32 sum rounded to nearest even, so within one bf16 ulp of the
    reference's rounding of its own (reordered) fp32 sum."""
    x, w = _operands(5, 72, 200, torch.bfloat16, device)
    out = sl.small_linear(x, w)
    assert out.dtype == torch.bfloat16
    ref = sl.small_linear_ref(x, w)
    assert_close("small_linear bf16", out, ref, 4e-7 * _sum_bound(x, w), 2.0**-8)


def test_a_rows_bits_do_not_depend_on_the_other_rows(device):
    """Row i of an M-row call equals the one-row call of row i bit for bit, for every M up to 16,
    whatever the other rows hold: verification rows compute what decode rows compute."""
    x, w = _operands(16, 96, 160, torch.float32, device)
    full = sl.small_linear(x, w)
    for rows in (1, 2, 4, 7, 16):
        assert torch.equal(sl.small_linear(x[:rows], w), full[:rows]), rows
    noisy = x.clone()
    noisy[1:] = noisy[1:] * 1e3
    assert torch.equal(sl.small_linear(noisy, w)[0], full[0])


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("groups,n,k", [(2, 64, 512), (4, 24, 40)], ids=["wo_a", "ragged"])
def test_grouped_matches_the_block_diagonal_reference(rows, groups, n, k, device):
    """groups > 1: output column n reads its own group's slice of x (the attention's grouped
    output projection), and a row's bits do not depend on the other rows."""
    x, w = _operands(rows, n, groups * k, torch.float32, device)
    w = w[:, :k].contiguous()
    out = sl.small_linear(x, w, groups)
    ref = sl.small_linear_ref(x, w, groups)
    rows_per = n // groups
    per_group = torch.cat([x[:, g * k : (g + 1) * k] @ w[g * rows_per : (g + 1) * rows_per].t()
                           for g in range(groups)], dim=1)  # fmt: skip
    assert_close("grouped reference", ref, per_group, 1e-5, 1e-5)
    assert_close("small_linear grouped", out, ref, 4e-7 * _sum_bound(x, x.new_ones(1, groups * k)
                                                                   * w.abs().max()), 0)  # fmt: skip
    assert torch.equal(sl.small_linear(x[:1], w, groups)[0], out[0])
    with pytest.raises(ValueError, match="group"):
        sl.small_linear(x[:, :k], w, groups)


def test_refuses_what_it_cannot_compute(device):
    x, w = _operands(17, 32, 32, torch.float32, device)
    with pytest.raises(ValueError, match="<= 16 rows"):
        sl.small_linear(x, w)
    with pytest.raises(ValueError, match="weight's dtype"):
        sl.small_linear(x[:2], w.to(torch.bfloat16))
    with pytest.raises(ValueError, match="does not match"):
        sl.small_linear(x[:2, :16], w)
    long_k = torch.zeros(2, sl.MAX_K + 1, device=device)
    assert not sl.fits(long_k, torch.zeros(4, sl.MAX_K + 1, device=device))


def test_bound_linears_take_few_rows_in_the_kernel_and_more_in_torch(device):
    from torch import nn

    from dsv4ray.kernels import dispatch
    from dsv4ray.worker import ops

    layer = nn.Linear(96, 40, bias=False).to(device)
    with dispatch.use_backend("torch"):
        assert ops.bind_few_row_kernels(nn.Sequential(layer)) == 0
    with dispatch.use_backend("triton"):  # GPU weights only: CPU ones stay on torch
        bound = ops.bind_few_row_kernels(nn.Sequential(layer, nn.ReLU()))
    assert bound == (1 if device.type == "cuda" else 0)
    forward = ops._few_rows(layer.weight)  # what a bound layer runs
    x = torch.randn(3, 5, 96, device=device)  # 15 rows
    out = forward(x)
    assert out.shape == (3, 5, 40)
    assert torch.equal(out.reshape(15, 40), sl.small_linear(x.reshape(15, 96), layer.weight))
    many = torch.randn(17, 96, device=device)
    assert torch.equal(forward(many), torch.nn.functional.linear(many, layer.weight))
    if bound:
        assert torch.equal(layer(x), out)
