"""Gumbel-max draws: the noise, the add and the argmax fused in one Triton pass per row (CUDA),
and the torch reference that runs elsewhere.

``gumbel_argmax(values [S, V] fp32, vocab_ids [S, V] int64 or None, key [S] int64)`` -> [S]
int64 column of the largest ``values + G(key, vocab id)`` (the first on ties); ``gumbel_argmax_ref``
is the same in torch. G is ``gumbel_noise``: a 32-bit hash (``mix32``, which also makes the
sampler's row keys) of the key and the vocab id, as the odd multiples of 2**-24 in (0, 1). The
kernel's uint32 arithmetic wraps as the int64 torch version masks, so for finite and -inf values
only fp32 log's last bit can differ between the two. NaN values are outside the contract (the
kernel passes over them, torch's argmax takes them): the sampler fails a row with a non-finite
maximum before its draw counts. ``dispatch.gumbel_argmax`` picks by the tensors' device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048
MASK32 = 0xFFFFFFFF
# odd multipliers below 2**31: x * m < 2**63 for x < 2**32, so int64 products never overflow
_MULTIPLIERS = (0x7FEB352D, 0x5BD1E995, 0x27D4EB2D)
_GOLDEN = 0x9E3779B9  # spreads consecutive vocab ids before they meet the row key


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 16)
    x = x * 0x5BD1E995
    x = x ^ (x >> 16)
    x = x * 0x27D4EB2D
    return x ^ (x >> 16)


@triton.jit(do_not_specialize=["V", "stride_vs", "stride_is"])
def _gumbel_argmax_kernel(
    values_ptr,
    ids_ptr,
    key_ptr,
    out_ptr,
    V,
    stride_vs,
    stride_is,
    HAS_IDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    key = tl.load(key_ptr + row).to(tl.uint32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_col = tl.full([BLOCK], 0, tl.int64)
    for start in range(0, V, BLOCK):
        offs_v = start + tl.arange(0, BLOCK)
        mask = offs_v < V
        x = tl.load(values_ptr + row.to(tl.int64) * stride_vs + offs_v, mask=mask, other=0.0)
        if HAS_IDS:
            vocab = tl.load(ids_ptr + row.to(tl.int64) * stride_is + offs_v, mask=mask, other=0)
        else:
            vocab = offs_v
        bits = _mix32(key ^ (vocab.to(tl.uint32) * 0x9E3779B9)) >> 9
        uniform = (bits * 2 + 1).to(tl.float32) * 5.9604644775390625e-08  # 2**-24
        score = x + -tl.log(-tl.log(uniform))
        score = tl.where(mask, score, float("-inf"))
        better = score > best  # strict: the earlier column keeps a tie
        best = tl.where(better, score, best)
        best_col = tl.where(better, offs_v.to(tl.int64), best_col)
    top = tl.max(best, axis=0)
    col = tl.min(tl.where(best == top, best_col, V), axis=0)
    tl.store(out_ptr + row, tl.where(col < V, col, 0))


def gumbel_argmax(values: torch.Tensor, vocab_ids: torch.Tensor | None, key: torch.Tensor):
    """values [S, V] fp32 (row-contiguous), vocab_ids [S, V] int64 or None (column = id), key
    [S] int64 in [0, 2**32) -> [S] int64 winning columns; a row of -inf gives column 0."""
    assert values.dtype == torch.float32 and values.stride(-1) == 1, "values: fp32 rows"
    assert vocab_ids is None or (vocab_ids.dtype == torch.int64 and vocab_ids.stride(-1) == 1)
    num_rows, vocab_size = values.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=values.device)
    if num_rows == 0:
        return out
    ids = vocab_ids if vocab_ids is not None else values
    _gumbel_argmax_kernel[(num_rows,)](
        values,
        ids,
        key.contiguous(),
        out,
        vocab_size,
        values.stride(0),
        ids.stride(0),
        HAS_IDS=vocab_ids is not None,
        BLOCK=BLOCK,
    )
    return out


def gumbel_argmax_ref(values: torch.Tensor, vocab_ids: torch.Tensor | None, key: torch.Tensor):
    """The torch reference of ``gumbel_argmax`` (any device)."""
    if vocab_ids is None:
        vocab_ids = torch.arange(values.shape[-1], device=values.device)[None, :]
    return (values + gumbel_noise(key, vocab_ids)).argmax(-1)


def mix32(x):
    """A bijective hash of values in [0, 2**32), Python ints or int64 tensors alike
    (xor-shift-multiply rounds)."""
    for mult in _MULTIPLIERS:
        x = x ^ (x >> 16)
        x = (x * mult) & MASK32
    return x ^ (x >> 16)


def gumbel_noise(key: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """key [S] row keys, vocab_ids [S or 1, V] -> [S, V] fp32 Gumbel noise. Uniforms are the
    odd multiples of 2**-24 in (0, 1): exact in fp32, never 0 or 1, so the noise is finite."""
    bits = mix32(key[:, None] ^ ((vocab_ids * _GOLDEN) & MASK32)) >> 9  # 23 bits
    uniform = (bits * 2 + 1).float() * 2.0**-24
    return -torch.log(-torch.log(uniform))
