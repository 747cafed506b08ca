"""The Triton bit helpers produce exactly torch's round-to-nearest-even bytes (kernels/bits.py)."""

import torch
import triton
import triton.language as tl

from dsv4ray.cache.layout import to_e4m3_bits, ue8m0_exponent_byte
from dsv4ray.kernels.bits import f32_to_bf16_bits, f32_to_e4m3_bits
from dsv4ray.kernels.bits import ue8m0_exponent_byte as ue8m0_exponent_byte_tl

BLOCK = 1024


@triton.jit
def _encode_kernel(x_ptr, e4m3_ptr, bf16_ptr, ue8m0_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    x = tl.load(x_ptr + i, mask=mask, other=1.0)
    tl.store(e4m3_ptr + i, f32_to_e4m3_bits(x), mask=mask)
    tl.store(bf16_ptr + i, f32_to_bf16_bits(x), mask=mask)
    tl.store(ue8m0_ptr + i, ue8m0_exponent_byte_tl(tl.abs(x)), mask=mask)


def _encode(x: torch.Tensor):
    e4m3 = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    bf16 = torch.empty(x.shape, dtype=torch.uint16, device=x.device)
    ue8m0 = torch.empty(x.shape, dtype=torch.int32, device=x.device)
    _encode_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, e4m3, bf16, ue8m0, x.numel(), BLOCK=BLOCK)
    return e4m3, bf16, ue8m0


def _e4m3_edge_values() -> torch.Tensor:
    # every finite e4m3 value, the midpoints between neighbours and one fp32 ulp either side of them
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (codes[1:] + codes[:-1]) / 2
    near = torch.cat((mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9))))
    beyond = torch.tensor(
        [448.0, 449.0, 464.0, 480.0, 1e6, float("inf"), 2**-10, 2**-30, 1e-42, 0.0]
    )
    values = torch.cat((codes, near, beyond))
    return torch.cat((values, -values))


def test_e4m3_bits_round_to_nearest_even_with_saturation(device):
    x = torch.cat((_e4m3_edge_values(), torch.randn(3000) * torch.logspace(-12, 3, 3000)))
    nan = torch.tensor([float("nan")])
    x = torch.cat((x, torch.tensor([float("inf"), -float("inf")]), nan, -nan))
    e4m3, _, _ = _encode(x.to(device))
    assert e4m3[-4:].tolist() == [0x7E, 0xFE, 0x7E, 0xFE]  # +-inf and NaN saturate by sign
    assert torch.equal(e4m3.cpu(), to_e4m3_bits(x))


def test_bf16_bits_round_to_nearest_even(device):
    random_bits = torch.randint(-(2**31), 2**31 - 1, (20000,), dtype=torch.int32)
    ties = (torch.randint(0, 2**15, (2000,), dtype=torch.int32) << 16) | 0x8000
    x = torch.cat((random_bits, ties, ties | (1 << 16))).view(torch.float32)
    x = torch.cat((x[~torch.isnan(x)], torch.tensor([3.4e38, -3.4e38, 0.0, -0.0, float("nan")])))
    _, bf16, _ = _encode(x.to(device))
    bf16 = bf16.cpu().view(torch.int16)
    assert torch.equal(bf16[:-1], x[:-1].to(torch.bfloat16).view(torch.int16))
    assert torch.isnan(bf16[-1:].view(torch.bfloat16)).all()  # NaN stays NaN (payloads may differ)


def test_ue8m0_exponent_matches_the_reference(device):
    powers = 448.0 * 2.0 ** torch.arange(-30.0, 30)
    x = torch.cat((torch.rand(5000) * torch.logspace(-10, 30, 5000), powers))
    _, _, ue8m0 = _encode(x.to(device))
    assert torch.equal(ue8m0.cpu(), ue8m0_exponent_byte(x))
