"""Routed experts as two grouped GEMMs over the (token, slot) pairs grouped by expert, sync-free.

    fused_moe(x [N, hidden], ids [N, S] int64, weights [N, S] fp32, w13 [E, 2 * inter, hidden],
              w2 [E, hidden, inter], limit, scales=None, fmt="dense", block=(128, 128))
        -> [N, hidden] in x's dtype
    out[t] = sum_s weights[t, s] * expert_{ids[t, s]}(x[t]),
    expert_e(v) = w2[e] (silu(min(g, limit)) * clamp(u, -limit, limit)), g | u = w13[e] v

w13 holds each expert's gate rows (w1) then its up rows (w3). A slot may name any expert, the
shared expert included when the caller stacks it as one more expert with weight 1. Pairs are
numbered p = token * S + slot.

Weight formats (kernels/quant_tiles.py decodes them in registers; x stays bf16, fp16 or fp32):
  - "dense": w13, w2 in x's dtype, scales None;
  - "fp8": e4m3 w13 [E, 2 * inter, hidden] and w2 [E, hidden, inter] with block scales (s13, s2):
    s13 [E, 2 * ceil(inter / bn), ceil(hidden / bk)] (w1's block rows, then w3's), s2 [E,
    ceil(hidden / bn), ceil(inter / bk)], fp32 or ue8m0, for block = (bn, bk);
  - "fp4": e2m1 pairs packed along K, w13 [E, 2 * inter, hidden / 2] and w2 [E, hidden, inter / 2]
    (int8 or uint8), ue8m0 s13 [E, 2 * inter, hidden / 32] and s2 [E, hidden, inter / 32].
Scales are read through their strides, row-major or group-major (`stored_scales`: how the worker
stacks FP4 experts' scales, each 32-column group's scales of all rows contiguous).

Plan (no host synchronisation, so a CUDA graph can capture it; grids are fixed by the shapes and
programs with no pairs exit at once): the pairs are grouped by expert, then `_gate_up_kernel`
computes h[p] = silu(min(x w1^T, limit)) * clamp(x w3^T) for a block of one expert's pairs and a
block of intermediate columns (the expert's weight tile is read once per block of pairs), and
`_down_kernel` writes weights[p] * (h[p] w2^T) at row p; the S rows of a token are summed last, in
slot order (one launch, `quant_tiles.sum_splits`, with the K splits' partials). Two ways to
group, by the number of pairs P:
  - list (decode batches, P <= LIST_MAX_PAIRS): `_list_kernel` writes each expert's pairs in
    order into its own row of a [E, P] table (one launch); the blocks of BLOCK_M pairs of every
    expert with pairs are numbered in expert order, and program b finds its block from the
    experts' counts (a cumulative sum in registers). The grid, cdiv(P, BLOCK_M) + min(E, P)
    programs, bounds the blocks whatever the routing: with 256 experts and a few pairs each, no
    program is launched per untouched expert;
  - sort (prefills): `align` sorts the pairs by expert and cuts each expert's run into blocks of
    BLOCK_M pairs (at most cdiv(P, BLOCK_M) + E blocks). Quantized experts with many pairs each
    (a prefill chunk of thousands of tokens) are decoded once into bf16 / fp16 chunks of experts
    first (kernels/dequant.py), and the dense kernels multiply those: decoding a weight tile in
    every program that reads it costs more than the products there.
fp32 inputs multiply exactly ("ieee"); bf16 and fp16 on tensor cores with fp32 accumulation (under
the interpreter every dot runs in fp32). `fused_moe_ref` is the torch reference.
"""

import copy
import itertools

import torch
import triton
import triton.language as tl

from dsv4ray.kernels.bits import interpreting, store_rounded
from dsv4ray.kernels.dequant import dequantize
from dsv4ray.kernels.quant_tiles import (
    FORMATS,
    acc_rows,
    acc_zeros,
    dequantize_ref,
    group_major_scales,
    k_tile,
    kernel_bytes,
    load_x,
    scale_layout,
    scale_shape,
    split_k,
    sum_splits,
    weight_dot,
)

LIST_MAX_PAIRS = 1024
# the grouped kernels' arguments that vary between calls of one layer (never specialised)
RUNTIME_ARGS = ["num_pairs", "num_experts", "k_per_split", "num_splits", "expert_lo", "expert_hi"]


