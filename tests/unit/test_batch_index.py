"""Batch index math against a per-token oracle written from the page formats' definitions.

A full page holds 256 positions: 64 C4 entries (entry e of a request lives in its page
e // 64 at row e % 64) and 2 C128 entries; a window page holds 128 positions. Page ids are
shuffled so a slot computed from the wrong request, page or space cannot match by accident.
"""

import random

import numpy as np
import pytest
import torch

from dsv4ray.engine.plan import BatchEntry, StepPlan
from dsv4ray.worker.batch import (
    _c128_slots_t,
    _entry_slots_t,
    _window_slots_t,
    host_arrays,
)
from dsv4ray.worker.req_table import ReqTable

PAGE, WINDOW = 256, 128


def _random_step(rng: random.Random):
    """3-6 requests, each a prefill chunk or a decode token, at positions across page edges."""
    ids = rng.sample(range(10_000), 2_000)
    tables, entries, tokens = {}, [], []
    for r in range(rng.randint(3, 6)):
        start = rng.choice([0, 1, 127, 128, 255, 256, 511, rng.randint(0, 3000)])
        n = 1 if rng.random() < 0.5 else rng.randint(1, 300)
        end = start + n  # positions start..end-1 run in this step
        pages = [ids.pop() for _ in range((end - 1) // PAGE + 1)]
        windows = [-1] * ((end - 1) // WINDOW + 1)
        for w in range(max(0, (start - WINDOW + 1) // WINDOW), len(windows)):
            windows[w] = ids.pop()
        tables[f"r{r}"] = ReqTable(ids.pop(), pages, windows)
        entries.append(BatchEntry(f"r{r}", start, n, rng.random() < 0.7))
        tokens += [rng.randint(2, 500) for _ in range(n)]
    return StepPlan(step_id=1, batch=entries, token_ids=tokens), tables


def _full_slot(table: ReqTable, entry: int, per_page: int) -> int:
    return table.page_ids[entry // per_page] * per_page + entry % per_page


def _window_slot(table: ReqTable, q: int) -> int:
    return -1 if q < 0 else table.window_page_ids[q // WINDOW] * WINDOW + q % WINDOW


def _oracle(plan: StepPlan, tables: dict) -> dict:
    rows = {k: [] for k in ("positions", "seq_start", "state_slots", "req_rows", "window_store",
                            "c4_out", "c128_out", "c4_bound", "window_slots", "c128")}  # fmt: skip
    for r, e in enumerate(plan.batch):
        t = tables[e.req_id]
        for p in range(e.start_pos, e.start_pos + e.num_tokens):
            rows["positions"].append(p)
            rows["seq_start"].append(e.start_pos)
            rows["state_slots"].append(t.state_slot)
            rows["req_rows"].append(r)
            rows["window_store"].append(_window_slot(t, p))
            rows["window_slots"].append([_window_slot(t, q) for q in range(p - WINDOW + 1, p + 1)])
            rows["c4_out"].append(_full_slot(t, p // 4, 64) if (p + 1) % 4 == 0 else -1)
            rows["c128_out"].append(_full_slot(t, p // 128, 2) if (p + 1) % 128 == 0 else -1)
            rows["c4_bound"].append((p + 1) // 4)
            rows["c128"].append([_full_slot(t, i, 2) for i in range((p + 1) // 128)])
    return rows


def derive(arrays) -> None:
    """Adds the slot lists the device derives from the step's tables."""
    t = {n: torch.from_numpy(arrays[n]) for n in ("window_table", "page_table", "req_rows",
                                                   "positions")}  # fmt: skip
    arrays["window_slots"] = _window_slots_t(t["window_table"], t["req_rows"], t["positions"])
    arrays["c128_slots"] = _c128_slots_t(
        t["page_table"], t["req_rows"], t["positions"], arrays["c128_cols"]
    )


@pytest.mark.parametrize("seed", range(12))
def test_every_index_equals_the_per_token_oracle(seed):
    plan, tables = _random_step(random.Random(seed))
    got, sample_idx = host_arrays(plan, tables)
    derive(got)
    want = _oracle(plan, tables)
    assert got["token_ids"].tolist() == plan.token_ids
    for name in ("positions", "seq_start", "state_slots", "req_rows", "window_store", "c4_out",
                 "c128_out", "c4_bound", "window_slots"):  # fmt: skip
        assert got[name].tolist() == want[name], name
    for t, visible in enumerate(want["c128"]):  # every visible C128 entry, then -1 padding
        row = got["c128_slots"][t].tolist()
        assert row[: len(visible)] == visible and set(row[len(visible) :]) <= {-1}
    for r, e in enumerate(plan.batch):
        assert got["page_table"][r, : len(tables[e.req_id].page_ids)].tolist() == (
            tables[e.req_id].page_ids.tolist()
        )
    ends = np.cumsum([e.num_tokens for e in plan.batch]) - 1
    assert sample_idx.tolist() == [int(ends[i]) for i, e in enumerate(plan.batch) if e.sample]


@pytest.mark.parametrize("seed", range(4))
def test_top_k_positions_map_to_their_requests_c4_slots(seed):
    rng = random.Random(100 + seed)
    plan, tables = _random_step(rng)
    got, _ = host_arrays(plan, tables)
    bound = got["c4_bound"]
    topk = np.array([[rng.randrange(b) if b and rng.random() < 0.8 else -1 for _ in range(8)]
                     for b in bound])  # fmt: skip
    slots = _entry_slots_t(torch.from_numpy(got["page_table"]), torch.from_numpy(got["req_rows"]),
                           torch.from_numpy(topk), PAGE // 4).tolist()  # fmt: skip
    for t, r in enumerate(got["req_rows"]):
        table = tables[plan.batch[r].req_id]
        assert slots[t] == [_full_slot(table, e, 64) if e >= 0 else -1 for e in topk[t]]


@pytest.mark.parametrize("which", ["first", "middle", "last", "never set"])
def test_a_missing_window_page_is_a_bookkeeping_error_naming_its_request(which):
    """Any window page an entry reads (positions p-127..p of each of its tokens), also one in
    the middle of a long chunk, or one past the request's row, is an error naming it."""
    rng = random.Random(7)
    for _ in range(20):
        plan, tables = _random_step(rng)
        for e in plan.batch:
            first = max(0, e.start_pos - WINDOW + 1) // WINDOW
            last = (e.start_pos + e.num_tokens - 1) // WINDOW
            if which == "middle" and last - first < 2:
                continue
            idx = {"first": first, "middle": first + 1, "last": last}.get(which)
            row = tables[e.req_id].window_page_ids
            if idx is None:
                row.truncate(last)
            else:
                row.set(idx, -1)
            with pytest.raises(RuntimeError, match=f"{e.req_id}: a window page of its last 128"):
                host_arrays(plan, tables)
            return
    pytest.fail(f"no step had an entry to take a {which} window page from")
