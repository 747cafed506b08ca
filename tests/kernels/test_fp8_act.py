"""FP8 activations (kernels/fp8_act.py): the quantisation's bytes against torch's, the FP8 x FP8
linear against its torch reference over ragged, grouped, empty and one-row calls, and against the
bf16-activation linear within FP8's rounding."""

import pytest
import torch

from dsv4ray.kernels import fp8_act
from dsv4ray.kernels import fp8_linear as fp8
from dsv4ray.kernels.quant_tiles import dequantize_ref
from dsv4ray.kernels.testing import assert_close
from dsv4ray.model.quant import quantize_fp8


def _weight(rows, cols, scale_fmt="ue8m0", block=(128, 128), device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * cols**-0.5
    codes, scale = quantize_fp8(w, block, scale_fmt)
    return codes.to(device), scale.to(device)


def test_quantize_bytes_equal_torch(device):
    """Every e4m3 rounding case: values spread over many binades, exact ties, zeros, an all-zero
    group, huge and tiny groups, a ragged last group."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 300, generator=g) * torch.logspace(-6, 6, 300)
    x = x.to(device)
    x[1, :128] = 0.0  # an all-zero group
    ties = torch.tensor([448.0, 464.0, 1.0 + 2**-4, 1.0 + 3 * 2**-4, 2**-9, 3 * 2**-10])
    x[2] = ties.repeat(50).to(device)
    x[3, 128:256] *= 1e30
    x[4, :] = -x[4, :]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        xd = x.to(dtype).to(device)
        q, e = fp8_act.quantize_act(xd)
        q_ref, e_ref = fp8_act.quantize_act_ref(xd)
        assert torch.equal(e.cpu(), e_ref.cpu()), dtype
        assert torch.equal(q.cpu(), q_ref.cpu()), dtype
    back = fp8_act.dequantize_act_ref(q_ref, e_ref)
    # e4m3 keeps 3 mantissa bits; below 2^-6 of its scale a value rounds to a multiple of 2^-9
    scale = torch.exp2(e_ref.float() - 127).repeat_interleave(128, dim=1)[:, :300]
    err = (back - x.float()).abs()
    assert (err <= 2**-4 * x.float().abs() + 2**-10 * scale).all()


@pytest.mark.parametrize(
    "num_rows, n, k, groups, block",
    [
        (130, 200, 384, 1, (128, 128)),  # ragged N, three K steps
        (1, 64, 256, 1, (128, 128)),
        (300, 96, 130, 1, (64, 256)),  # ragged K (a partial activation group), tall scale blocks
        (70, 128, 256, 2, (128, 128)),  # grouped (wo_a)
    ],
)
def test_fp8_act_linear_matches_reference(num_rows, n, k, groups, block, device):
    weight, scale = _weight(groups * n, k, block=block, device=device)
    x = (torch.randn(num_rows, groups * k) * 3).to(torch.bfloat16).to(device)
    got = fp8_act.fp8_act_linear(x, weight, scale, block, groups)
    ref = fp8_act.fp8_act_linear_ref(x, weight, scale, block, groups)
    # the same products summed in another order (on Hopper in the FP8 MMA's own accumulator
    # within each K step), then one bf16 rounding each: one bf16 ulp apart where they straddle
    w_max = dequantize_ref(weight.cpu(), scale.cpu(), "fp8", block).abs().max()
    bound = x.float().abs().sum(1).max().item() * w_max.item()
    assert_close("fp8_act_linear", got.float(), ref.float(), 1e-4 * bound, 2**-7)
    dense = fp8.fp8_linear(x, weight, scale, block, groups, act_fp8=False)
    atol = 0.05 * dense.abs().max().item()
    assert_close("vs bf16 activations", got.float(), dense.float(), atol, 0.1)


def test_no_rows_and_refusals(device):
    weight, scale = _weight(64, 256, device=device)
    x = torch.zeros(0, 256, dtype=torch.bfloat16, device=device)
    assert fp8_act.fp8_act_linear(x, weight, scale).shape == (0, 64)
    q, e = fp8_act.quantize_act(x)
    assert q.shape == (0, 256) and e.shape == (0, 2)
    q_ref, e_ref = fp8_act.quantize_act_ref(x)
    assert torch.equal(q.cpu(), q_ref.cpu()) and torch.equal(e.cpu(), e_ref.cpu())
    with pytest.raises(ValueError, match="bf16 or fp16"):
        fp8_act.fp8_act_linear(torch.zeros(4, 256, device=device), weight, scale)
    weight, scale = _weight(64, 256, block=(64, 64), device=device)
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8.fp8_linear(x, weight, scale, (64, 64), act_fp8=True)


def test_auto_takes_fp8_activations_for_prefill_calls_on_fp8_gpus(device):
    """fp8_linear with act_fp8=None (EngineConfig.fp8_prefill): decode buckets keep bf16
    activations; larger calls quantise theirs where the GPU has FP8 tensor cores (never under
    the interpreter); the default never does."""
    weight, scale = _weight(64, 256, device=device)
    x = torch.randn(65, 256, dtype=torch.bfloat16, device=device)
    plain = fp8.fp8_linear(x, weight, scale, act_fp8=False)
    assert torch.equal(fp8.fp8_linear(x, weight, scale), plain)
    auto = fp8.fp8_linear(x, weight, scale, act_fp8=None)
    if fp8_act.supported(x.device):
        assert torch.equal(auto, fp8_act.fp8_act_linear(x, weight, scale))
    else:
        assert torch.equal(auto, plain)
    few = fp8.fp8_linear(x[:64], weight, scale, act_fp8=None)
    assert torch.equal(few, fp8.fp8_linear(x[:64], weight, scale, act_fp8=False))
