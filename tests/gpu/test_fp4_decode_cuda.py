"""The inline PTX that decodes FP4 weights to bf16 on tensor-core paths (`fp4_bf16`), byte for byte
against the loader's dequantisation: every pair of codes, under every scale byte the loader
accepts. The interpreter cannot run PTX, so only a GPU checks its values (its build for sm_90 is
checked on CPU by tests/kernels/test_hopper_build.py)."""

import pytest
import torch
import triton
import triton.language as tl

from dsv4ray.config_quant import FP4_MAX_SCALE_BYTE
from dsv4ray.kernels.quant_tiles import dequantize_ref, fp4_bf16

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@triton.jit
def _decode(byte_ptr, scale_ptr, lo_ptr, hi_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    byte = tl.load(byte_ptr + i, mask=ok, other=0)
    s = tl.load(scale_ptr + i, mask=ok, other=0).to(tl.int32)
    lo, hi = fp4_bf16(byte, s)
    tl.store(lo_ptr + i, lo, mask=ok)
    tl.store(hi_ptr + i, hi, mask=ok)


def test_every_code_pair_under_every_scale_decodes_exactly():
    codes = torch.arange(256, dtype=torch.uint8)  # every byte: every (low, high) code pair
    scales = torch.arange(0, FP4_MAX_SCALE_BYTE + 1, dtype=torch.uint8)
    byte = codes.repeat(len(scales))
    scale = scales.repeat_interleave(len(codes))
    lo = torch.empty(byte.shape, dtype=torch.bfloat16, device="cuda")
    hi = torch.empty_like(lo)
    _decode[(triton.cdiv(byte.numel(), 1024),)](byte.cuda(), scale.cuda(), lo, hi, byte.numel(),
                                                BLOCK=1024)  # fmt: skip
    # one row per byte: its two values under its own scale (32 values share a scale in a weight)
    rows = byte.view(-1, 1).repeat(1, 16)  # [n, 16] bytes -> 32 values
    want = dequantize_ref(rows, scale.view(-1, 1).view(torch.float8_e8m0fnu), "fp4")[:, :2]
    want = want.to(torch.bfloat16)
    assert torch.equal(lo.cpu().view(torch.int16), want[:, 0].contiguous().view(torch.int16))
    assert torch.equal(hi.cpu().view(torch.int16), want[:, 1].contiguous().view(torch.int16))
