"""Grammar masks on a batch's logits (`token_mask.apply_token_masks`): masked rows keep exactly
the tokens whose bit is set and put -inf elsewhere, free rows are copied, two rows may share a
mask, and the input is left as it was. The Triton kernel's bytes equal the torch reference's."""

import pytest
import torch

from dsv4ray.kernels.token_mask import apply_token_masks, apply_token_masks_ref


def _case(rows, vocab, mask_of, seed):
    g = torch.Generator().manual_seed(seed)
    words = (vocab + 31) // 32
    logits = torch.randn(rows, vocab, generator=g) * 10
    allowed = torch.rand(max(mask_of) + 1, words * 32, generator=g) < 0.3
    bits = (allowed.view(-1, words, 32).long() << torch.arange(32)).sum(-1)  # [G, W] < 2**32
    packed = torch.cat([torch.tensor(mask_of), bits.flatten()]).to(torch.int64)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return logits, packed, words, allowed[:, :vocab]


@pytest.mark.parametrize("vocab", [37, 512, 2048 + 70])
@pytest.mark.parametrize("mask_of", [[0], [-1, 0, -1, 1], [1, 1, -1, 0, 0]])
def test_rows_keep_exactly_their_allowed_tokens(vocab, mask_of, device):
    logits, packed, words, allowed = _case(len(mask_of), vocab, mask_of, vocab + len(mask_of))
    before = logits.clone()
    out = apply_token_masks(logits.to(device), packed.to(device), words).cpu()
    for row, g in enumerate(mask_of):
        want = logits[row] if g < 0 else logits[row].masked_fill(~allowed[g], float("-inf"))
        assert torch.equal(out[row], want)
    assert torch.equal(logits, before)
    ref = apply_token_masks_ref(logits, packed, words)
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))


def test_strided_rows_and_no_rows(device):
    logits, packed, words, allowed = _case(2, 100, [0, -1], 7)
    wide = torch.zeros(2, 160)
    wide[:, :100] = logits
    out = apply_token_masks(wide[:, :100].to(device), packed.to(device), words).cpu()
    assert torch.equal(out[1], logits[1])
    assert torch.equal(out[0], logits[0].masked_fill(~allowed[0], float("-inf")))
    empty = apply_token_masks(torch.zeros(0, 100, device=device), packed[:0].to(device), words)
    assert empty.shape == (0, 100)