@triton.jit
def _pairs(
    list_ptr,
    blocks_ptr,
    counts_ptr,
    num_pairs,
    num_experts,
    LISTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    expert_lo=0,
    expert_hi=-1,
):
    """(expert, pair ids [BLOCK_M], their mask, whether the program has any) of program_id(0);
    with expert_hi >= 0 only experts in [expert_lo, expert_hi) are active (a chunk of experts
    whose weights were dequantised first)."""
    pid = tl.program_id(0)
    if LISTED:  # the pid-th block of BLOCK_M pairs over the experts' rows of the [E, P] table
        e = tl.arange(0, E_PAD)
        counts = tl.load(counts_ptr + e, mask=e < num_experts, other=0)
        blocks = (counts + BLOCK_M - 1) // BLOCK_M
        block_end = tl.cumsum(blocks, axis=0)  # blocks of experts <= e
        expert = tl.sum((block_end <= pid).to(tl.int32), axis=0)  # num_experts: no block left
        mine = e == expert
        first = (pid - tl.sum(tl.where(mine, block_end - blocks, 0), axis=0)) * BLOCK_M
        end = tl.sum(tl.where(mine, counts, 0), axis=0)
        base = expert.to(tl.int64) * num_pairs
    else:  # block row (expert, first, end) over the sorted pairs; expert -1: a spare block
        expert = tl.load(blocks_ptr + 3 * pid)
        first = tl.load(blocks_ptr + 3 * pid + 1)
        end = tl.load(blocks_ptr + 3 * pid + 2)
        base = 0
    r = first + tl.arange(0, BLOCK_M)
    ok = r < end
    pair = tl.load(list_ptr + base + r, mask=ok, other=0).to(tl.int64)
    active = (expert >= 0) & (expert < num_experts) & (first < end)
    if expert_hi >= 0:
        active = active & (expert >= expert_lo) & (expert < expert_hi)
    return expert, pair, ok, active


