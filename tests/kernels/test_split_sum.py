"""The split-K epilogue (`quant_tiles.sum_splits`): fp32 partials [S, M * group, W] added over the
splits, then over each row's group of rows (a token's expert slots), in that order, and rounded
once into the output's dtype. The bytes equal torch's cast of the same sequential sum."""

import pytest
import torch

from dsv4ray.kernels.quant_tiles import sum_splits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("splits,group", [(5, 1), (1, 6), (3, 2), (33, 1), (9, 3)])
def test_partials_add_in_order_and_round_once(splits, group, dtype, device):
    g = torch.Generator().manual_seed(splits * 10 + group)
    rows, width = 3, 700
    shape = (splits, rows * group, width)
    part = torch.randn(shape, generator=g) * 2.0 ** torch.randint(-20, 20, shape, generator=g)
    want = torch.zeros(rows, width)
    for s in range(splits):
        for j in range(group):
            want += part[s, j::group]
    out = sum_splits(part.to(device), torch.empty(rows, width, dtype=dtype, device=device), group)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(out.cpu().view(bits), want.to(dtype).view(bits))


def test_no_rows(device):
    out = sum_splits(torch.zeros(2, 0, 8, device=device), torch.empty(0, 8, device=device), 3)
    assert out.shape == (0, 8)
