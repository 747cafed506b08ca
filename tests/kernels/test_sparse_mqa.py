"""sparse_mqa: the reference against SPEC_MODEL.md section 2.5 written out per token and head, and
the Triton kernel against the reference for decode and prefill shapes in every page format."""

import math

import pytest
import torch

from dsv4ray.cache.formats import DTYPES
from dsv4ray.cache.layout import read_entries
from dsv4ray.cache.page_layout import layout_for
from dsv4ray.kernels.sparse_mqa import (
    num_splits_for,
    sparse_mqa,
    sparse_mqa_ref,
    sparse_mqa_split,
)
from dsv4ray.kernels.store_kv import store_kv_ref
from dsv4ray.kernels.testing import assert_close

SCALE = 512**-0.5


def _pool(kind, dtype, num_pages, device):
    lay = layout_for(kind, dtype)
    num = num_pages * lay.entries_per_page
    pages = torch.zeros(num_pages, lay.page_bytes, dtype=torch.uint8, device=device)
    x = 2 * torch.randn(num, 512, device=device)
    store_kv_ref(x, pages, torch.arange(num, device=device), lay)
    return lay, pages, num


def _slot_lists(num_tokens, width, num_slots, device):
    slots = torch.randint(0, num_slots, (num_tokens, width))
    slots[torch.rand(num_tokens, width) < 0.3] = -1  # holes: a short window, unselected picks
    slots[0] = -1  # a token with no keys at all
    slots[1, 0] = 0  # slot 0 is an ordinary slot
    return slots.to(device)


def _direct(q, kv_lists, sink):
    """o[t, h] = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sink_h - m)), one at a time."""
    out = torch.zeros(q.shape)
    for t in range(q.shape[0]):
        kv = kv_lists[t]
        for h in range(q.shape[1]):
            s = [float(q[t, h] @ k) * SCALE for k in kv]
            m = max(s + [sink[h].item()])
            num = sum((math.exp(x - m) * k for x, k in zip(s, kv, strict=True)), torch.zeros(512))
            out[t, h] = num / (sum(math.exp(x - m) for x in s) + math.exp(sink[h].item() - m))
    return out


@pytest.mark.parametrize("lists", ["shared", "disjoint"])
def test_reference_matches_the_formula(lists, device):
    # shared: tokens pick from a few slots (read once, like a prefill chunk's windows);
    # disjoint: each token has its own slots (gathered per token, like decode rows)
    num_tokens = 4 if lists == "shared" else 8
    window, w_pages, w_num = _pool("window", "fp32", 1, device)
    comp, c_pages, c_num = _pool("c128", "fp32", 20, device)
    q, sink = torch.randn(num_tokens, 3, 512), torch.randn(3)
    w_slots = _slot_lists(num_tokens, 10, w_num, device)
    c_slots = _slot_lists(num_tokens, 5, c_num, device)
    if lists == "disjoint":
        own = torch.arange(num_tokens * 10, device=device)
        w_slots = torch.where(w_slots >= 0, own.view(-1, 10), -1)
        c_slots = torch.where(c_slots >= 0, own[: num_tokens * 5].view(-1, 5), -1)
    got = sparse_mqa_ref(
        q.to(device), w_pages, w_slots, c_pages, c_slots, sink.to(device), SCALE, window, comp
    ).cpu()
    kv_lists = []
    for t in range(num_tokens):
        ws, cs = w_slots[t][w_slots[t] >= 0], c_slots[t][c_slots[t] >= 0]
        keys = torch.cat((read_entries(w_pages, ws, window), read_entries(c_pages, cs, comp))).cpu()
        kv_lists.append(list(keys))
    assert_close("reference", got, _direct(q, kv_lists, sink), 1e-5, 1e-5)
    assert (got[0] == 0).all()


