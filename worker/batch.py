"""Batch tensors of one step, built once from the worker's request tables and shared by layers.

Per token t (tokens of a request are contiguous, positions consecutive):
    positions [T], seq_start [T] (first position of t's request in this batch), state_slots [T],
    req_rows [T] (row of t's request in page_table), window_store [T] (t's own window slot),
    window_slots [T, 128] (slots of positions p-127..p; -1 below 0), c4_out / c128_out [T]
    (compressed slot written when t completes a block, else -1), c4_bound [T] = (p+1)//4,
    c128_slots [T, K] (every visible C128 entry, -1 padded).
Per request row r: page_table [R, P] full page ids (-1 padded) and sample_idx (its last token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv4ray.engine.plan import StepPlan

PAGE, WINDOW = 256, 128


@dataclass
class ReqTable:
    """What a stage knows of one request: its ids in every index space."""

    state_slot: int
    page_ids: list[int]
    window_page_ids: list[int]


@dataclass
class BatchMeta:
    token_ids: torch.Tensor
    positions: torch.Tensor
    seq_start: torch.Tensor
    state_slots: torch.Tensor
    req_rows: torch.Tensor
    page_table: torch.Tensor
    window_store: torch.Tensor
    window_slots: torch.Tensor
    c4_out: torch.Tensor
    c128_out: torch.Tensor
    c4_bound: torch.Tensor
    c128_slots: torch.Tensor
    sample_idx: torch.Tensor  # [R_sample] token index of each sampling request's last token
    sample_req_ids: list[str]
    rope_cache: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def c4_slots(self, topk_positions: torch.Tensor) -> torch.Tensor:
        """Logical C4 positions [T, k] (-1 = none) -> physical C4 slots [T, k]."""
        return _entry_slots(self.page_table, self.req_rows, topk_positions, PAGE // 4)


def build_batch(plan: StepPlan, tables: dict[str, ReqTable], device) -> BatchMeta:
    positions, seq_start, slots, rows = [], [], [], []
    for row, entry in enumerate(plan.batch):
        rng = range(entry.start_pos, entry.start_pos + entry.num_tokens)
        positions.extend(rng)
        seq_start.extend([entry.start_pos] * entry.num_tokens)
        slots.extend([tables[entry.req_id].state_slot] * entry.num_tokens)
        rows.extend([row] * entry.num_tokens)

    def long(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    pos, req_rows = long(positions), long(rows)
    reqs = [tables[e.req_id] for e in plan.batch]
    page_table = _pad([r.page_ids for r in reqs], device)
    window_table = _pad([r.window_page_ids for r in reqs], device)
    window_slots = _window_slots(window_table, req_rows, pos)
    ends = torch.cumsum(long([e.num_tokens for e in plan.batch]), 0) - 1
    sampling = [i for i, e in enumerate(plan.batch) if e.sample]
    return BatchMeta(
        token_ids=long(plan.token_ids),
        positions=pos,
        seq_start=long(seq_start),
        state_slots=long(slots),
        req_rows=req_rows,
        page_table=page_table,
        window_store=window_slots[:, -1].contiguous(),
        window_slots=window_slots,
        c4_out=_out_loc(page_table, req_rows, pos, 4),
        c128_out=_out_loc(page_table, req_rows, pos, 128),
        c4_bound=(pos + 1) // 4,
        c128_slots=_c128_slots(page_table, req_rows, pos),
        sample_idx=ends[long(sampling)] if sampling else long([]),
        sample_req_ids=[plan.batch[i].req_id for i in sampling],
    )


def _pad(lists: list[list[int]], device) -> torch.Tensor:
    width = max((len(x) for x in lists), default=0)
    out = torch.full((len(lists), max(width, 1)), -1, dtype=torch.long)
    for i, ids in enumerate(lists):
        out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out.to(device)


def _window_slots(window_table: torch.Tensor, req_rows: torch.Tensor, pos: torch.Tensor):
    """[T, 128] window slots of positions p-127..p; a missing resident page is a bookkeeping bug."""
    q = pos[:, None] + torch.arange(-WINDOW + 1, 1, device=pos.device)[None, :]
    idx = (q.clamp(min=0) // WINDOW).clamp(max=window_table.shape[1] - 1)
    page = window_table[req_rows[:, None], idx]
    if bool(((q >= 0) & (page < 0)).any()):
        raise RuntimeError("a window page of the last 128 positions is not resident")
    return torch.where(q >= 0, page * WINDOW + q % WINDOW, torch.full_like(q, -1))


def _entry_slots(page_table, req_rows, entries, per_page: int) -> torch.Tensor:
    """Entry indices [T, k] of each token's request (-1 = none) -> physical slots [T, k]."""
    safe = entries.clamp(min=0)
    page = page_table[req_rows[:, None], (safe // per_page).clamp(max=page_table.shape[1] - 1)]
    return torch.where(
        entries >= 0, page * per_page + safe % per_page, torch.full_like(entries, -1)
    )


def _out_loc(page_table, req_rows, pos, ratio: int) -> torch.Tensor:
    """Slot of the entry a block-completing token writes (full_loc // ratio), else -1."""
    done = (pos + 1) % ratio == 0
    slot = _entry_slots(page_table, req_rows, (pos // ratio)[:, None], PAGE // ratio)[:, 0]
    return torch.where(done, slot, torch.full_like(pos, -1))


def _c128_slots(page_table, req_rows, pos) -> torch.Tensor:
    visible = (pos + 1) // 128
    width = int(visible.max()) if visible.numel() else 0
    entries = torch.arange(max(width, 1), device=pos.device)[None, :].expand(pos.shape[0], -1)
    entries = torch.where(entries < visible[:, None], entries, torch.full_like(entries, -1))
    return _entry_slots(page_table, req_rows, entries, PAGE // 128)
