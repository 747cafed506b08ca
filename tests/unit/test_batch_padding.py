"""A batch padded to a CUDA graph's fixed shapes: real rows unchanged, pad rows inert."""

import random

import numpy as np
import pytest
import torch

from dsv4ray.engine.plan import BatchEntry, StepPlan
from dsv4ray.worker.batch import (
    Padding,
    _c128_slots_t,
    _window_slots_t,
    host_arrays,
    slotted_rows,
)  # fmt: skip
from dsv4ray.worker.graphs.cuda_graphs import context_buckets
from dsv4ray.worker.req_table import ReqTable

PER_TOKEN = ("token_ids", "positions", "seq_start", "state_slots", "req_rows", "window_store",
             "c4_out", "c128_out", "c4_bound")  # fmt: skip


def _decode_plan(rng: random.Random, num: int):
    tables, entries = {}, []
    for r in range(num):
        pos = rng.randint(0, 3000)
        pages = list(range(100 * r, 100 * r + pos // 256 + 1))
        windows = [-1] * (pos // 128 + 1)
        for i in range(max(0, (pos - 127) // 128), len(windows)):
            windows[i] = 1000 + 40 * r + i
        tables[f"r{r}"] = ReqTable(r, pages, windows)
        entries.append(BatchEntry(f"r{r}", pos, 1, True))
    return StepPlan(step_id=0, batch=entries, token_ids=[7] * num), tables


@pytest.mark.parametrize("num", [1, 3, 8])
def test_padded_rows_match_unpadded_and_pad_rows_touch_nothing(num):
    plan, tables = _decode_plan(random.Random(num), num)
    plain, plain_sample = host_arrays(plan, tables)
    padding = Padding(num_tokens=8, page_cols=16, c128_cols=32, scratch_slot=99)
    padded, sample = host_arrays(plan, tables, padding)
    for arrays in (plain, padded):  # the slot lists the device derives from the tables
        t = [torch.from_numpy(arrays[n]) for n in ("page_table", "window_table", "req_rows")]
        pos = torch.from_numpy(arrays["positions"])
        arrays["window_slots"] = _window_slots_t(t[1], t[2], pos).numpy()
        arrays["c128_slots"] = _c128_slots_t(t[0], t[2], pos, arrays["c128_cols"]).numpy()
    assert np.array_equal(sample, plain_sample)
    for name in PER_TOKEN:
        assert np.array_equal(padded[name][:num], plain[name]), name
    for name, cols in (("page_table", plain["page_table"].shape[1]), ("c128_slots", None)):
        cols = cols or plain[name].shape[1]
        assert np.array_equal(padded[name][:num, :cols], plain[name]), name
        assert (padded[name][:num, cols:] == -1).all(), name
    assert np.array_equal(padded["window_slots"][:num], plain["window_slots"])
    pad = slice(num, 8)
    for name in ("window_store", "c4_out", "c128_out", "window_slots", "c128_slots", "page_table"):
        assert (padded[name][pad] == -1).all(), name  # no read, no write into a real page
    assert (padded["c4_bound"][pad] == 0).all()
    assert (padded["state_slots"][pad] == 99).all()
    assert np.array_equal(padded["req_rows"][pad], np.arange(num, 8))


def test_batch_too_large_for_padding_is_named():
    plan, tables = _decode_plan(random.Random(0), 3)
    with pytest.raises(ValueError, match="3 tokens do not fit a padded batch of 2"):
        host_arrays(plan, tables, Padding(2, 16, 32, 9))
    with pytest.raises(ValueError, match="pages do not fit a padded page table of 1 columns"):
        host_arrays(plan, tables, Padding(4, 1, 32, 9))


def test_slotted_rows_hold_each_request_at_its_block_and_pads_touch_nothing():
    # 3 requests of 3, 1 and 4 tokens in a bucket of 4 requests x 4 rows
    plan, tables = _decode_plan(random.Random(5), 3)
    for entry, n in zip(plan.batch, (3, 1, 4)):
        entry.num_tokens = n
    plan.token_ids = list(range(8))
    plain, plain_sample = host_arrays(plan, tables)
    padding = Padding(16, 16, 32, scratch_slot=99, tokens_per_entry=4)
    slotted, sample = host_arrays(plan, tables, padding)
    rows = slotted_rows([3, 1, 4], 4)
    assert rows.tolist() == [0, 1, 2, 4, 8, 9, 10, 11]
    assert sample.tolist() == rows[plain_sample].tolist() == [2, 4, 11]
    for name in PER_TOKEN:
        assert np.array_equal(slotted[name][rows], plain[name]), name
    pad = np.setdiff1d(np.arange(16), rows)
    for name in ("window_store", "c4_out", "c128_out"):
        assert (slotted[name][pad] == -1).all(), name  # no write into a real page
    assert (slotted["c4_bound"][pad] == 0).all() and (slotted["state_slots"][pad] == 99).all()
    # pad rows read the table rows past the requests': all -1, so no window or C128 key
    assert (slotted["req_rows"][pad] == 15).all()
    assert (slotted["page_table"][3:] == -1).all() and (slotted["window_table"][3:] == -1).all()
    t = [torch.from_numpy(slotted[n]) for n in ("page_table", "window_table", "req_rows")]
    pos = torch.from_numpy(slotted["positions"])
    assert (_window_slots_t(t[1], t[2], pos)[pad] == -1).all()
    assert (_c128_slots_t(t[0], t[2], pos, 32)[pad] == -1).all()


def test_a_request_longer_than_its_slot_block_is_named():
    plan, tables = _decode_plan(random.Random(1), 2)
    plan.batch[1].num_tokens, plan.token_ids = 5, [7] * 6
    with pytest.raises(ValueError, match="a request of 5 tokens does not fit 4 rows"):
        host_arrays(plan, tables, Padding(8, 16, 32, 9, tokens_per_entry=4))


@pytest.mark.parametrize("max_len", [1, 4096, 5000, 65536, 70000, 131072, 1_000_000, 1 << 20])
def test_every_context_up_to_max_len_replays_a_graph_bucket(max_len):
    buckets = context_buckets(max_len)
    assert list(buckets) == sorted(set(buckets))
    assert buckets[-1] >= max_len and buckets[-1] % 256 == 0 and buckets[-1] - max_len < 256
    # past 64k each bucket at most doubles: a step pads at most half of what it reads
    for lo, hi in zip(buckets, buckets[1:]):
        assert hi <= (4 if lo < 65536 else 2) * lo
    if max_len == 1 << 20:  # V4's window: 4k, 16k, 64k, then every power of two
        assert buckets == (4096, 16384, 65536, 131072, 262144, 524288, 1048576)
