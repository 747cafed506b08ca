"""A stage's request table applies the plan's diffs as list bookkeeping would."""

import random

import numpy as np

from dsv4ray.engine.plan import RequestDiff
from dsv4ray.worker.batch import id_table
from dsv4ray.worker.req_table import IdRow, ReqTable


def _apply_to_lists(pages: list, windows: list, diff: RequestDiff) -> None:
    """The diff applied to plain lists: the oracle."""
    if diff.num_pages >= 0:
        del pages[diff.num_pages :]
    pages.extend(diff.new_page_ids)
    for idx, page in diff.new_window_pages:
        windows.extend([-1] * (idx + 1 - len(windows)))
        windows[idx] = page
    for idx in diff.freed_window_idxs:
        windows[idx] = -1


def _random_diff(rng: random.Random, pages: list, windows: list) -> RequestDiff:
    cut = rng.randrange(len(pages) + 1) if pages and rng.random() < 0.2 else -1
    new = [rng.randrange(10_000) for _ in range(rng.choice([0, 0, 1, 3, 40]))]
    top = len(windows) + rng.choice([0, 0, 2])  # a window index past the end grows the row
    new_windows = [(top + i, rng.randrange(10_000)) for i in range(rng.choice([0, 1, 2, 70]))]
    resident = [i for i, p in enumerate(windows) if p >= 0]
    freed = rng.sample(resident, min(len(resident), rng.choice([0, 1, 2])))
    return RequestDiff("r", new, new_windows, freed, num_pages=cut)


def test_diffs_keep_the_table_equal_to_list_bookkeeping():
    rng = random.Random(0)
    for trial in range(20):
        pages = [rng.randrange(10_000) for _ in range(rng.randrange(5))]
        windows = [rng.randrange(10_000) for _ in range(rng.randrange(3))]
        table = ReqTable(trial, pages, windows)
        for _ in range(60):  # rows grow past several reallocations
            diff = _random_diff(rng, pages, windows)
            _apply_to_lists(pages, windows, diff)
            table.apply(diff)
            assert table.page_ids.tolist() == pages
            assert table.window_page_ids.tolist() == windows
            resident = tuple((i, p) for i, p in enumerate(windows) if p >= 0)
            assert table.resident_windows() == resident
        rows = id_table([table.page_ids, IdRow([7])], None)
        assert rows[0, : len(pages)].tolist() == pages and (rows[0, len(pages) :] == -1).all()
        assert rows[1].tolist() == [7] + [-1] * (rows.shape[1] - 1)
        wide = id_table([table.window_page_ids], len(windows) + 40)  # past the row's buffer
        assert wide[0].tolist() == windows + [-1] * 40


def test_a_row_cut_back_and_grown_again_holds_no_stale_ids():
    row = IdRow(range(100))
    row.truncate(3)
    row.set(6, 42)  # positions 3..5 held ids before the cut; now they hold no page
    assert row.tolist() == [0, 1, 2, -1, -1, -1, 42]
    row.extend(np.arange(5))
    assert len(row) == 12 and row[7:].tolist() == [0, 1, 2, 3, 4]
