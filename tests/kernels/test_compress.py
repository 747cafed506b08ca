"""compress_norm_rope_store: the reference against SPEC_MODEL.md section 3 computed densely, and the
Triton kernel against the reference, over prefill, chunked prefill, decode and mixed ragged batches.
"""

import copy
import math

import pytest
import torch

from dsv4ray.cache.formats import DTYPES
from dsv4ray.cache.layout import read_entries
from dsv4ray.cache.page_layout import layout_for
from dsv4ray.kernels.compress import (
    compress_norm_rope_store,
    compress_norm_rope_store_ref,
    reset_state,
)
from dsv4ray.kernels.testing import assert_close, assert_entries_close

EPS = 1e-6
POOLS = [(4, "c4"), (4, "indexer"), (128, "c128")]
LENGTHS = {4: [23, 9, 4], 128: [260, 131]}


def rope_tables(num_positions: int):
    angles = torch.arange(num_positions)[:, None] * 10000.0 ** (-torch.arange(32) / 32)
    return angles.cos(), angles.sin()  # [P, 32] each


def dense_entries(kv, score, ape, norm_weight, cos, sin, ratio):
    """SPEC_MODEL.md section 3 for one whole sequence, one block at a time -> [L // ratio, d]."""
    d = norm_weight.numel()
    s = score + ape[torch.arange(kv.shape[0]) % ratio]
    entries = []
    for w in range(kv.shape[0] // ratio):
        block = slice(ratio * w, ratio * (w + 1))
        if ratio == 128:
            rows_kv, rows_s = kv[block], s[block]
        else:  # overlap: first halves of block w - 1 (kv 0, score -inf before the start), then ours
            prev = slice(4 * w - 4, 4 * w)
            prev_kv = kv[prev, :d] if w else torch.zeros(4, d)
            prev_s = s[prev, :d] if w else torch.full((4, d), float("-inf"))
            rows_kv = torch.cat((prev_kv, kv[block, d:]))
            rows_s = torch.cat((prev_s, s[block, d:]))
        x = (torch.softmax(rows_s, 0) * rows_kv).sum(0)
        x = x / torch.sqrt(x.pow(2).mean() + EPS) * norm_weight
        pos = ratio * w  # the block's first token; interleaved pairs as complex numbers
        z = torch.view_as_complex(x[-64:].reshape(32, 2).contiguous())
        z = z * torch.complex(cos[pos], sin[pos])
        entries.append(torch.cat((x[:-64], torch.view_as_real(z).reshape(64))))
    return torch.stack(entries)


class Sequences:
    """Requests' compressor inputs, ring slots (0 included) and entry slots on shuffled pages."""

    def __init__(self, ratio, layout, lengths, device, ring=None):
        self.ratio, self.layout, self.device = ratio, layout, device
        cd = (2 if ratio == 4 else 1) * layout.dim
        self.kv = [torch.randn(n, cd) for n in lengths]
        self.score = [2 * torch.randn(n, cd) for n in lengths]
        self.ape = torch.randn(ratio, cd)
        self.norm_weight = torch.rand(layout.dim) + 0.5
        self.cos, self.sin = rope_tables(max(lengths) + 1)
        self.ring_slot = list(reversed(range(len(lengths))))
        ring = ring or (8 if ratio == 4 else 128)
        self.state_kv = torch.zeros(len(lengths) + 1, ring, cd, device=device)
        self.state_score = torch.full_like(self.state_kv, float("-inf"))
        epp = layout.entries_per_page
        page_counts = [max(1, math.ceil(n // ratio / epp)) for n in lengths]
        page_ids = torch.randperm(sum(page_counts)).split(page_counts)
        self.entry_slots = [
            (ids[:, None] * epp + torch.arange(epp)).reshape(-1)[: n // ratio]
            for ids, n in zip(page_ids, lengths, strict=True)
        ]
        self.pages = torch.zeros(
            sum(page_counts), layout.page_bytes, dtype=torch.uint8, device=device
        )

    def run(self, fn, chunks, drop_stores=False) -> None:
        """One batch: chunks = [(request, first position, token count)], requests contiguous."""
        parts = {"kv": [], "score": [], "pos": [], "ring": [], "start": [], "loc": []}
        for r, start, n in chunks:
            pos = torch.arange(start, start + n)
            done = (pos + 1) % self.ratio == 0
            loc = torch.full((n,), -1)
            loc[done] = -1 if drop_stores else self.entry_slots[r][pos[done] // self.ratio]
            for key, value in (
                ("kv", self.kv[r][start : start + n]),
                ("pos", pos),
                ("loc", loc),
                ("score", self.score[r][start : start + n]),
                ("ring", torch.full((n,), self.ring_slot[r])),
                ("start", torch.full((n,), start)),
            ):
                parts[key].append(value)
        t = {k: torch.cat(v).to(self.device) for k, v in parts.items()}
        const = [x.to(self.device) for x in (self.ape, self.norm_weight)]
        fn(
            t["kv"],
            t["score"],
            t["pos"],
            t["ring"],
            t["start"],
            self.state_kv,
            self.state_score,
            *const,
            EPS,
            self.cos.to(self.device),
            self.sin.to(self.device),
            t["loc"],
            self.pages,
            self.layout,
            self.ratio,
        )

    def entries(self, r):
        return read_entries(self.pages.cpu(), self.entry_slots[r], self.layout)


CHUNK_CYCLE = [5, 1, 7, 3, 130]


def _chunk_size(plan: str, step: int, request: int) -> int:
    if plan == "one_batch":
        return 10**6
    if plan == "decode":  # a short prefill, then one token per step
        return 3 if step == 0 else 1
    return CHUNK_CYCLE[(step + request) % len(CHUNK_CYCLE)]


def schedule(lengths, plan):
    """Batches [(request, start, count)] that cover every request following `plan`."""
    steps, done = [], [0] * len(lengths)
    while any(d < n for d, n in zip(done, lengths, strict=True)):
        step = []
        for r, n in enumerate(lengths):
            if done[r] < n:
                size = min(_chunk_size(plan, len(steps), r), n - done[r])
                step.append((r, done[r], size))
                done[r] += size
        steps.append(step)
    return steps


@pytest.mark.parametrize("ratio,kind", POOLS)
@pytest.mark.parametrize("plan", ["one_batch", "chunks", "decode"])
def test_reference_matches_dense_formula(ratio, kind, plan):
    seqs = Sequences(ratio, layout_for(kind, "fp32"), LENGTHS[ratio], torch.device("cpu"))
    for step in schedule(LENGTHS[ratio], plan):
        seqs.run(compress_norm_rope_store_ref, step)
    for r in range(len(LENGTHS[ratio])):
        dense = dense_entries(
            seqs.kv[r], seqs.score[r], seqs.ape, seqs.norm_weight, seqs.cos, seqs.sin, ratio
        )
        assert_close(f"{kind}/{plan}/request {r}", seqs.entries(r), dense, 1e-5, 1e-5)


MIXED = {  # prefill, chunked prefill and decode of several requests in the same batches
    4: [
        [(0, 0, 9), (1, 0, 4)],
        [(0, 9, 1), (1, 4, 5), (2, 0, 6)],
        [(0, 10, 1), (1, 9, 1)],
        [(0, 11, 8), (1, 10, 1), (2, 6, 1)],
    ],
    128: [[(0, 0, 127), (1, 0, 20)], [(0, 127, 1), (1, 20, 110)], [(0, 128, 72), (1, 130, 1)]],
}


@pytest.mark.parametrize("ratio,kind", POOLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_reference(ratio, kind, dtype, device):
    lengths = [200, 140] if ratio == 128 else [19, 11, 7]
    seqs = Sequences(ratio, layout_for(kind, dtype), lengths, device)
    ref = copy.deepcopy(seqs)
    for i, step in enumerate(MIXED[ratio]):
        seqs.run(compress_norm_rope_store, step)
        ref.run(compress_norm_rope_store_ref, step)
        assert torch.equal(seqs.state_kv, ref.state_kv), f"step {i}: ring kv"
        assert torch.equal(seqs.state_score, ref.state_score), f"step {i}: ring scores"
        for r in range(len(lengths)):
            name = f"{kind}/{dtype} step {i} request {r}"
            assert_entries_close(name, seqs.pages, ref.pages, seqs.entry_slots[r], seqs.layout)


LONG = {  # batches of more than 1,024 tokens: the completion list spans several blocks
    4: ([700, 500], [[(0, 0, 13), (1, 0, 3)], [(0, 13, 687), (1, 3, 497)]]),
    128: (
        [900, 700, 300],
        [[(0, 0, 500), (1, 0, 100)], [(0, 500, 400), (1, 100, 600), (2, 0, 300)]],
    ),
}


@pytest.mark.parametrize("ratio,kind", [(4, "c4"), (128, "c128")])
def test_batches_over_several_list_blocks_match_reference(ratio, kind, device):
    """Entries listed by several blocks of tokens, a request's chunk that reads its ring among
    them, come out as the reference's."""
    lengths, steps = LONG[ratio]
    seqs = Sequences(ratio, layout_for(kind, "fp8"), lengths, device)
    ref = copy.deepcopy(seqs)
    for i, step in enumerate(steps):
        seqs.run(compress_norm_rope_store, step)
        ref.run(compress_norm_rope_store_ref, step)
        assert torch.equal(seqs.state_kv, ref.state_kv), f"step {i}: ring kv"
        for r in range(len(lengths)):
            name = f"{kind} step {i} request {r}"
            assert_entries_close(name, seqs.pages, ref.pages, seqs.entry_slots[r], seqs.layout)


@pytest.mark.parametrize("ratio,kind", [(4, "c4"), (128, "c128")])
def test_kernel_with_speculative_ring_matches_dense(ratio, kind, device):
    lengths = [140] if ratio == 128 else [13, 6]
    ring = 2 * (8 if ratio == 4 else 128)
    seqs = Sequences(ratio, layout_for(kind, "fp32"), lengths, device, ring=ring)
    for step in schedule(lengths, "chunks"):
        seqs.run(compress_norm_rope_store, step)
    for r in range(len(lengths)):
        dense = dense_entries(
            seqs.kv[r], seqs.score[r], seqs.ape, seqs.norm_weight, seqs.cos, seqs.sin, ratio
        )
        assert_close(f"request {r}", seqs.entries(r), dense, 1e-5, 1e-5)


@pytest.mark.parametrize("fn", [compress_norm_rope_store, compress_norm_rope_store_ref])
def test_negative_out_loc_stores_nothing_but_updates_the_ring(fn, device):
    seqs = Sequences(4, layout_for("c4", "fp8"), [10], device)
    seqs.run(fn, [(0, 0, 10)], drop_stores=True)
    assert (seqs.pages == 0).all()
    rows = torch.arange(2, 10) % 8  # the last 8 positions of the request
    assert torch.equal(seqs.state_kv[0, rows].cpu(), seqs.kv[0][2:10])
    expected = seqs.score[0][2:10] + seqs.ape[torch.arange(2, 10) % 4]
    assert torch.equal(seqs.state_score[0, rows].cpu(), expected)


def test_reset_state_empties_only_the_given_rings(device):
    state_kv = torch.randn(4, 8, 16, device=device)
    state_score = torch.randn(4, 8, 16, device=device)
    before_kv, before_score = state_kv.clone(), state_score.clone()
    reset_state(state_kv, state_score, torch.tensor([0, 2], device=device))
    assert (state_kv[[0, 2]] == 0).all() and (state_score[[0, 2]] == float("-inf")).all()
    assert torch.equal(state_kv[[1, 3]], before_kv[[1, 3]])
    assert torch.equal(state_score[[1, 3]], before_score[[1, 3]])


def test_inconsistent_arguments_are_rejected(device):
    seqs = Sequences(4, layout_for("indexer", "fp8"), [8], device)
    with pytest.raises(ValueError, match="rotate"):
        seqs.run(lambda *a: compress_norm_rope_store(*a, rotate=False), [(0, 0, 8)])
    seqs.layout = layout_for("c128", "fp8")
    with pytest.raises(ValueError, match="ratio-4"):
        seqs.run(compress_norm_rope_store, [(0, 0, 8)])
