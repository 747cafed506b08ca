"""MethodTimeline: when an actor's graph methods were entered and left, while recording.

Times are time.monotonic (one clock for every process of a machine), so a driver can line up
the records of every actor of a pipeline (bench/pipeline.py --timeline). The clock is read only
while recording.
"""

from __future__ import annotations

import time

MAX_RECORDS = 100_000


class MethodTimeline:
    def __init__(self) -> None:
        self.records: list | None = None  # (method, step id, entered, left) while recording

    def swap(self, record: bool) -> list:
        """Starts (record) or stops recording; returns what was recorded since the last call."""
        records, self.records = self.records or [], ([] if record else None)
        return records

    def enter(self) -> float:
        return time.monotonic() if self.records is not None else 0.0

    def left(self, method: str, step_id: int, entered: float) -> None:
        if self.records is not None and len(self.records) < MAX_RECORDS:
            self.records.append((method, step_id, entered, time.monotonic()))
