"""FP8 activations for prefill-sized linears: x quantised per 1 x group block, FP8 x FP8 products.

    quantize_act(x [M, C]) -> (q [M, C] e4m3 bytes, e [M, ceil(C / group)] ue8m0 bytes)
    x ~= q * 2^(e - 127) per group of `group` consecutive columns of a row (ACT_GROUP = 128)
    fp8_act_linear(x, weight [G N, K], scale, block, groups) -> [M, G N] in x's dtype

A group's scale is the power of two 2^ceil(log2(amax / 448)) (amax floored at 1e-10), so x * 2^-e
is exact and the only rounding is each value's to e4m3 (nearest even), which the kernel computes
as integer bits (kernels/bits.py): the interpreter's bytes equal torch's. The GEMM multiplies e4m3
tiles of x and of the weight on FP8 tensor cores (Hopper and Ada: twice the bf16 rate, and no
widening of the weight in registers), fp32 accumulation, each K step of `group` columns scaled by
its row's activation scale and the weight block's scale; the K step equals the activation group
and divides the weight's scale block, so one K step never crosses either. Rows are quantised
independently, so a row's result does not depend on the other rows of the call.

Where cuBLAS has DeepSeek's block-scaled FP8 GEMM (Hopper; torch's `_scaled_mm` with 1 x 128
activation and 128 x 128 weight scales), `fp8_act_linear` multiplies there after quantising x here
(a development sweep at V4-Flash's linear shapes on an H200, 8192 rows: its GEMMs take 0.63-0.78x
the time of cuBLAS's bf16 GEMMs on the dequantised weights, this module's Triton GEMM 1.9-3.5x;
the quantisation pass adds 0.09-0.15 ms a call); the Triton GEMM serves the other GPUs, other
scale blocks and the CPU tests. Both compute the same products in fp32 with one scale
per K step of 128.

`fp8_act_linear_ref` is the torch reference: both operands dequantised to fp32, one fp32 matmul.
"""

import logging

import torch
import triton
import triton.language as tl

from dsv4ray.cache.layout import pow2_from_byte, to_e4m3_bits, ue8m0_exponent_byte
from dsv4ray.cache.page_layout import AMAX_FLOOR
from dsv4ray.kernels import bits
from dsv4ray.kernels.bits import f32_to_e4m3_bits, interpreting, store_rounded
from dsv4ray.kernels.quant_tiles import dequantize_ref, kernel_bytes, load_scale, scale_shape

log = logging.getLogger("dsv4ray.kernels")

ACT_GROUP = 128  # columns of a row sharing one activation scale, and the GEMM's K step
GROUPS_PER_PROGRAM = 8  # activation groups one quantisation program handles
SMALL_M = 256  # calls of at most this many rows take 64-row tiles (more programs)
AMAX_FLOOR_TL = tl.constexpr(AMAX_FLOOR)


@triton.jit(do_not_specialize=["num_rows"])
def _quantize_kernel(
    x_ptr,
    q_ptr,
    e_ptr,
    num_rows,
    cols,
    stride_xm,
    num_groups,
    GROUP: tl.constexpr,
    GROUPS: tl.constexpr,
):
    # program (row, block of GROUPS groups): q[row, group cols] and e[row, group]
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    c = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    ok = c < cols
    x = tl.load(x_ptr + row * stride_xm + c, mask=ok, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), AMAX_FLOOR_TL)
    e = bits.ue8m0_exponent_byte(amax)
    q = x * bits.pow2_from_byte(254 - e)[:, None]  # x * 2^-e, exact
    tl.store(q_ptr + row * cols + c, f32_to_e4m3_bits(q), mask=ok)
    tl.store(e_ptr + row * num_groups + g, e.to(tl.uint8), mask=g < num_groups)


