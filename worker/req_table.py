"""What a stage knows of one request: its compressor state slot, page ids and window page ids.

Ids live in growable numpy rows, so a step's page table is filled with one copy per request:
a 1M-token context holds 4,096 page ids and 8,192 window indexes, which as Python lists cost
milliseconds a step to convert. A row only grows at its end (amortised doubling), is cut back on
a rollback, and has single entries set; -1 means no page.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from dsv4ray.engine.plan import RequestDiff

MIN_CAPACITY = 16


class IdRow:
    """A growable int64 id row; `view()` is the live ids (no copy), `tolist()` plain ints.
    Invariant: the buffer holds -1 past the ids."""

    def __init__(self, ids: Iterable[int] = ()):
        ids = np.fromiter(ids, dtype=np.int64)
        self._buf = np.full(max(MIN_CAPACITY, 2 * len(ids)), -1, dtype=np.int64)
        self._buf[: len(ids)] = ids
        self._len = len(ids)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, idx):
        return self.view()[idx]

    def __repr__(self) -> str:
        return f"IdRow({self.tolist()})"

    def view(self) -> np.ndarray:
        return self._buf[: self._len]

    def tolist(self) -> list[int]:
        return self.view().tolist()

    def padded(self, width: int) -> np.ndarray:
        """The ids, then -1 up to width (>= len): a view of the row's buffer, which holds -1
        past the ids; valid until the row changes."""
        if width > len(self._buf):
            self._reserve(width)
        return self._buf[:width]

    def truncate(self, n: int) -> None:
        """Keeps the first n ids."""
        if n < self._len:
            self._buf[n : self._len] = -1
            self._len = max(n, 0)

    def extend(self, ids) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        end = self._len + len(ids)
        self._reserve(end)
        self._buf[self._len : end] = ids
        self._len = end

    def set(self, idx: int, value: int) -> None:
        """Sets id idx, growing the row with -1 up to it."""
        if idx >= self._len:
            self._reserve(idx + 1)
            self._len = idx + 1
        self._buf[idx] = value

    def _reserve(self, n: int) -> None:
        if n > len(self._buf):
            grown = np.full(max(n, 2 * len(self._buf)), -1, dtype=np.int64)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown


class ReqTable:
    """A request's ids in every index space of a stage."""

    def __init__(self, state_slot: int, page_ids: Iterable[int], window_page_ids: Iterable[int]):
        self.state_slot = state_slot
        self.page_ids = IdRow(page_ids)
        self.window_page_ids = IdRow(window_page_ids)

    def apply(self, diff: RequestDiff) -> None:
        """The plan's changes of this request: a rollback's cut first, then new pages, new window
        pages and window pages no longer resident."""
        if diff.num_pages >= 0:
            self.page_ids.truncate(diff.num_pages)
        self.page_ids.extend(diff.new_page_ids)
        for idx, page in diff.new_window_pages:
            self.window_page_ids.set(idx, page)
        for idx in diff.freed_window_idxs:
            self.window_page_ids.set(idx, -1)

    def resident_windows(self) -> tuple[tuple[int, int], ...]:
        """(window idx, page id) of every resident window page."""
        ids = self.window_page_ids.view()
        return tuple((int(i), int(ids[i])) for i in np.flatnonzero(ids >= 0))
