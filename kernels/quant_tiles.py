"""Block-scaled weight tiles decoded in registers, and the torch decode they are tested against.

Weight formats (a weight is [N, K]: N output rows, K input columns; kernels take every 1-byte
tensor as uint8 bytes):

- dense: the values themselves (bf16, fp16 or fp32).
- fp8: e4m3 bytes [N, K] with one scale per (block_n x block_k) block, scale [ceil(N /
  block_n), ceil(K / block_k)], either fp32 or ue8m0 exponent bytes (b means 2^(b - 127), b in
  [1, 254]). Value = e4m3 * scale.
- fp4: e2m1 codes packed two per byte [N, K / 2], the even column in the LOW nibble; one ue8m0
  byte per 32 values of a row, scale [N, K / 32]. Value = e2m1 * scale. Code bits: sign (3),
  exponent (2..1), mantissa (0): 0, 0.5, 1, 1.5, 2, 3, 4, 6. On tensor cores the kernels decode
  codes scaled by 2^-126 (bf16 bits, `fp4_bf16`) and take 2^126 into the bf16 scale, so they
  cover scale bytes up to FP4_MAX_SCALE_BYTE (128, 2^1; the loader rejects larger ones: no
  trained weight comes near).

`weight_dot` multiplies an activation tile by one K step of a weight tile, in fp32. FP8 runs the dot
on the unscaled e4m3 numbers (exact in bf16 and fp16) and scales the [BLOCK_M, BLOCK_N] product by
the block's scale, so a K step must not cross a scale block (BLOCK_K divides block_k). FP4 decodes
value * scale (exact in bf16: two significant bits times a power of two) and splits the activations
into even and odd columns, so each nibble multiplies its own column without interleaving.
"""

import math

import torch
import triton
import triton.language as tl

from dsv4ray.kernels.bits import num_sms, pow2_from_byte, store_rounded

FORMATS = {"dense": 0, "fp8": 1, "fp4": 2}  # the kernels' FMT argument
FMT_FP8 = tl.constexpr(FORMATS["fp8"])
FP4_GROUP = 32  # values of a row sharing one ue8m0 scale
FP4_GROUP_C = tl.constexpr(FP4_GROUP)  # the same, as kernels read it
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@triton.jit
def e2m1_scaled_down(byte, HIGH: tl.constexpr):
    """The e2m1 codes in the low (or, with HIGH, the high) nibbles of int32 bytes -> their values
    times 2^-14, as fp32. The code's exponent and mantissa bits become an fp16's exponent bits
    11..10 and mantissa bit 9, its sign the fp16's sign: with fp16's exponent bias of 15 against
    e2m1's 1, every code, the subnormal 0.5 included, is exactly its value times 2^-14 (four
    integer operations and two conversions per value)."""
    if HIGH:
        bits = ((byte & 0x70) << 5) | ((byte & 0x80) << 8)
    else:
        bits = ((byte & 0x7) << 9) | ((byte & 0x8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def load_scale(ptrs, mask, SCALE_BYTES: tl.constexpr):
    """Scales at ptrs -> fp32 (ue8m0 bytes when SCALE_BYTES, else fp32); 0 where masked."""
    if SCALE_BYTES:
        byte = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
        out = tl.where(mask, pow2_from_byte(byte), 0.0)
    else:
        out = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return out


@triton.jit
def dot_f32(a, b, IEEE: tl.constexpr):
    """a [M, K] @ b [K, N] with fp32 accumulation: exact fp32 operands (fp32 models, and the
    interpreter, whose 16-bit dot multiplies raw bits), else b in a's 16-bit type on tensor
    cores."""
    if IEEE:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b.to(a.dtype))
    return out


@triton.jit
def times_x(x, w, SWAP: tl.constexpr, IEEE: tl.constexpr):
    """x [M, K] times a weight tile: w [K, N] -> x @ w [M, N]; with SWAP, w [N, K] -> w @ x^T
    [N, M], the weight as the MMA's wide first operand (a few rows of x then pad the narrow one)."""
    if SWAP:
        if IEEE:
            out = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
        else:
            out = tl.dot(w.to(x.dtype), tl.trans(x))
    else:
        out = dot_f32(x, w, IEEE)
    return out


@triton.jit
def acc_zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr):
    """The fp32 accumulator `weight_dot` adds to: [BLOCK_M, BLOCK_N], or [BLOCK_N, BLOCK_M] with
    SWAP (`acc_rows` turns it back)."""
    if SWAP:
        out = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    else:
        out = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    return out


@triton.jit
def acc_rows(acc, SWAP: tl.constexpr):
    """An accumulator from `acc_zeros` as [BLOCK_M, BLOCK_N]."""
    if SWAP:
        acc = tl.trans(acc)
    return acc