SHAPES = {  # tokens, heads, window list width, compressed list width
    "decode": (5, 4, 128, 24),
    "prefill_per_token_lists": (9, 20, 17, 7),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("comp_kind", ["c4", "c128", None])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_reference(dtype, comp_kind, shape, device):
    num_tokens, num_heads, width, comp_width = SHAPES[shape]
    window, w_pages, w_num = _pool("window", dtype, 2, device)
    w_slots = _slot_lists(num_tokens, width, w_num, device)
    comp = c_pages = c_slots = None
    if comp_kind:
        comp, c_pages, c_num = _pool(comp_kind, dtype, 3 if comp_kind == "c4" else 20, device)
        c_slots = _slot_lists(num_tokens, comp_width, c_num, device)
    q = torch.randn(num_tokens, num_heads, 512, device=device)
    sink = torch.randn(num_heads, device=device)
    got = sparse_mqa(q, w_pages, w_slots, c_pages, c_slots, sink, SCALE, window, comp)
    ref = sparse_mqa_ref(q, w_pages, w_slots, c_pages, c_slots, sink, SCALE, window, comp)
    tol = 1e-5 if dtype == "fp32" else 2e-2  # bf16 tensor-core operands on GPUs (q, probabilities)
    assert_close(f"{dtype}/{comp_kind}/{shape}", got, ref, tol, tol)
    assert (got[0] == 0).all()  # no keys: o = 0


@pytest.mark.parametrize("fn", [sparse_mqa, sparse_mqa_ref])
def test_bf16_queries_and_empty_batches(fn, device):
    window, w_pages, w_num = _pool("window", "fp8", 1, device)
    w_slots = _slot_lists(3, 16, w_num, device)
    q, sink = torch.randn(3, 2, 512, device=device), torch.zeros(2, device=device)
    out_bf16 = fn(q.to(torch.bfloat16), w_pages, w_slots, None, None, sink, SCALE, window)
    out = fn(q.to(torch.bfloat16).float(), w_pages, w_slots, None, None, sink, SCALE, window)
    assert out_bf16.dtype == torch.float32 and torch.equal(out_bf16, out)
    empty = fn(q[:0], w_pages, w_slots[:0], None, None, sink, SCALE, window)
    assert empty.shape == (0, 2, 512)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
def test_key_splits_combine_to_the_reference(num_splits, device):
    # flash decoding: each split attends to a range of the token's keys and a second pass merges
    # the partials; 7 splits of 25 keys leave some splits with no keys at all
    window, w_pages, w_num = _pool("window", "fp8", 1, device)
    comp, c_pages, c_num = _pool("c4", "fp8", 2, device)
    w_slots, c_slots = _slot_lists(4, 17, w_num, device), _slot_lists(4, 8, c_num, device)
    w_slots[2, :] = -1  # token 2 sees only compressed keys
    q, sink = torch.randn(4, 6, 512, device=device), torch.randn(6, device=device)
    got = sparse_mqa_split(
        q, w_pages, w_slots, c_pages, c_slots, sink, SCALE, window, comp, num_splits
    )
    ref = sparse_mqa_ref(q, w_pages, w_slots, c_pages, c_slots, sink, SCALE, window, comp)
    tol = 1e-5 if device.type == "cpu" else 2e-2  # GPUs: bf16 tensor-core operands
    assert_close(f"{num_splits} splits", got, ref, tol, tol)
    assert (got[0] == 0).all()


def test_split_count_fills_the_gpu_without_tiny_splits():
    cpu = torch.device("cpu")  # the interpreter pretends to have 132 multiprocessors
    assert num_splits_for(64, 1, 640, cpu) == 2  # decode: 64 tokens x 2 splits ~ 132 SMs
    assert num_splits_for(64, 1, 250, cpu) == 1  # over a quarter full: splits of >= 128 keys
    assert num_splits_for(4, 1, 640, cpu) == 8  # a few tokens: up to MAX_SPLITS
    assert num_splits_for(16, 1, 145, cpu) == 4  # under a quarter full: splits of >= 32 keys
    assert num_splits_for(4096, 1, 640, cpu) == 1  # prefill fills the GPU by itself
    assert num_splits_for(1, 1, 100, cpu) == 3
    assert num_splits_for(1, 1, 31, cpu) == 1
    assert num_splits_for(1, 1, 8320, cpu) == 32  # 1M context's C128 layer: splits of <= 256 keys
    assert num_splits_for(8, 1, 8320, cpu) == 16  # ... as many as the SMs take
