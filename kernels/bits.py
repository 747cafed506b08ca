"""Bit-exact number encodings for Triton kernels, and the tl.dot precision policy.

The Triton interpreter (CPU tests) truncates fp32 -> bf16 and mis-rounds fp32 -> fp8, so stored bf16
and fp8 values are computed here as integer bits with round-to-nearest-even; cache/layout.py's torch
conversions give the same bytes. Decoding (fp8 / bf16 / ue8m0 -> fp32) is exact everywhere: fp8
decodes with a plain cast, bf16 and ue8m0 by placing their bits in an fp32.
"""

import functools
import os

import torch
import triton
import triton.language as tl

F32_ABS_MASK = tl.constexpr(0x7FFFFFFF)
E4M3_MAX_BITS = tl.constexpr(0x43E00000)  # 448.0 as fp32 bits
E4M3_MIN_NORMAL_BITS = tl.constexpr(0x3C800000)  # 2^-6, the smallest normal e4m3 value


def interpreting() -> bool:
    """True when kernels run under the Triton interpreter (CPU tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def f32_to_bf16_bits(x):
    """fp32 -> bf16 bits (uint16), round-to-nearest-even; NaN -> the quiet NaN 0x7FC0."""
    b = x.to(tl.uint32, bitcast=True)
    rounded = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    is_nan = (b & F32_ABS_MASK) > 0x7F800000
    return tl.where(is_nan, 0x7FC0, rounded).to(tl.uint16)


@triton.jit
def f32_to_e4m3_bits(x):
    """fp32 -> fp8 e4m3fn bits (uint8), round-to-nearest-even, saturating to +-448 (NaN too).

    Normal results drop 20 mantissa bits and rebias the exponent (127 -> 7). Subnormal results
    (|x| < 2^-6) are |x| / 2^-9 rounded to an integer: the 24-bit significand shifted right by
    141 - exponent field, capped at 31 (which rounds every smaller value to 0).
    """
    b = x.to(tl.uint32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = tl.minimum(b & F32_ABS_MASK, E4M3_MAX_BITS)
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    shift = tl.minimum(141 - (a >> 23), 31)
    significand = (a & 0x7FFFFF) | 0x800000
    half_minus_one = (1 << (shift - 1)) - 1
    subnormal = (significand + half_minus_one + ((significand >> shift) & 1)) >> shift
    magnitude = tl.where(a >= E4M3_MIN_NORMAL_BITS, normal, subnormal)
    return (magnitude | sign).to(tl.uint8)


@triton.jit
def store_rounded(ptr, offs, x, mask, OUT_BF16: tl.constexpr):
    """Stores fp32 x at ptr + offs in ptr's dtype; bf16 as round-to-nearest-even bits (ptr is a
    bf16 pointer then), anything else with a plain cast."""
    if OUT_BF16:
        tl.store(ptr.to(tl.pointer_type(tl.uint16)) + offs, f32_to_bf16_bits(x), mask=mask)
    else:
        tl.store(ptr + offs, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def ue8m0_exponent_byte(amax):
    """e + 127 with e = ceil(log2(amax / 448)) for positive normal fp32 amax (int32).

    amax = 1.m * 2^E and 448 = 1.75 * 2^8, so e = E - 8 + (1.m > 1.75): exact, no log2 or division.
    """
    b = amax.to(tl.int32, bitcast=True)
    return ((b >> 23) & 0xFF) - 8 + ((b & 0x7FFFFF) > 0x600000).to(tl.int32)


@triton.jit
def pow2_from_byte(exp_byte):
    """2^(byte - 127) as fp32 for int32 bytes in [1, 254]."""
    return (exp_byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def bf16_bits_to_f32(bits):
    """bf16 bits (uint16) -> fp32 (exact)."""
    return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; the interpreter pretends to be an H100/H200 (132), so CPU
    tests take the same grid decisions."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def use_bf16_mma(dtype: str) -> bool:
    """Whether dots over pages of format `dtype` run with bf16 operands (see `mma`)."""
    return dtype != "fp32" and not interpreting()


@triton.jit
def mma_operand(x, BF16_MMA: tl.constexpr):
    """x in the operand dtype of `mma`: convert a loop-invariant operand once, outside the loop."""
    if BF16_MMA:
        y = x.to(tl.bfloat16)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def mma(a, b, BF16_MMA: tl.constexpr):
    """a [M, K] @ b [K, N] with fp32 accumulation.

    BF16_MMA: bf16 operands on tensor cores (dequantised fp8 and bf16 page values are exact in bf16,
    so only the other operand is rounded); otherwise exact fp32 ("ieee"). `use_bf16_mma` picks it:
    never for fp32 pages, and never under the interpreter, whose bf16 dot multiplies the raw bits.
    """
    if BF16_MMA:
        out = tl.dot(mma_operand(a, BF16_MMA), mma_operand(b, BF16_MMA))
    else:
        out = tl.dot(a, b, input_precision="ieee")
    return out