@triton.jit
def load_x(x_rows, x_ok, k0, K, FMT: tl.constexpr, BLOCK_K: tl.constexpr):
    """Activations x[:, k0:k0 + BLOCK_K] as `weight_dot` takes them: (xa, xb) = the even and odd
    columns [BLOCK_M, BLOCK_K / 2] for FP4, else the tile [BLOCK_M, BLOCK_K] twice. x_rows
    [BLOCK_M, 1]: pointers to the rows (contiguous along K), x_ok their mask; 0 past K."""
    if FMT == 2:  # one contiguous (vectorised) load, split into even and odd columns in registers
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + k[None, :], mask=x_ok & (k < K)[None, :], other=0.0)
        xa, xb = tl.split(tl.reshape(x, (x.shape[0], BLOCK_K // 2, 2)))
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        xa = tl.load(x_rows + k[None, :], mask=x_ok & (k < K)[None, :], other=0.0)
        xb = xa
    return xa, xb


@triton.jit
def _per_byte(group_tile, SWAP: tl.constexpr):
    """A tile of one value per 32-column group -> one per byte of the FP4 tile (16 bytes a group):
    [N, G] -> [N, 16 G], or with K along dim 0 (not SWAP) [G, N] -> [16 G, N]."""
    A: tl.constexpr = group_tile.shape[0]
    B: tl.constexpr = group_tile.shape[1]
    if SWAP:
        out = tl.reshape(tl.broadcast_to(group_tile[:, :, None], (A, B, 16)), (A, 16 * B))
    else:
        out = tl.reshape(tl.broadcast_to(group_tile[:, None, :], (A, 16, B)), (16 * A, B))
    return out


# Two FP4 bytes (one 16-bit register, b0 in the low byte) and their groups' bf16 multipliers
# 2^(s - 1) (b32, two bf16) -> (low nibbles, high nibbles) as bf16 pairs. prmt spreads the bytes
# into the halves of t; a code's bits (s e1 e0 m) become bf16 bits (s << 15) | (e1 e0 m << 6),
# exactly code * 2^-126 (the code 0.5 is the subnormal 2^-127, which bf16 arithmetic keeps), and
# fma(., 2^(s - 1), -0) is code * 2^(s - 127) exactly for every scale byte s <= 128.
FP4_BF16_ASM = tl.constexpr("""
{
.reg .b32 x, t, m, g, z;
mov.b32 z, 0x80008000;
cvt.u32.u16 x, $2;
prmt.b32 t, x, 0, 0x4140;
shl.b32 m, t, 6; and.b32 m, m, 0x01C001C0;
shl.b32 g, t, 12; and.b32 g, g, 0x80008000; or.b32 m, m, g;
fma.rn.bf16x2 $0, m, $3, z;
shl.b32 m, t, 2; and.b32 m, m, 0x01C001C0;
shl.b32 g, t, 8; and.b32 g, g, 0x80008000; or.b32 m, m, g;
fma.rn.bf16x2 $1, m, $3, z;
}
""")


@triton.jit
def fp4_bf16(byte, s_byte):
    """FP4 bytes (uint8) and their groups' ue8m0 scale bytes (int32, one per byte) -> (values of
    the low nibbles, of the high nibbles) in bf16, exact (`FP4_BF16_ASM`, multiplying by
    2^(s - 1) = 2^126 x the group's scale): under three instructions per value, and a grouped
    expert kernel's K loop about five in all (nineteen decoding through fp32; sm_90 SASS,
    tests/kernels/test_hopper_build.py). Its values are checked against the loader's on GPUs
    (tests/gpu/test_fp4_decode_cuda.py); the interpreter cannot run it."""
    multiplier = ((s_byte + 126) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return tl.inline_asm_elementwise(
        FP4_BF16_ASM, "=r,=r,h,r", [byte, multiplier], (tl.bfloat16, tl.bfloat16), True, 2
    )


@triton.jit
def fp4_f32(byte, s_byte):
    """FP4 bytes and their groups' scale bytes (int32, one per byte) -> (values of the low
    nibbles, of the high nibbles) in fp32, exact, in plain Triton (fp32 products, the
    interpreter, and the decode into a scratch)."""
    byte = byte.to(tl.int32) & 0xFF
    scale = pow2_from_byte(s_byte + 14)  # 2^14 x the group's scale
    return e2m1_scaled_down(byte, False) * scale, e2m1_scaled_down(byte, True) * scale


@triton.jit
def weight_dot(
    xa,
    xb,
    k0,
    K,
    w_ptr,
    w_rows,
    n_ok,
    stride_w,
    s_ptr,
    s_rows,
    stride_s,
    block_k,
    FMT: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    SWAP: tl.constexpr = False,
    stride_g=1,
):
    """(xa, xb) from `load_x` times W[w_rows, k0:k0 + BLOCK_K]^T -> [BLOCK_M, BLOCK_N] fp32, or
    its transpose [BLOCK_N, BLOCK_M] with SWAP (see `times_x`; decode tiles of a few rows).

    w_rows [BLOCK_N] int64 weight rows (n_ok: in range), stride_w elements (bytes for FP8 and FP4)
    per row; s_rows [BLOCK_N] int64 scale rows, stride_s scales per scale row, stride_g per scale
    column (a scale at s_rows * stride_s + column * stride_g); k0 a multiple of BLOCK_K. Columns
    past K count as zero.
    """
    if FMT == 2:  # FP4: byte j holds columns 2j (low nibble) and 2j + 1 (high nibble)
        # masks on the byte and group indices (K % 32 == 0) keep the loads vectorised
        j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        offs, wm = _tile(w_rows, stride_w, n_ok, j, j < K // 2, SWAP)
        byte = tl.load(w_ptr + offs, mask=wm, other=0)
        g = k0 // FP4_GROUP_C + tl.arange(0, BLOCK_K // FP4_GROUP_C)
        s_offs, sm = _tile(s_rows, stride_s, n_ok, g * stride_g, g < K // FP4_GROUP_C, SWAP)
        s_byte = _per_byte(tl.load(s_ptr + s_offs, mask=sm, other=0).to(tl.int32), SWAP)
        if IEEE:  # exact fp32 values (the interpreter runs no inline assembly)
            lo, hi = fp4_f32(byte, s_byte)
        else:
            lo, hi = fp4_bf16(byte, s_byte)
        out = times_x(xa, lo, SWAP, IEEE) + times_x(xb, hi, SWAP, IEEE)
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        offs, wm = _tile(w_rows, stride_w, n_ok, k, k < K, SWAP)
        w = tl.load(w_ptr + offs, mask=wm, other=0)
        if FMT == 1:  # FP8: the dot on the e4m3 numbers, then the block's scale per column
            w = w.to(tl.float8e4nv, bitcast=True)
            if IEEE:
                w = w.to(tl.float32)
            else:
                w = w.to(xa.dtype)
            s_col = (k0 // block_k) * stride_g
            scale = load_scale(s_ptr + s_rows * stride_s + s_col, n_ok, SCALE_BYTES)
            if SWAP:
                out = times_x(xa, w, SWAP, IEEE) * scale[:, None]
            else:
                out = times_x(xa, w, SWAP, IEEE) * scale[None, :]
        else:
            out = times_x(xa, w, SWAP, IEEE)
    return out


@triton.jit
def _tile(rows, stride, rows_ok, cols, cols_ok, SWAP: tl.constexpr):
    """(offsets, mask) of a weight tile: [cols, rows] (K along dim 0), or [rows, cols] with
    SWAP."""
    if SWAP:
        offs = rows[:, None] * stride + cols[None, :]
        mask = rows_ok[:, None] & cols_ok[None, :]
    else:
        offs = rows[None, :] * stride + cols[:, None]
        mask = rows_ok[None, :] & cols_ok[:, None]
    return offs, mask


def num_splits(num_tiles: int, k_steps: int, device: torch.device) -> int:
    """K splits so that num_tiles * splits programs fill the SMs about twice (1 when they do)."""
    target = 2 * num_sms(device)
    if num_tiles >= target:
        return 1
    return min(k_steps, triton.cdiv(target, num_tiles))


def split_k(num_tiles: int, k: int, block_k: int, device: torch.device) -> tuple[int, int]:
    """(K columns per split, splits) of a GEMM of num_tiles output tiles over k input columns in
    K steps of block_k (`num_splits`, then no empty split); columns per split are whole steps,
    which a kernel's K loop may take as its alignment."""
    steps = triton.cdiv(k, block_k)
    per_split = triton.cdiv(steps, num_splits(num_tiles, steps, device))
    return per_split * block_k, triton.cdiv(steps, per_split)


@triton.jit
def _term(part_ptr, first, mask, t, num_terms, group, split_numel, width, BLOCK: tl.constexpr):
    # term t = s group + j of part [S, M group, W] at the elements `first` (part[0, m group, c])
    at = (t // group).to(tl.int64) * split_numel + (t % group) * width
    live = mask & (tl.full((BLOCK,), t, tl.int32) < num_terms)
    return tl.load(part_ptr + at + first, mask=live, other=0.0)


@triton.jit(do_not_specialize=["numel", "width", "num_terms", "group"])
def _sum_splits_kernel(part_ptr, out_ptr, numel, width, num_terms, group,
                       BLOCK: tl.constexpr, OUT_BF16: tl.constexpr):  # fmt: skip
    # out [M, W] (numel = M W): out[m, c] = sum over s, then j < group of part[s, m group + j, c],
    # added in that order in fp32 and stored in out's dtype. Four terms are loaded before any
    # is added (independent loads in flight: with tens of splits, a loop of one load and one
    # add waits out each load's latency in turn). A term past the last loads +0.0, which
    # leaves the sum as it is (it starts at +0.0 and never becomes -0.0).
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < numel
    first = (i // width) * group * width + i % width
    split_numel = numel.to(tl.int64) * group  # part's elements a split
    acc = tl.zeros((BLOCK,), tl.float32)
    for t in range(0, num_terms, 4):
        a0 = _term(part_ptr, first, mask, t, num_terms, group, split_numel, width, BLOCK)
        a1 = _term(part_ptr, first, mask, t + 1, num_terms, group, split_numel, width, BLOCK)
        a2 = _term(part_ptr, first, mask, t + 2, num_terms, group, split_numel, width, BLOCK)
        a3 = _term(part_ptr, first, mask, t + 3, num_terms, group, split_numel, width, BLOCK)
        acc += a0
        acc += a1
        acc += a2
        acc += a3
    store_rounded(out_ptr, i, acc, mask, OUT_BF16)


def sum_splits(part: torch.Tensor, out: torch.Tensor, group: int = 1) -> torch.Tensor:
    """out [M, W] = the fp32 partials part [S, M * group, W] summed over the splits s and each
    row's group of `group` consecutive rows (s outer, in order), in out's dtype (bf16 rounded to
    nearest even): a split-K epilogue, and a token's expert slots, in one launch. Small outputs
    take small blocks so that more programs share the terms' loads."""
    assert part.dtype == torch.float32 and part.is_contiguous() and out.is_contiguous()
    rows, width = out.shape
    assert tuple(part.shape[1:]) == (rows * group, width), (part.shape, out.shape, group)
    numel = out.numel()
    block = 1024 if numel >= 64 * 1024 else 256
    if numel:
        _sum_splits_kernel[(triton.cdiv(numel, block),)](
            part, out, numel, width, part.shape[0] * group, group, BLOCK=block,
            OUT_BF16=out.dtype == torch.bfloat16,
        )  # fmt: skip
    return out


def k_tile(preferred: int, block_k: int) -> int:
    """The largest power-of-two K step <= preferred that divides block_k (so a step never
    crosses an FP8 scale block); at least 16 (tl.dot's minimum)."""
    step = preferred
    while step > 16 and block_k % step:
        step //= 2
    if block_k % step:
        raise ValueError(f"FP8 scale blocks of {block_k} columns need a K step of at least 16")
    return step


def kernel_bytes(t: torch.Tensor) -> torch.Tensor:
    """1-byte tensors (fp8, packed fp4, ue8m0) as the uint8 bytes the kernels read; others as is."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def group_major_scales(scale: torch.Tensor) -> torch.Tensor:
    """Stacked scales [E, rows, groups] as the same logical tensor stored with each group column
    contiguous (strides (rows * groups, 1, rows)). A weight tile's scales are then a few
    contiguous runs (one per group column of the K step) rather than one 32-byte sector per weight
    row: FP4's per-row scales read 8x fewer sectors this way."""
    return scale.transpose(-1, -2).contiguous().transpose(-1, -2)


def scale_layout(scale: torch.Tensor) -> str | None:
    """Stacked scales [E, rows, groups] -> "row" (contiguous), "group" (`group_major_scales`) or
    None (another layout, which the kernels do not read)."""
    _, rows, groups = scale.shape
    if scale.stride(0) != rows * groups and scale.shape[0] != 1:
        return None
    if scale.stride()[1:] == (groups, 1):
        return "row"
    return "group" if scale.stride()[1:] == (1, rows) else None


def scale_float_ref(scale: torch.Tensor) -> torch.Tensor:
    """Stored scales (fp32, float8_e8m0fnu or uint8 exponent bytes) -> fp32 multipliers."""
    if scale.element_size() == 1:
        return torch.exp2(scale.view(torch.uint8).float() - 127.0)
    return scale.float()


def dequantize_ref(
    weight: torch.Tensor, scale: torch.Tensor, fmt: str, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """[..., N, K'] stored weight -> [..., N, K] fp32 values (leading dims: stacked experts)."""
    s = scale_float_ref(scale)
    if fmt == "fp4":
        codes = weight.view(torch.uint8).long()
        pairs = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2)  # [..., N, K]
        lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=weight.device)
        return lut[pairs] * s.repeat_interleave(FP4_GROUP, dim=-1)
    assert fmt == "fp8", fmt
    rows, cols = weight.shape[-2:]
    expand = s.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return weight.float() * expand[..., :rows, :cols]


def scale_shape(fmt: str, rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    """Scale grid of a logical [rows, cols] weight."""
    if fmt == "fp4":
        return rows, cols // FP4_GROUP
    return math.ceil(rows / block[0]), math.ceil(cols / block[1])
