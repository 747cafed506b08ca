"""topk_rows: the radix-select top-k against its torch reference (exact positions, ties to the lower
position) on rows with ties, masked entries, short rows and k above the row length."""

import pytest
import torch

from dsv4ray.kernels.topk import MASKED_SCORE, ordered_int32_ref, topk_rows, topk_rows_ref


def _scores(num_rows, num_cols, device):
    x = torch.randn(num_rows, num_cols)
    x[0] = 0.0  # every score equal: the lowest positions win
    x[1, ::3] = x[1, 0]  # a third of the row ties with one value
    x[2] = -x[2].abs()  # only negative scores, -0.0 among them
    x[2, -1] = -0.0
    x[3, 10:] = float("-inf")
    ordered = ordered_int32_ref(x)
    ordered[4, num_cols // 2 :] = MASKED_SCORE  # half the row may never be picked
    return ordered.to(device)


CASES = [(5000, 64), (130, 200), (600, 250), (1, 3), (2049, 16)]  # row length, k


@pytest.mark.parametrize("num_cols,topk", CASES)
def test_kernel_matches_reference(num_cols, topk, device):
    scores = _scores(6, num_cols, device)
    got, ref = topk_rows(scores, topk).cpu(), topk_rows_ref(scores, topk).cpu()
    assert torch.equal(got, ref), (got != ref).nonzero()[:5].tolist()
    valid = min(topk, num_cols)
    assert got[0, :valid].tolist() == list(range(valid))  # ties go to the lower position
    assert (got[4] < num_cols // 2).all() and (got[:, valid:] == -1).all()


def test_ordered_int32_keeps_the_float_order():
    x = torch.tensor([-float("inf"), -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, float("inf")])
    ordered = ordered_int32_ref(x)
    assert (ordered[1:] >= ordered[:-1]).all() and ordered[3] == ordered[4]
    assert (ordered > MASKED_SCORE).all()


@pytest.mark.parametrize("fn", [topk_rows, topk_rows_ref])
def test_empty_inputs(fn, device):
    assert fn(torch.zeros(0, 8, dtype=torch.int32, device=device), 4).shape == (0, 4)
    assert (fn(torch.zeros(3, 0, dtype=torch.int32, device=device), 4) == -1).all()