@triton.jit(do_not_specialize=["num_pairs"])
def _list_kernel(ids_ptr, list_ptr, counts_ptr, num_pairs, BLOCK: tl.constexpr):
    # program e: the pairs routed to expert e, in pair order, at list[e, 0:count]
    e = tl.program_id(0)
    count = 0
    for p0 in range(0, num_pairs, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        hit = (tl.load(ids_ptr + p, mask=p < num_pairs, other=-1) == e).to(tl.int32)
        pos = count + tl.cumsum(hit, axis=0) - 1
        tl.store(list_ptr + e.to(tl.int64) * num_pairs + pos, p, mask=hit > 0)
        count += tl.sum(hit, axis=0)
    tl.store(counts_ptr + e, count)


@triton.jit
def _swiglu(gate, up, limit):
    """silu(min(gate, limit)) * clamp(up, -limit, limit) of summed fp32 products."""
    gate = tl.minimum(gate, limit)
    return gate * tl.sigmoid(gate) * tl.minimum(tl.maximum(up, -limit), limit)


@triton.jit(do_not_specialize=RUNTIME_ARGS)
def _gate_up_kernel(
    x_ptr,
    w13_ptr,
    s13_ptr,
    list_ptr,
    blocks_ptr,
    counts_ptr,
    h_ptr,
    part_ptr,
    k_per_split,
    num_splits,
    num_pairs,
    num_experts,
    hidden,
    inter,
    num_slots,
    limit,
    stride_w,
    stride_se,
    stride_sr,
    stride_sg,
    s_up,
    block_n,
    block_k,
    expert_lo,
    expert_hi,
    LISTED: tl.constexpr,
    E_PAD: tl.constexpr,
    FMT: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    SWAP: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    # program (pair block, column block n * num_splits + split): h[pairs, n] for the pairs'
    # expert, or with K split, the split's gate and up sums at part[split, pairs, n | inter + n]
    expert, pair, ok, active = _pairs(list_ptr, blocks_ptr, counts_ptr, num_pairs, num_experts,
                                      LISTED, BLOCK_M, E_PAD, expert_lo, expert_hi)  # fmt: skip
    expert -= expert_lo  # the weights' index: a dequantised chunk starts at expert_lo
    if active:
        token = pair // num_slots
        split = tl.program_id(1) % num_splits
        n = (tl.program_id(1) // num_splits) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < inter
        w_rows = expert.to(tl.int64) * 2 * inter + n
        # element offsets of the gate rows' scales; the up rows' start s_up scale rows further
        s_rows = expert.to(tl.int64) * stride_se + (n // block_n) * stride_sr
        x_rows = x_ptr + token[:, None] * hidden
        acc_g = acc_zeros(BLOCK_M, BLOCK_N, SWAP)
        acc_u = acc_zeros(BLOCK_M, BLOCK_N, SWAP)
        k_start = tl.multiple_of(split * k_per_split, BLOCK_K)  # k_per_split: whole K steps
        for k0 in range(k_start, tl.minimum(k_start + k_per_split, hidden), BLOCK_K):
            xa, xb = load_x(x_rows, ok[:, None], k0, hidden, FMT, BLOCK_K)
            acc_g += weight_dot(
                xa,
                xb,
                k0,
                hidden,
                w13_ptr,
                w_rows,
                n_ok,
                stride_w,
                s13_ptr,
                s_rows,
                1,
                block_k,
                FMT,
                SCALE_BYTES,
                BLOCK_K,
                IEEE,
                SWAP,
                stride_sg,
            )
            acc_u += weight_dot(
                xa,
                xb,
                k0,
                hidden,
                w13_ptr,
                w_rows + inter,
                n_ok,
                stride_w,
                s13_ptr,
                s_rows + s_up * stride_sr,
                1,
                block_k,
                FMT,
                SCALE_BYTES,
                BLOCK_K,
                IEEE,
                SWAP,
                stride_sg,
            )
        mask = ok[:, None] & n_ok[None, :]
        if num_splits == 1:
            h = _swiglu(acc_rows(acc_g, SWAP), acc_rows(acc_u, SWAP), limit)
            store_rounded(h_ptr, pair[:, None] * inter + n[None, :], h, mask, OUT_BF16)
        else:
            row = part_ptr + (split.to(tl.int64) * num_pairs + pair[:, None]) * (2 * inter)
            tl.store(row + n[None, :], acc_rows(acc_g, SWAP), mask)
            tl.store(row + inter + n[None, :], acc_rows(acc_u, SWAP), mask)


@triton.jit(do_not_specialize=RUNTIME_ARGS)
def _down_kernel(
    h_ptr,
    w2_ptr,
    s2_ptr,
    list_ptr,
    blocks_ptr,
    counts_ptr,
    weight_ptr,
    out_ptr,
    k_per_split,
    num_splits,
    num_pairs,
    num_experts,
    hidden,
    inter,
    stride_w,
    stride_se,
    stride_sr,
    stride_sg,
    block_n,
    block_k,
    expert_lo,
    expert_hi,
    LISTED: tl.constexpr,
    E_PAD: tl.constexpr,
    FMT: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    SWAP: tl.constexpr,
):
    # program (pair block, column block n * num_splits + split):
    # out[split, pair, n] = weight[pair] * h[pair, split's K] w2[e, n, split's K]^T
    expert, pair, ok, active = _pairs(list_ptr, blocks_ptr, counts_ptr, num_pairs, num_experts,
                                      LISTED, BLOCK_M, E_PAD, expert_lo, expert_hi)  # fmt: skip
    expert -= expert_lo  # the weights' index: a dequantised chunk starts at expert_lo
    if active:
        split = tl.program_id(1) % num_splits
        n = (tl.program_id(1) // num_splits) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < hidden
        w_rows = expert.to(tl.int64) * hidden + n
        s_rows = expert.to(tl.int64) * stride_se + (n // block_n) * stride_sr  # element offsets
        h_rows = h_ptr + pair[:, None] * inter
        acc = acc_zeros(BLOCK_M, BLOCK_N, SWAP)
        k_start = tl.multiple_of(split * k_per_split, BLOCK_K)  # k_per_split: whole K steps
        for k0 in range(k_start, tl.minimum(k_start + k_per_split, inter), BLOCK_K):
            xa, xb = load_x(h_rows, ok[:, None], k0, inter, FMT, BLOCK_K)
            acc += weight_dot(
                xa,
                xb,
                k0,
                inter,
                w2_ptr,
                w_rows,
                n_ok,
                stride_w,
                s2_ptr,
                s_rows,
                1,
                block_k,
                FMT,
                SCALE_BYTES,
                BLOCK_K,
                IEEE,
                SWAP,
                stride_sg,
            )
        w = tl.load(weight_ptr + pair, mask=ok, other=0.0)
        rows = split.to(tl.int64) * num_pairs + pair[:, None]
        tl.store(
            out_ptr + rows * hidden + n[None, :],
            acc_rows(acc, SWAP) * w[:, None],
            mask=ok[:, None] & n_ok[None, :],
        )


def _dequantize_first(fmt: str, listed: bool, num_pairs: int, num_experts: int, x) -> bool:
    """Quantized experts over sorted pairs, DEQUANT_PAIRS_PER_EXPERT or more a expert on
    average, with 16-bit activations: decoding each weight once into a scratch (then bf16
    products) costs less than decoding it in every program that reads it."""
    return (fmt != "dense" and not listed and x.dtype != torch.float32
            and num_pairs >= DEQUANT_PAIRS_PER_EXPERT * num_experts)  # fmt: skip


def _run_dequantized(call: "_Call", w13, w2, scales, fmt: str, tiles: dict) -> None:
    """The experts in chunks that fit DEQUANT_SCRATCH_BYTES: each chunk's experts (those with
    pairs) decoded to the activations' dtype (kernels/dequant.py), then both grouped GEMMs on
    them with dense tiles, for the pairs of that chunk's experts only (stream order keeps a
    chunk's scratch until its GEMMs ran)."""
    num_experts, inter, hidden, block = call.num_experts, call.inter, call.hidden, call.block
    per_expert = 3 * inter * hidden * call.x.element_size()
    chunk = max(1, min(num_experts, DEQUANT_SCRATCH_BYTES // per_expert))
    dtype, device = call.x.dtype, call.x.device
    s13, s2 = scales
    half = s13.shape[1] // 2  # w1's scale rows, then w3's (their own block grids)
    counts = call.groups[2]
    for lo, hi, blocks in _chunks(call, chunk, tiles["BLOCK_M"]):
        n, part = hi - lo, call.window(*blocks)
        w = torch.empty(n, 2 * inter, hidden, dtype=dtype, device=device)
        if fmt == "fp4":  # one scale row per weight row
            dequantize(w13, s13, fmt, block, w, lo, counts)
        else:
            dequantize(w13[:, :inter], s13[:, :half], fmt, block, w[:, :inter], lo, counts)
            dequantize(w13[:, inter:], s13[:, half:], fmt, block, w[:, inter:], lo, counts)
        part.gate_up(w, None, "dense", tiles, (lo, hi))
        w = torch.empty(n, hidden, inter, dtype=dtype, device=device)
        part.down(dequantize(w2, s2, fmt, block, w, lo, counts), None, "dense", tiles, (lo, hi))


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _chunks(call: "_Call", chunk: int, block_m: int) -> list[tuple[int, int, tuple[int, int]]]:
    """(first expert, end expert, (first block, end block)) of each chunk of `chunk` experts.
    Outside a CUDA graph capture the pair counts come to the host (one sync per prefill-sized
    call) so that a chunk launches its own experts' blocks alone (the blocks are sorted by expert)
    and chunks without pairs are skipped: launching every block for every chunk costs each
    chunk a pass of exiting programs as long as the whole GEMM's. In a capture every chunk
    launches every block, and programs of other experts return at once."""
    num_experts, num_blocks = call.num_experts, call.num_blocks
    starts = range(0, num_experts, chunk)
    if _capturing(call.x):
        return [(lo, min(lo + chunk, num_experts), (0, num_blocks)) for lo in starts]
    ends = list(itertools.accumulate(-(-c // block_m) for c in call.groups[2].tolist()))
    out = []
    for lo in starts:
        hi = min(lo + chunk, num_experts)
        first = ends[lo - 1] if lo else 0
        if ends[hi - 1] > first:
            out.append((lo, hi, (first, ends[hi - 1])))
    return out


def align(ids: torch.Tensor, num_experts: int, block_m: int):
    """(order [P], blocks [B, 3] int32, counts [E] int64) for the P = ids.numel() pairs: order
    lists pair indices by expert; block b covers sorted pairs [first, end) of one expert, at most
    block_m of them; rows (expert, first, end) = (-1, 0, 0) are spare blocks; counts: each
    expert's pairs. B is a function of P and E alone, and no value goes to the host."""
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    order = torch.argsort(flat.to(torch.int32), stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    run_end = torch.cumsum(counts, 0)
    blocks_per = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks_per, 0)  # [E]: blocks of experts <= e
    num_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    b = torch.arange(num_blocks, device=ids.device)
    expert = torch.searchsorted(block_end, b, right=True)  # expert of block b (E: spare)
    valid = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    local = b - (block_end[e] - blocks_per[e])
    first = run_end[e] - counts[e] + local * block_m
    end = torch.minimum(first + block_m, run_end[e])
    rows = [torch.where(valid, col, fill) for col, fill in ((expert, -1), (first, 0), (end, 0))]
    return order, torch.stack(rows, dim=1).to(torch.int32), counts


def list_pairs(ids: torch.Tensor, num_experts: int):
    """(table [E, P] int64, counts [E] int32): row e lists the pairs routed to expert e in pair
    order (entries past counts[e] are unused). One launch, no value goes to the host."""
    flat = ids.reshape(-1).contiguous()
    num_pairs = flat.numel()
    table = torch.empty(num_experts, num_pairs, dtype=torch.int64, device=ids.device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    _list_kernel[(num_experts,)](flat, table, counts, num_pairs, BLOCK=256)
    return table, counts


SMALL_PAIRS = 16  # quantized experts over at most this many pairs take SMALL_TILES ...
FEW_PER_EXPERT = 4  # ... and so do those with at most this many pairs per expert on average
SMALL_TILES = {
    "fp8": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3, SWAP=True),
    "fp4": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3, SWAP=True),
}


# sorted pairs (prefills): quantized weights decoded in registers take narrower tiles than bf16
# (at V4-Flash's expert shape, 8192 tokens on an H200, a development sweep: FP4 42 ms against
# 72 ms with bf16's 128 x 128 tiles, FP8 13 ms against 20 ms; bf16 10 ms)
PREFILL_TILES = {
    "dense": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3, SWAP=False),
    "fp4": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, SWAP=False),
    "fp8": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4, SWAP=False),
}
# sorted quantized calls with at least this many pairs per expert on average decode their experts
# into a scratch of at most DEQUANT_SCRATCH_BYTES at a time first (`_dequantize_first`)
DEQUANT_PAIRS_PER_EXPERT = 96
DEQUANT_SCRATCH_BYTES = 1 << 30
FP32_FEW_PAIRS = 48  # fp32 listed calls over at most this many pairs take 16 x 16 tiles


# FP4 over more pairs than this, with group-major scales (`stored_scales`), takes 128 weight
# rows a program: at V4-Flash's expert shape on an H200 (a development sweep), 0.54 / 1.33 ms at
# 16 / 64 tokens against 0.64 / 1.58 with 64 rows; 64 rows stay faster at one token (6 pairs), and
# row-major scales make 128 rows slower (a tile's scales then cost one sector per weight row)
FP4_WIDE_PAIRS = 16


def stored_scales(fmt: str, scale: torch.Tensor) -> torch.Tensor:
    """Stacked expert scales [E, rows, groups] in the storage `fused_moe` reads fastest: FP4's
    per-row scales group-major (`group_major_scales`), FP8's block scales as they are."""
    return group_major_scales(scale) if fmt == "fp4" else scale


def small_pairs(num_experts: int) -> int:
    """The most pairs for which quantized experts take SMALL_TILES."""
    return max(SMALL_PAIRS, FEW_PER_EXPERT * num_experts)


def _tiles(listed: bool, fmt: str, num_pairs: int, fp32: bool = False, num_experts: int = 1,
           group_major: bool = False):  # fmt: skip
    """Tile shapes: decode batches stream each expert's weights once (a 64-pair block is a whole
    expert's share of up to 64 tokens); prefills reuse wider tiles on tensor cores. Quantized
    weights over a few pairs per expert (decode batches of a model with many experts: 256
    experts at top-6 see 1.5 pairs each at batch 64) take 16-pair blocks. FP8 computes W x^T
    there (SWAP: 64 weight rows a program, K steps of 128): at V4-Flash's expert shape on an
    H200 (a development sweep, docs/benchmarks.md) its experts read 0.40 / 0.64 / 0.67 of the
    copy ceiling at 1 / 16 / 64 tokens against 0.32 / 0.37 / 0.38 with 16 x 32 output tiles.
    FP4 takes the same tiles: its codes decode to bf16 in about five instructions a value in
    the kernels' SASS for sm_90 (tests/kernels/test_hopper_build.py), against nineteen with
    16 x 32 output tiles and decoding through fp32; it reads 0.23 / 0.38 / 0.39 of the copy
    ceiling there (bench/results/native-kernels-nvidia-h200.json) with row-major scales, and
    takes 128 rows a program over more than FP4_WIDE_PAIRS pairs when its scales are
    group-major (`stored_scales`). fp32
    products run on CUDA cores, where a tile's empty rows cost as much as full ones: 16-pair
    blocks, and 16 columns a program for a few pairs."""
    if listed and fp32 and fmt == "dense":
        block_n = 16 if num_pairs <= FP32_FEW_PAIRS else 64
        return dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=128, num_warps=4, num_stages=3, SWAP=False)
    if listed and fmt in SMALL_TILES and num_pairs <= small_pairs(num_experts):
        wide = fmt == "fp4" and group_major and num_pairs > FP4_WIDE_PAIRS
        return dict(SMALL_TILES[fmt], **({"BLOCK_N": 128} if wide else {}))
    if listed:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3, SWAP=False)
    return dict(PREFILL_TILES.get(fmt, PREFILL_TILES["dense"]))


def _layout(fmt: str, scale, cols: int, block) -> tuple[int, int, int, int, int]:
    """(stride_w, stride_se, stride_sr, stride_sg, block_n) of a stacked weight of logical
    [E, rows, cols]: elements (bytes) per weight row, the scales' strides per expert, scale row
    and scale column (any layout: `group_major_scales` stores FP4's columns outermost), and the
    weight rows one scale row covers."""
    if fmt == "dense":
        return cols, 0, 0, 0, 1
    se, sr, sg = scale.stride()
    return (cols // 2, se, sr, sg, 1) if fmt == "fp4" else (cols, se, sr, sg, block[0])


def _check(x, w13, w2, scales, fmt, block) -> int:
    """Shapes and dtypes of the stacked weights (see the module docstring); returns inter."""
    num_experts, inter, hidden = w13.shape[0], w13.shape[1] // 2, x.shape[1]
    assert x.is_contiguous() and w13.is_contiguous() and w2.is_contiguous()
    assert fmt in FORMATS, fmt
    if fmt == "dense":
        assert x.dtype == w13.dtype == w2.dtype, (x.dtype, w13.dtype, w2.dtype)
    else:
        assert w13.element_size() == w2.element_size() == 1, (w13.dtype, w2.dtype)
        assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), x.dtype
    packed = 2 if fmt == "fp4" else 1
    assert w13.shape == (num_experts, 2 * inter, hidden // packed), w13.shape
    assert w2.shape == (num_experts, hidden, inter // packed), w2.shape
    if fmt != "dense":
        s13, s2 = scales
        assert scale_layout(s13) and scale_layout(s2), (s13.stride(), s2.stride())
        gate = scale_shape(fmt, inter, hidden, block)
        assert s13.shape == (num_experts, 2 * gate[0], gate[1]), s13.shape
        assert s2.shape == (num_experts, *scale_shape(fmt, hidden, inter, block)), s2.shape
    return inter


def fused_moe(
    x,
    ids,
    weights,
    w13,
    w2,
    limit: float,
    scales=None,
    fmt: str = "dense",
    block: tuple[int, int] = (128, 128),
) -> torch.Tensor:
    """See the module docstring."""
    num_tokens, hidden = x.shape
    inter = _check(x, w13, w2, scales, fmt, block)
    assert ids.shape == weights.shape and ids.shape[0] == num_tokens, (ids.shape, weights.shape)
    num_experts = w13.shape[0]
    num_slots, num_pairs = ids.shape[1], ids.numel()
    if num_tokens == 0:
        return torch.empty(0, hidden, dtype=x.dtype, device=x.device)
    listed = num_pairs <= LIST_MAX_PAIRS
    # the interpreter pays per program and op: it keeps the wide tiles
    fp32 = x.dtype == torch.float32 and not interpreting()
    dequant = _dequantize_first(fmt, listed, num_pairs, num_experts, x)
    group_major = scales is not None and scale_layout(scales[0]) == "group"
    if dequant:
        tiles = dict(PREFILL_TILES["dense"])
    else:
        tiles = _tiles(listed, fmt, num_pairs, fp32, num_experts, group_major)
    if fmt == "fp8":
        tiles["BLOCK_K"] = k_tile(tiles["BLOCK_K"], block[1])
    if listed:
        pair_list, counts = list_pairs(ids, num_experts)
        blocks = counts  # unused
        # sum_e cdiv(count_e, BLOCK_M) <= cdiv(P, BLOCK_M) + (experts with a pair)
        num_blocks = triton.cdiv(num_pairs, tiles["BLOCK_M"]) + min(num_experts, num_pairs)
    else:
        pair_list, blocks, counts = align(ids, num_experts, tiles["BLOCK_M"])
        num_blocks = blocks.shape[0]
    k13, split13 = _k_splits(listed, num_blocks, inter, hidden, tiles, x.device)
    k2, split2 = _k_splits(listed, num_blocks, hidden, inter, tiles, x.device)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    part = h  # unused without a split
    if split13 > 1:
        part = torch.empty(split13, num_pairs, 2 * inter, dtype=torch.float32, device=x.device)
    out = torch.empty(split2, num_pairs, hidden, dtype=torch.float32, device=x.device)
    groups = (pair_list, blocks, counts)
    call = _Call(x, weights.float().contiguous(), groups, num_blocks, h, part, out, num_experts,
                 num_slots, limit, block, listed, (k13, split13), (k2, split2))  # fmt: skip
    if dequant:
        _run_dequantized(call, w13, w2, scales, fmt, tiles)
    else:
        call.gate_up(w13, scales[0] if scales else None, fmt, tiles)
        call.down(w2, scales[1] if scales else None, fmt, tiles)
    # a token's rows: its slots' weighted expert outputs over the K splits, summed in order
    return sum_splits(out, torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device),
                      num_slots)  # fmt: skip


class _Call:
    """One fused_moe call's launches: the pairs grouped by expert, the buffers between the two
    GEMMs, and the K splits; `gate_up` then `down`, optionally for a window of experts whose
    weights sit at the start of the tensors given (a dequantised chunk)."""

    def __init__(self, x, weights, groups, num_blocks, h, part, out, num_experts, num_slots,
                 limit, block, listed, split13, split2) -> None:  # fmt: skip
        self.x, self.weights, self.h, self.part, self.out = x, weights, h, part, out
        self.groups, self.num_blocks = groups, num_blocks  # (pair list, blocks, counts)
        self.num_experts, self.num_slots, self.limit = num_experts, num_slots, limit
        self.block, self.listed = block, listed
        self.split13, self.split2 = split13, split2
        self.num_pairs, self.hidden, self.inter = h.shape[0], x.shape[1], h.shape[1]

    def window(self, first: int, end: int) -> "_Call":
        """This call over sorted blocks [first, end) alone (the blocks of a chunk of experts)."""
        part = copy.copy(self)
        pairs, blocks, counts = self.groups
        part.groups, part.num_blocks = (pairs, blocks[first:end], counts), end - first
        return part

    def _flags(self, fmt: str, scale, tiles: dict) -> dict:
        return dict(
            LISTED=self.listed,
            E_PAD=triton.next_power_of_2(self.num_experts),
            FMT=FORMATS[fmt],
            SCALE_BYTES=fmt != "dense" and scale.element_size() == 1,
            IEEE=self.x.dtype == torch.float32 or interpreting(),
            **tiles,
        )

    def gate_up(self, w13, s13, fmt: str, tiles: dict, window=(0, -1)) -> None:
        inter, hidden = self.inter, self.hidden
        s13 = kernel_bytes(s13) if s13 is not None else w13
        layout = _layout(fmt, s13, hidden, self.block)
        s_up = {"fp4": inter, "fp8": s13.shape[1] // 2}.get(fmt, 0)  # first scale row of w3
        k13, split13 = self.split13
        grid = (self.num_blocks, triton.cdiv(inter, tiles["BLOCK_N"]) * split13)
        _gate_up_kernel[grid](self.x, kernel_bytes(w13), s13, *self.groups, self.h, self.part,
                              k13, split13, self.num_pairs, self.num_experts, hidden, inter,
                              self.num_slots, self.limit, *layout[:4], s_up, layout[4],
                              self.block[1], *window,
                              OUT_BF16=self.h.dtype == torch.bfloat16,
                              **self._flags(fmt, s13, tiles))  # fmt: skip
        if split13 > 1:
            activate_splits(self.part, self.h, self.limit)

    def down(self, w2, s2, fmt: str, tiles: dict, window=(0, -1)) -> None:
        s2 = kernel_bytes(s2) if s2 is not None else w2
        layout = _layout(fmt, s2, self.inter, self.block)
        k2, split2 = self.split2
        grid = (self.num_blocks, triton.cdiv(self.hidden, tiles["BLOCK_N"]) * split2)
        _down_kernel[grid](self.h, kernel_bytes(w2), s2, *self.groups, self.weights, self.out,
                           k2, split2, self.num_pairs, self.num_experts, self.hidden, self.inter,
                           *layout, self.block[1], *window,
                           **self._flags(fmt, s2, tiles))  # fmt: skip


def _k_splits(listed: bool, num_blocks: int, n: int, k: int, tiles: dict, device):
    """(K columns per split, splits) of one grouped GEMM with n output and k input columns: a
    decode call whose programs would not fill the GPU twice over (a few experts with a few pairs
    each) splits K so that they do (`split_k`); a split's sums go to a partial buffer that one more
    launch adds up in split order (`activate_splits`, `sum_splits`; no atomics: the result does
    not depend on timing). Prefills (sorted pairs) never split."""
    if not listed:
        return triton.cdiv(k, tiles["BLOCK_K"]) * tiles["BLOCK_K"], 1
    return split_k(num_blocks * triton.cdiv(n, tiles["BLOCK_N"]), k, tiles["BLOCK_K"], device)


@triton.jit(do_not_specialize=["numel", "inter", "num_splits"])
def _activate_splits_kernel(part_ptr, h_ptr, numel, inter, num_splits, limit,
                            BLOCK: tl.constexpr, OUT_BF16: tl.constexpr):  # fmt: skip
    # h [P, inter] (numel = P inter) from part [S, P, 2 inter] (gate | up): each summed over the
    # splits in order, then `_swiglu` as `_gate_up_kernel`'s unsplit epilogue applies it
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < numel
    g = (i // inter) * (2 * inter) + i % inter
    gate = tl.zeros((BLOCK,), tl.float32)
    up = tl.zeros((BLOCK,), tl.float32)
    for s in range(num_splits):
        row = part_ptr + s * numel.to(tl.int64) * 2
        gate += tl.load(row + g, mask=mask, other=0.0)
        up += tl.load(row + g + inter, mask=mask, other=0.0)
    store_rounded(h_ptr, i, _swiglu(gate, up, limit), mask, OUT_BF16)


def activate_splits(part: torch.Tensor, h: torch.Tensor, limit: float) -> torch.Tensor:
    """h [P, inter] = silu(min(g, limit)) * clamp(u, -limit, limit) of the K-split partials
    part [S, P, 2 inter] fp32 (g | u summed over the splits in order), in h's dtype: the gate-up
    GEMM's split epilogue in one launch."""
    numel, block = h.numel(), 1024
    assert (
        part.is_contiguous()
        and h.is_contiguous()
        and part.shape[1:] == (h.shape[0], 2 * h.shape[1])
    )
    if numel:
        _activate_splits_kernel[(triton.cdiv(numel, block),)](
            part, h, numel, h.shape[1], part.shape[0], limit, BLOCK=block,
            OUT_BF16=h.dtype == torch.bfloat16,
        )  # fmt: skip
    return h


def compile_variants(
    w13, w2, scales, fmt: str, block: tuple[int, int], num_slots: int, dtype: torch.dtype
) -> None:
    """Runs fused_moe once per tile variant a call with num_slots slots per token can take (a few
    pairs, listed, sorted, and 16-bit prefills that decode their experts first), so that
    serving compiles nothing whatever batches arrive."""
    hidden, device = w2.shape[1], w13.device
    counts = (FP4_WIDE_PAIRS, small_pairs(w13.shape[0]), FP32_FEW_PAIRS, LIST_MAX_PAIRS)
    if fmt != "dense" and dtype != torch.float32:  # prefills that decode the experts first
        counts += (DEQUANT_PAIRS_PER_EXPERT * w13.shape[0],)
    for num_tokens in (1, *(pairs // num_slots + 1 for pairs in counts)):
        x = torch.zeros(num_tokens, hidden, dtype=dtype, device=device)
        ids = torch.zeros(num_tokens, num_slots, dtype=torch.long, device=device)
        weights = torch.zeros(num_tokens, num_slots, dtype=torch.float32, device=device)
        fused_moe(x, ids, weights, w13, w2, 1.0, scales, fmt, block)
    inter = w13.shape[1] // 2  # the split epilogue, whether or not a call above split K
    activate_splits(torch.zeros(2, 1, 2 * inter, device=device),
                    torch.empty(1, inter, dtype=dtype, device=device), 1.0)  # fmt: skip


def fused_moe_ref(
    x,
    ids,
    weights,
    w13,
    w2,
    limit: float,
    scales=None,
    fmt: str = "dense",
    block: tuple[int, int] = (128, 128),
) -> torch.Tensor:
    """The torch reference of `fused_moe`: stacked weights dequantised to fp32, a loop over the
    experts in fp32, h rounded to x's dtype between the two products as the kernels store it."""
    inter = _check(x, w13, w2, scales, fmt, block)
    if fmt == "dense":
        w13, w2 = w13.float(), w2.float()
    else:
        s13, s2 = scales
        half = s13.shape[1] // 2  # w1's scale rows, then w3's (their own block grids)
        w13 = torch.cat(
            [
                dequantize_ref(w13[:, :inter], s13[:, :half], fmt, block),
                dequantize_ref(w13[:, inter:], s13[:, half:], fmt, block),
            ],
            dim=1,
        )
        w2 = dequantize_ref(w2, s2, fmt, block)
    flat, coef = ids.reshape(-1), weights.reshape(-1).float()
    token = torch.arange(flat.numel(), device=x.device) // ids.shape[1]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(flat).tolist():
        pairs = (flat == e).nonzero().squeeze(1)
        gate_up = x[token[pairs]].float() @ w13[e].t()  # [pairs, 2 * inter]
        gate = gate_up[:, :inter].clamp(max=limit)
        up = gate_up[:, inter:].clamp(min=-limit, max=limit)
        h = (torch.nn.functional.silu(gate) * up).to(x.dtype).float()
        out.index_add_(0, token[pairs], (h @ w2[e].t()) * coef[pairs, None])
    return out.to(x.dtype)
