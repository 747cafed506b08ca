"""The weight-only FP8 linear against its torch reference, and the reference against the loader's
dequantisation (model/quant.py), over decode and prefill row counts, ragged shapes and both scale
formats."""

import pytest
import torch

from dsv4ray.kernels import fp8_linear as fp8
from dsv4ray.kernels import quant_tiles
from dsv4ray.kernels.quant_tiles import dequantize_ref
from dsv4ray.kernels.testing import assert_close
from dsv4ray.model.quant import QuantizedWeight, quantize_fp8

N, K = 200, 300  # neither a multiple of the 128 x 128 scale block


def _weight(rows, cols, scale_fmt, block=(128, 128), device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * cols**-0.5
    codes, scale = quantize_fp8(w, block, scale_fmt)
    return codes.to(device), scale.to(device)


def _fp32_tolerance(x, weight, scale, block):
    """A fp32 sum of K products reordered: a few ulps of the sum of |terms|."""
    w = QuantizedWeight("w", weight.cpu(), scale.cpu(), "fp8", block).dequantize()
    bound = x.float().abs().cpu() @ w.abs().t()
    return 1e-6 * bound.max().item() + 1e-6


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
@pytest.mark.parametrize("num_rows", [1, 5, 40, 130])  # each tile bucket
def test_fp8_linear_matches_reference(num_rows, scale_fmt, device):
    weight, scale = _weight(N, K, scale_fmt, device=device)
    x = torch.randn(num_rows, K, device=device)
    ref = fp8.fp8_linear_ref(x, weight, scale)
    atol = _fp32_tolerance(x, weight, scale, (128, 128))
    assert_close("fp8_linear", fp8.fp8_linear(x, weight, scale), ref, atol, 0)


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_reference_is_the_loaders_dequantisation(scale_fmt):
    weight, scale = _weight(N, K, scale_fmt)
    w = QuantizedWeight("w", weight, scale, "fp8").dequantize()
    assert torch.equal(dequantize_ref(weight, scale, "fp8"), w)  # the same decode, exactly
    x = torch.randn(7, 2 * K)
    atol = _fp32_tolerance(x.view(-1, K), weight, scale, (128, 128))
    assert_close("plain", fp8.fp8_linear_ref(x[:, :K], weight, scale), x[:, :K] @ w.t(), atol, 0)
    # two groups: block-diagonal, rows [g N/2, (g+1) N/2) applied to input block g
    grouped = fp8.fp8_linear_ref(x, weight, scale, groups=2)
    assert_close("group 0", grouped[:, : N // 2], x[:, :K] @ w[: N // 2].t(), atol, 0)
    assert_close("group 1", grouped[:, N // 2 :], x[:, K:] @ w[N // 2 :].t(), atol, 0)


@pytest.mark.parametrize("num_rows", [5, 40])  # the two decode buckets' 16-bit tiles
@pytest.mark.parametrize("split", ["auto", "one"])
def test_grouped_bf16_and_unsplit(split, num_rows, device, monkeypatch):
    """Two groups (the grouped output projection), bf16 activations, small scale blocks; with one
    K split the kernel stores bf16 itself (rounded to nearest even as bits)."""
    if split == "one":
        monkeypatch.setattr(quant_tiles, "num_splits", lambda *args: 1)
    block = (64, 32)
    weight, scale = _weight(2 * 72, 96, "ue8m0", block, device)
    x = torch.randn(num_rows, 2 * 96, device=device).to(torch.bfloat16)
    out = fp8.fp8_linear(x, weight, scale, block, groups=2)
    ref = fp8.fp8_linear_ref(x, weight, scale, block, groups=2)
    assert out.dtype == torch.bfloat16
    # the fp32 sums differ by reordering only: at most one bf16 rounding step apart
    assert_close("fp8_linear bf16", out, ref, 1e-5, 2**-8)


def test_decode_rows_split_k(device):
    """Few output tiles split K across programs (fp32 partials summed after)."""
    weight, scale = _weight(64, 1000, "float", device=device)
    tiles = fp8.tiles(1)
    assert quant_tiles.split_k(1, 1000, tiles["BLOCK_K"], torch.device(device))[1] > 1
    x = torch.randn(1, 1000, device=device)
    ref = fp8.fp8_linear_ref(x, weight, scale)
    assert_close("split-k", fp8.fp8_linear(x, weight, scale), ref,
                 _fp32_tolerance(x, weight, scale, (128, 128)), 0)  # fmt: skip


def test_no_rows(device):
    weight, scale = _weight(N, K, "ue8m0", device=device)
    out = fp8.fp8_linear(torch.zeros(0, K, device=device), weight, scale)
    assert out.shape == (0, N)


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
@pytest.mark.parametrize("groups,block", [(1, (128, 128)), (2, (100, 128))])
def test_prefill_rows_multiply_the_dequantised_weight(groups, block, scale_fmt, device):
    """From DEQUANT_ROWS rows of bf16 x on, the linear is the dequantised model's: the weight
    decoded to bf16 as the loader decodes it, then F.linear (the grouped output projection: one
    batched GEMM over the groups), bit for bit."""
    weight, scale = _weight(N, K, scale_fmt, block, device=device)
    w = QuantizedWeight("w", weight, scale, "fp8", block).dequantize(torch.bfloat16)
    x = torch.randn(fp8.DEQUANT_ROWS, groups * K, device=device).bfloat16()
    got = fp8.fp8_linear(x, weight, scale, block, groups)
    if groups == 1:
        want = torch.nn.functional.linear(x, w)
    else:
        rows = N // groups
        y = torch.bmm(x.view(-1, groups, K).transpose(0, 1), w.view(groups, rows, K).mT)
        want = y.transpose(0, 1).reshape(x.shape[0], -1)
    assert torch.equal(got, want)
