"""topk_rows: the radix-select top-k against its torch reference (exact positions, ties to the lower
position) on rows with ties, masked entries, short rows and k above the row length, in one pass
and with rows cut into segments (ties across segment boundaries, a short last segment, segments
shorter than k)."""

import pytest
import torch

from dsv4ray.kernels import topk as topk_kernels
from dsv4ray.kernels.bits import interpreting
from dsv4ray.kernels.topk import (
    MASKED_SCORE,
    num_segments,
    ordered_int32_ref,
    topk_rows,
    topk_rows_ref,
)


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


@pytest.mark.parametrize("num_cols,topk,segments", [(5000, 64, 3), (130, 200, 2), (2049, 16, 7)])
def test_segmented_rows_match_the_reference(num_cols, topk, segments, device):
    scores = _scores(6, num_cols, device)
    scores[5] = ordered_int32_ref(torch.randint(0, 3, (num_cols,)).float())  # ties everywhere
    got = topk_rows(scores, topk, segments=segments).cpu()
    ref = topk_rows_ref(scores, topk).cpu()
    assert torch.equal(got, ref), (got != ref).nonzero()[:5].tolist()


@pytest.mark.parametrize("num_cols,topk,segments", [(600, 64, 1), (600, 64, 4), (130, 200, 1)])
def test_rows_with_lengths_read_only_their_visible_entries(num_cols, topk, segments, device):
    """lengths: the entries past a row's length are MASKED padding (the indexer's bound). Rows of
    no, fewer than k, exactly k and more than k visible entries, and the whole row, give the
    reference's picks; the padding is never read (garbage there changes nothing)."""
    scores = _scores(8, num_cols, device)
    lengths = torch.tensor([0, 1, topk - 3, topk, topk + 5, num_cols // 2, num_cols, num_cols],
                           dtype=torch.int64).clamp(max=num_cols)  # fmt: skip
    masked = scores.clone().cpu()
    masked[torch.arange(num_cols)[None, :] >= lengths[:, None]] = MASKED_SCORE
    ref = topk_rows_ref(masked, topk)
    garbage = masked.clone()
    pad = torch.arange(num_cols)[None, :] >= lengths[:, None]
    garbage[pad] = torch.randint(-(2**30), 2**30, (int(pad.sum()),), dtype=torch.int32)
    got = topk_rows(garbage.to(device), topk, segments, lengths.to(device)).cpu()
    assert torch.equal(got, ref), (got != ref).nonzero()[:5].tolist()
    assert (got[0] == -1).all() and got[1, 0] == 0 and (got[1, 1:] == -1).all()


def _narrowing_row(group: int, num_cols: int, gen) -> torch.Tensor:
    """A row whose k-th largest lies among `group` entries sharing their top 12 bits: 20 entries
    above them, the rest below; ties inside the group (low bits drawn from 64 values)."""
    high = 0x3A5 << 20  # the group's top 12 bits, as signed int32 score bits
    row = torch.randint(0, 0x100 << 20, (num_cols,), generator=gen, dtype=torch.int64)
    where = torch.randperm(num_cols, generator=gen)
    row[where[:group]] = high | torch.randint(0, 64, (group,), generator=gen) << 8
    row[where[group : group + 20]] = (0x3A6 << 20) + torch.arange(20)
    return row.to(torch.int32)


@pytest.fixture
def narrow(monkeypatch) -> int:
    """The kernel's NARROW: as shipped natively; under the interpreter, which pays per op on
    tiles of NARROW entries, 256 (rows and k below scale with it)."""
    if interpreting():
        monkeypatch.setattr(topk_kernels, "NARROW", 256)
    return topk_kernels.NARROW


@pytest.mark.parametrize("extra", [0, 1, "double"])
def test_rows_narrowed_to_their_candidates_match_the_reference(extra, narrow, device):
    """A range longer than NARROW narrows to the entries matching the select's digits once at
    most NARROW do, and finishes on those alone: the picks are the reference's whether the
    matching entries fit (group <= NARROW) or not, for a whole row, segments, lengths and
    second-pass candidate rows longer than NARROW."""
    group = 2 * narrow if extra == "double" else narrow + extra
    gen = torch.Generator().manual_seed(group)
    num_cols = 3 * narrow + 7
    scores = torch.stack([_narrowing_row(group, num_cols, gen) for _ in range(3)])
    scores[2, -narrow:] = MASKED_SCORE  # masked padding inside a long row
    scores = scores.to(device)
    wide = narrow * 11 // 32  # x 4 segments: a candidate row of 1.4 NARROW entries
    for topk in (64, wide):
        ref = topk_rows_ref(scores.cpu(), topk)
        for segments in (1, 4):
            got = topk_rows(scores, topk, segments=segments).cpu()
            assert torch.equal(got, ref), (topk, segments, (got != ref).nonzero()[:5].tolist())
    lengths = torch.tensor([num_cols, 2 * narrow + 1, narrow + 3], dtype=torch.int64)
    masked = scores.cpu().clone()
    masked[torch.arange(num_cols)[None, :] >= lengths[:, None]] = MASKED_SCORE
    got = topk_rows(scores, 64, lengths=lengths.to(device)).cpu()
    assert torch.equal(got, topk_rows_ref(masked, 64))


def test_long_rows_of_a_small_batch_take_segments(device):
    """A decode batch over a long context: the row is cut without being asked."""
    num_cols, topk = 3 * 8192 + 5, 16
    assert num_segments(2, num_cols, topk, torch.device(device)) > 1
    assert num_segments(2, 8192, topk, torch.device(device)) == 1  # one chunk: one pass
    assert num_segments(100, num_cols, topk, torch.device(device)) == 1  # rows fill the SMs
    scores = _scores(6, num_cols, device)[[1, 4]].contiguous()
    got, ref = topk_rows(scores, topk).cpu(), topk_rows_ref(scores, topk).cpu()
    assert torch.equal(got, ref), (got != ref).nonzero()[:5].tolist()


def test_ordered_int32_keeps_the_float_order():
    x = torch.tensor([-float("inf"), -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, float("inf")])
    ordered = ordered_int32_ref(x)
    assert (ordered[1:] >= ordered[:-1]).all() and ordered[3] == ordered[4]
    assert (ordered > MASKED_SCORE).all()


@pytest.mark.parametrize("fn", [topk_rows, topk_rows_ref])
def test_empty_inputs(fn, device):
    assert fn(torch.zeros(0, 8, dtype=torch.int32, device=device), 4).shape == (0, 4)
    assert (fn(torch.zeros(3, 0, dtype=torch.int32, device=device), 4) == -1).all()
