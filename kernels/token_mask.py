"""Grammar masks applied to a batch's logits in one pass: each row either copied or, where its
grammar forbids a token, set to -inf.

``apply_token_masks(logits [R, V] fp32, packed [R + G * W] int32, num_words W)`` -> [R, V] fp32
(a new tensor). ``packed`` is one host-built buffer, so that a step moves it to the device in one
copy: its first R entries give each row's mask (its index g < G, or -1: no mask, the row is
copied), the rest are G masks of W words, bit t % 32 of word t // 32 set where token t is
allowed. The kernel only copies and selects fp32 values, so it equals ``apply_token_masks_ref``
bit for bit. ``dispatch.apply_token_masks`` picks by the tensors' device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit(do_not_specialize=["R", "V", "W", "stride_row"])
def _apply_token_masks_kernel(
    logits_ptr, packed_ptr, out_ptr, R, V, W, stride_row, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < V
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=inside, other=0.0)
    mask_idx = tl.load(packed_ptr + row)
    if mask_idx >= 0:
        words_at = packed_ptr + R + mask_idx.to(tl.int64) * W
        words = tl.load(words_at + cols // 32, mask=inside, other=0)
        allowed = ((words >> (cols % 32)) & 1) != 0
        x = tl.where(allowed, x, float("-inf"))
    tl.store(out_ptr + row.to(tl.int64) * V + cols, x, mask=inside)


def apply_token_masks(logits: torch.Tensor, packed: torch.Tensor, num_words: int) -> torch.Tensor:
    """logits [R, V] fp32 (rows contiguous), packed [R + G * num_words] int32 on its device ->
    [R, V] fp32 with each masked row's forbidden tokens at -inf."""
    assert logits.dtype == torch.float32 and logits.stride(-1) == 1, "logits: fp32 rows"
    assert packed.dtype == torch.int32 and packed.is_contiguous()
    num_rows, vocab_size = logits.shape
    out = torch.empty((num_rows, vocab_size), dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return out
    grid = (num_rows, triton.cdiv(vocab_size, BLOCK))
    _apply_token_masks_kernel[grid](
        logits, packed, out, num_rows, vocab_size, num_words, logits.stride(0), BLOCK=BLOCK
    )
    return out


def apply_token_masks_ref(logits: torch.Tensor, packed: torch.Tensor, num_words: int):
    """The torch reference of ``apply_token_masks`` (any device)."""
    num_rows, vocab_size = logits.shape
    mask_idx = packed[:num_rows].long()
    masked = (mask_idx >= 0).nonzero().flatten()
    out = logits.clone()
    if masked.numel() == 0:
        return out
    words = packed[num_rows:].view(-1, num_words)[mask_idx[masked]]  # [M, W]
    shifts = torch.arange(32, dtype=torch.int32, device=packed.device)
    allowed = ((words[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab_size].bool()
    out[masked] = out[masked].masked_fill(~allowed, float("-inf"))
    return out