@triton.jit(do_not_specialize=["num_rows"])
def _fp8_act_kernel(
    q_ptr,
    e_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    num_rows,
    N,
    K,
    num_groups,
    stride_sn,
    block_n,
    block_k,
    SCALE_BYTES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    # program (m tile, n tile, group g): out[m, g N + n] = q[m, g K:(g+1) K] . W[g N + n]
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(2).to(tl.int64)
    m_ok, n_ok = m < num_rows, n < N
    width = tl.num_programs(2) * K  # G K: a row of q
    q_rows = q_ptr + m.to(tl.int64)[:, None] * width + g * K
    e_rows = e_ptr + m.to(tl.int64) * num_groups + g * (K // BLOCK_K)
    w_rows = g * N + n  # rows of the whole [G N, K] weight
    s_rows = s_ptr + (w_rows // block_n) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(q_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0)
        w = tl.load(w_ptr + w_rows[None, :] * K + k[:, None], mask=n_ok[None, :] & k_ok[:, None],
                    other=0)  # fmt: skip
        a = a.to(tl.float8e4nv, bitcast=True)
        w = w.to(tl.float8e4nv, bitcast=True)
        if IEEE:  # the interpreter: e4m3 -> fp32 is exact
            d = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            d = tl.dot(a, w)
        e = tl.load(e_rows + k0 // BLOCK_K, mask=m_ok, other=127).to(tl.int32)
        sw = load_scale(s_rows + k0 // block_k, n_ok, SCALE_BYTES)
        acc += d * bits.pow2_from_byte(e)[:, None] * sw[None, :]
    offs = m.to(tl.int64)[:, None] * (tl.num_programs(2) * N) + w_rows[None, :]
    store_rounded(out_ptr, offs, acc, m_ok[:, None] & n_ok[None, :], OUT_BF16)


def supported(device: torch.device) -> bool:
    """FP8 tensor cores: CUDA compute capability 8.9 (Ada) or 9.0+ (Hopper)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fits(x: torch.Tensor, k: int, block: tuple[int, int], groups: int) -> bool:
    """Whether fp8_act_linear takes x [M, G K] with weight scale blocks `block`: 16-bit x, scale
    blocks a multiple of ACT_GROUP columns, and with several groups K a multiple of ACT_GROUP (so
    no activation group spans two weight groups)."""
    aligned = groups == 1 or k % ACT_GROUP == 0
    return x.dtype in (torch.bfloat16, torch.float16) and block[1] % ACT_GROUP == 0 and aligned


def quantize_act(x: torch.Tensor, group: int = ACT_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring: (q [M, C] uint8 e4m3 bytes, e [M, cdiv(C, group)] uint8)."""
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    num_rows, cols = x.shape
    num_groups = triton.cdiv(cols, group)
    q = torch.empty(num_rows, cols, dtype=torch.uint8, device=x.device)
    e = torch.empty(num_rows, num_groups, dtype=torch.uint8, device=x.device)
    if num_rows:
        grid = (num_rows, triton.cdiv(num_groups, GROUPS_PER_PROGRAM))
        _quantize_kernel[grid](x, q, e, num_rows, cols, x.stride(0), num_groups, GROUP=group,
                               GROUPS=GROUPS_PER_PROGRAM)  # fmt: skip
    return q, e


def quantize_act_ref(x: torch.Tensor, group: int = ACT_GROUP):
    """The torch reference of `quantize_act` (the same bytes)."""
    num_rows, cols = x.shape
    num_groups = triton.cdiv(cols, group)
    xf = torch.nn.functional.pad(x.float(), (0, num_groups * group - cols))
    xf = xf.view(num_rows, num_groups, group)
    e = ue8m0_exponent_byte(xf.abs().amax(-1).clamp_min(AMAX_FLOOR))
    q = to_e4m3_bits(xf * pow2_from_byte(254 - e)[..., None])
    q = q.reshape(num_rows, num_groups * group)[:, :cols]  # reshape: 0 rows too
    return q.contiguous(), e.to(torch.uint8)


def dequantize_act_ref(q: torch.Tensor, e: torch.Tensor, group: int = ACT_GROUP) -> torch.Tensor:
    """(q, e) from `quantize_act` -> fp32 [M, C]."""
    scale = pow2_from_byte(e.to(torch.int32)).repeat_interleave(group, dim=1)
    return q.view(torch.float8_e4m3fn).float() * scale[:, : q.shape[1]]


def _check(x, weight, scale, block, groups) -> tuple[int, int]:
    assert weight.dim() == 2 and weight.is_contiguous() and weight.element_size() == 1
    assert scale.is_contiguous(), scale.stride()
    rows, k = weight.shape
    assert rows % groups == 0 and x.shape[1] == groups * k, (x.shape, weight.shape, groups)
    assert tuple(scale.shape) == scale_shape("fp8", rows, k, block), (scale.shape, weight.shape)
    if not fits(x, k, block, groups):
        raise ValueError(f"FP8 activations need bf16 or fp16 x and scale blocks of a multiple of "
                         f"{ACT_GROUP} columns: x {x.dtype}, block {block}, {groups} groups of "
                         f"{k} columns")  # fmt: skip
    return rows // groups, k


def tiles(num_rows: int) -> dict:
    """128 x 128 output tiles (64 x 128 for calls of at most SMALL_M rows, which else leave
    most SMs idle), K steps of one activation group."""
    block_m = 64 if num_rows <= SMALL_M else 128
    return dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=ACT_GROUP, num_warps=8, num_stages=3)


def fp8_act_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    groups: int = 1,
) -> torch.Tensor:
    """See the module docstring (weight and scale as kernels/fp8_linear.py takes them)."""
    n, k = _check(x, weight, scale, block, groups)
    num_rows = x.shape[0]
    out = torch.empty(num_rows, groups * n, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    q, e = quantize_act(x)
    if _cublas_blockwise(x.device, block, n, k, groups):
        try:
            return _cublas(q, e, weight, scale, n, k, groups, x.dtype, out)
        except RuntimeError as exc:  # this torch / cuBLAS has no block-scaled FP8 GEMM
            _CUBLAS[x.device] = False
            log.info("FP8 prefill GEMMs run in Triton: cuBLAS block scaling unavailable (%s)",
                     str(exc).splitlines()[0][:200])  # fmt: skip
    t = tiles(num_rows)
    grid = (triton.cdiv(num_rows, t["BLOCK_M"]), triton.cdiv(n, t["BLOCK_N"]), groups)
    _fp8_act_kernel[grid](
        q,
        e,
        kernel_bytes(weight),
        kernel_bytes(scale),
        out,
        num_rows,
        n,
        k,
        e.shape[1],
        scale.shape[1],
        block[0],
        block[1],
        SCALE_BYTES=scale.element_size() == 1,
        IEEE=interpreting(),
        OUT_BF16=x.dtype == torch.bfloat16,
        **t,
    )
    return out


_CUBLAS: dict[torch.device, bool] = {}  # device -> cuBLAS block-scaled FP8 GEMMs work there


def _cublas_blockwise(device: torch.device, block, n: int, k: int, groups: int) -> bool:
    """Whether a call goes to cuBLAS: Hopper or newer, 128 x 128 weight blocks, K a multiple of
    128 (and N too with several groups, so each group's scale rows are its own), and no earlier
    call found it missing."""
    if device.type != "cuda" or interpreting() or tuple(block) != (128, 128) or k % 128:
        return False
    if groups > 1 and n % 128:
        return False
    return _CUBLAS.setdefault(device, torch.cuda.get_device_capability(device) >= (9, 0))


def _cublas(q, e, weight, scale, n: int, k: int, groups: int, dtype, out) -> torch.Tensor:
    """out [M, G N] = per group (q e) @ (weight scale)^T on cuBLAS: activation scales [M, K / 128]
    and weight scales [K / 128, N / 128] as fp32, both column-major, as cuBLAS takes them."""
    sa = pow2_from_byte(e.to(torch.int32))  # [M, G K / 128]
    sw = pow2_from_byte(scale.view(torch.uint8).to(torch.int32)) if scale.element_size() == 1 \
        else scale.float()  # fmt: skip
    a, w = q.view(torch.float8_e4m3fn), weight.view(torch.float8_e4m3fn)
    kb, nb = k // 128, triton.cdiv(n, 128)
    for g in range(groups):
        a_g = a[:, g * k : (g + 1) * k] if groups == 1 else a[:, g * k : (g + 1) * k].contiguous()
        sa_g = sa[:, g * kb : (g + 1) * kb].t().contiguous().t()
        sw_g = sw[g * nb : (g + 1) * nb].contiguous().t()
        y = torch._scaled_mm(a_g, w[g * n : (g + 1) * n].t(), scale_a=sa_g, scale_b=sw_g,
                             out_dtype=dtype)  # fmt: skip
        if groups == 1:
            return y
        out[:, g * n : (g + 1) * n] = y
    return out


def fp8_act_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    groups: int = 1,
) -> torch.Tensor:
    """The torch reference: x quantised as `quantize_act_ref` does, both operands dequantised to
    fp32, each group multiplied in fp32, the result cast to x's dtype."""
    n, k = _check(x, weight, scale, block, groups)
    xq = dequantize_act_ref(*quantize_act_ref(x))
    w = dequantize_ref(weight, scale, "fp8", block).view(groups, n, k)
    y = torch.bmm(xq.view(-1, groups, k).transpose(0, 1), w.transpose(1, 2))  # [G, M, N]
    return y.transpose(0, 1).reshape(x.shape[0], groups * n).to(x.dtype)
