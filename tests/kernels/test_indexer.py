"""indexer_topk: the reference against SPEC_MODEL.md section 4 written out per token, the Triton
kernel against the reference, the tie rule and -1 padding."""

import pytest
import torch

from dsv4ray.cache.formats import DTYPES
from dsv4ray.cache.page_layout import layout_for
from dsv4ray.kernels.indexer import indexer_scores_ref, indexer_topk, indexer_topk_ref
from dsv4ray.kernels.store_kv import store_kv_ref
from dsv4ray.kernels.testing import assert_close

NUM_HEADS, EPP = 8, 64


class Pool:
    """An indexer pool with raw keys per request; page_table rows point at shuffled pages."""

    def __init__(self, dtype, lengths, device, max_pages=3, positive=False, integers=False):
        self.layout = layout_for("indexer", dtype)
        num_pages = len(lengths) * max_pages
        self.page_table = torch.randperm(num_pages).view(len(lengths), max_pages)  # page 0 included
        # integer keys give dot products that are exact in any summation order (CPU BLAS sums
        # rows of one tile in different orders, so float keys may not tie to the last bit)
        self.keys = [_integers((n, 128)) if integers else torch.randn(n, 128) for n in lengths]
        for k in self.keys:
            if k.shape[0] >= 15:
                k[10:15] = k[3]  # duplicate keys: exact score ties
            if positive:
                k.abs_()
        self.pages = torch.zeros(num_pages, self.layout.page_bytes, dtype=torch.uint8)
        for r, k in enumerate(self.keys):
            s = torch.arange(k.shape[0])
            store_kv_ref(k, self.pages, self.page_table[r, s // EPP] * EPP + s % EPP, self.layout)
        self.pages, self.page_table = self.pages.to(device), self.page_table.to(device)

    def topk(self, fn, q, weights, req_idx, bound, topk):
        dev = self.pages.device
        return fn(
            q.to(dev),
            weights.to(dev),
            self.pages,
            self.page_table,
            req_idx.to(dev),
            bound.to(dev),
            topk,
            self.layout,
        ).cpu()


def _integers(shape) -> torch.Tensor:
    return torch.randint(-3, 4, shape).float()


def _direct_topk(pool, q, weights, req_idx, bound, topk):
    """score(t, s) = sum_h relu(q[t,h] . k[s]) w[t,h], s < bound; order (-score, s); -1 padded."""
    out = torch.full((q.shape[0], topk), -1)
    for t in range(q.shape[0]):
        keys = pool.keys[req_idx[t]][: bound[t]]
        scores = ((q[t] @ keys.T).relu() * weights[t][:, None]).sum(0)
        ranked = sorted(range(len(scores)), key=lambda s: (-scores[s].item(), s))[:topk]
        out[t, : len(ranked)] = torch.tensor(ranked, dtype=torch.int64)
    return out


def _inputs(num_tokens, lengths):
    req_idx = torch.randint(0, len(lengths), (num_tokens,))
    bound = torch.tensor([torch.randint(0, lengths[r] + 1, ()).item() for r in req_idx.tolist()])
    bound[:2] = torch.tensor([0, lengths[req_idx[1]]])  # an empty bound and a full one
    q, weights = torch.randn(num_tokens, NUM_HEADS, 128), torch.randn(num_tokens, NUM_HEADS)
    return q, weights, req_idx, bound


def test_reference_matches_the_formula_in_exact_pages(device):
    lengths = [150, 70, 9]
    pool = Pool("fp32", lengths, device)
    q, weights, req_idx, bound = _inputs(12, lengths)
    weights[3] = 0.0  # every score 0: the lowest positions win
    got = pool.topk(indexer_topk_ref, q, weights, req_idx, bound, 16)
    assert torch.equal(got, _direct_topk(pool, q, weights, req_idx, bound, 16))
    assert got[3, : min(16, bound[3])].tolist() == list(range(min(16, bound[3].item())))


def test_fp8_scores_follow_exact_scores(device):
    # the fp8 format stores rotated keys and rotates q: scores change only by quantisation error
    lengths = [120, 40]
    q, weights, req_idx, bound = _inputs(6, lengths)
    scores = {}
    for dtype in ("fp32", "fp8"):
        torch.manual_seed(1)
        pool = Pool(dtype, lengths, device)
        dev = pool.pages.device
        scores[dtype] = indexer_scores_ref(
            q.to(dev),
            weights.to(dev),
            pool.pages,
            pool.page_table,
            req_idx.to(dev),
            bound.to(dev),
            pool.layout,
        ).cpu()
    scale = scores["fp32"][torch.isfinite(scores["fp32"])].abs().max().item()
    assert_close("fp8 scores", scores["fp8"], scores["fp32"], 0.05 * scale, 0.05)


def _assert_same_selection(name, got, ref, scores):
    """Equal picks; where they differ (near-ties under bf16 GPU dots) the scores must tie."""
    assert torch.equal(got < 0, ref < 0), f"{name}: -1 padding differs"
    rows = (got != ref).any(1).nonzero()[:, 0]
    for t in rows.tolist():
        picked = scores[t, got[t][got[t] >= 0]].sort().values
        wanted = scores[t, ref[t][ref[t] >= 0]].sort().values
        assert_close(f"{name}: scores picked for token {t}", picked, wanted, 1e-2, 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_reference(dtype, device):
    lengths = [190, 64, 1, 65]
    pool = Pool(dtype, lengths, device, max_pages=4)
    q, weights, req_idx, bound = _inputs(13, lengths)
    for topk in (8, 200):  # fewer than the visible entries (190 at most), and more than all
        got = pool.topk(indexer_topk, q, weights, req_idx, bound, topk)
        ref = pool.topk(indexer_topk_ref, q, weights, req_idx, bound, topk)
        dev = pool.pages.device
        scores = indexer_scores_ref(
            q.to(dev),
            weights.to(dev),
            pool.pages,
            pool.page_table,
            req_idx.to(dev),
            bound.to(dev),
            pool.layout,
        ).cpu()
        _assert_same_selection(f"{dtype} top-{topk}", got, ref, scores)
    assert (got[bound == 0] == -1).all()


@pytest.mark.parametrize("fn", [indexer_topk, indexer_topk_ref])
def test_equal_scores_go_to_the_lower_position(fn, device):
    pool = Pool("bf16", [100], device, max_pages=2, positive=True, integers=True)
    q, weights = _integers((3, NUM_HEADS, 128)), torch.randint(1, 9, (3, NUM_HEADS)) / 8
    weights[0] = 0.0  # all scores 0
    q[1] = -q[1].abs()  # q . k < 0 for every key: all relu scores 0 again
    bound = torch.tensor([100, 100, 100])
    got = pool.topk(fn, q, weights, torch.zeros(3, dtype=torch.int64), bound, 100).tolist()
    assert got[0] == list(range(100)) and got[1] == list(range(100))
    assert sorted(got[2]) == list(range(100))
    duplicates = [s for s in got[2] if s == 3 or 10 <= s < 15]  # five copies of key 3
    assert duplicates == sorted(duplicates)


@pytest.mark.parametrize("fn", [indexer_topk, indexer_topk_ref])
def test_no_tokens_gives_an_empty_result(fn, device):
    pool = Pool("fp8", [10], device)
    empty = torch.zeros(0, dtype=torch.int64)
    got = pool.topk(fn, torch.zeros(0, NUM_HEADS, 128), torch.zeros(0, NUM_HEADS), empty, empty, 4)
    assert got.shape == (0, 4)
