"""Batch tensors of one step, built once on the host from the worker's request tables.

Per token t (tokens of a request are contiguous, positions consecutive):
    positions [T], seq_start [T] (first position of t's request in this batch), state_slots [T],
    req_rows [T] (row of t's request in page_table), window_store [T] (t's own window slot),
    c4_out / c128_out [T] (compressed slot written when t completes a block, else -1),
    c4_bound [T] = (p+1)//4.
Per request row r: page_table [R, P] full page ids and window_table [R, W] window page ids
(-1 padded or not resident), and sample_idx (its last token).
Derived on the device (`derive`), as a prefill chunk's would be most of the upload:
    window_slots [T, 128] (slots of positions p-127..p; -1 below 0) from window_table;
    c128_slots [T, K] (every visible C128 entry, -1 padded; K = c128_cols) from page_table.

Every index is computed in numpy and the whole set travels to the device as one int64 buffer
(pinned and non-blocking on CUDA), so building a batch never waits for the device. A `Padding`
fixes T, P and K (CUDA graphs replay over fixed shapes): padded tokens read nothing (-1 slots,
bound 0) and write only into the scratch state slot. Tokens are packed (pad tokens after the
last request's), or slotted: request i owns rows i*n .. i*n + n - 1 whatever its token count, so
a step of up to n tokens per request (a verification step, a draft pass) keeps fixed shapes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dsv4ray.engine.plan import StepPlan
from dsv4ray.worker.req_table import IdRow, ReqTable
from dsv4ray.worker.rope_tables import RopeTables

PAGE, WINDOW = 256, 128
TABLE_FIELDS = ("page_table", "window_table", "window_slots", "c128_slots")  # 2-d, either window
INT_FIELDS = (
    "token_ids", "positions", "seq_start", "state_slots", "req_rows", "window_store", "c4_out",
    "c128_out", "c4_bound",
)  # fmt: skip


@dataclass(frozen=True)
class Padding:
    """Fixed shapes of a captured step: tokens (= rows), page-table columns, C128 columns; pad
    tokens use `scratch_slot` as their compressor state slot. tokens_per_entry n > 0: slotted
    rows (request i's tokens from row i * n, pad rows after them); 0: packed."""

    num_tokens: int
    page_cols: int
    c128_cols: int
    scratch_slot: int
    tokens_per_entry: int = 0

    @property
    def window_cols(self) -> int:
        return self.page_cols * (PAGE // WINDOW)


@dataclass
class BatchMeta:
    token_ids: torch.Tensor
    positions: torch.Tensor
    seq_start: torch.Tensor
    state_slots: torch.Tensor
    req_rows: torch.Tensor
    page_table: torch.Tensor
    window_store: torch.Tensor
    c4_out: torch.Tensor
    c128_out: torch.Tensor
    c4_bound: torch.Tensor
    sample_idx: torch.Tensor  # [R_sample] token index of each sampling request's last token
    sample_req_ids: list[str]
    ropes: RopeTables
    rope_len: int  # rope tables cover positions [0, rope_len)
    static: bool = False  # shapes fixed for a CUDA graph: only sync-free paths may run
    hisparse_step: Any = None  # worker/host/hisparse_io.ScratchStep of a HiSparse prefill step
    window_table: torch.Tensor | None = None  # [R, W]
    c128_cols: int = 1
    window_slots: torch.Tensor | None = None  # [T, 128]; None until `derive`
    c128_slots: torch.Tensor | None = None  # [T, c128_cols]; None until `derive`

    def derive(self) -> BatchMeta:
        """This meta with window_slots and c128_slots derived on its device (a new object:
        inside a captured forward the derivation is part of the graph)."""
        if self.window_slots is not None and self.c128_slots is not None:
            return self
        window = _window_slots_t(self.window_table, self.req_rows, self.positions)
        c128 = _c128_slots_t(self.page_table, self.req_rows, self.positions, self.c128_cols)
        return dataclasses.replace(self, window_slots=window, c128_slots=c128)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def c4_slots(self, topk_positions: torch.Tensor) -> torch.Tensor:
        """Logical C4 positions [T, k] (-1 = none) -> physical C4 slots [T, k]."""
        return _entry_slots_t(self.page_table, self.req_rows, topk_positions, PAGE // 4)


def build_batch(
    plan: StepPlan, tables: dict[str, ReqTable], device, ropes: RopeTables, stage=None
) -> BatchMeta:
    """The step's index tensors on `device` (`stage`: a reusable HostStage for the upload)."""
    arrays, sample_idx = host_arrays(plan, tables)
    flat, layout = pack(arrays, sample_idx)
    dev = (stage or HostStage()).upload(flat, device)
    max_pos = int(arrays["positions"].max()) + 1 if len(arrays["positions"]) else 1
    rope_len = ropes.ensure(max_pos)
    return meta_from(dev, layout, plan, ropes, rope_len, c128_cols=arrays["c128_cols"]).derive()


def host_arrays(plan: StepPlan, tables: dict[str, ReqTable], padding: Padding | None = None):
    """numpy int64 arrays of every BatchMeta index field, and the sample indices."""
    entries = plan.batch
    counts = np.array([e.num_tokens for e in entries], dtype=np.int64)
    starts = np.array([e.start_pos for e in entries], dtype=np.int64)
    rows = np.repeat(np.arange(len(entries), dtype=np.int64), counts)
    firsts = np.repeat(np.cumsum(counts) - counts, counts)  # token index of each request's first
    pos = starts[rows] + np.arange(int(counts.sum()), dtype=np.int64) - firsts
    reqs = [tables[e.req_id] for e in entries]
    page_table = id_table([r.page_ids for r in reqs], padding.page_cols if padding else None)
    window_table = id_table([r.window_page_ids for r in reqs],
                            padding.window_cols if padding else None)  # fmt: skip
    _check_windows(entries, window_table, starts, counts)
    visible = (pos + 1) // 128
    c128_cols = padding.c128_cols if padding else max(int(visible.max(initial=0)), 1)
    if int(visible.max(initial=0)) > c128_cols:
        raise ValueError(f"{int(visible.max())} C128 entries do not fit {c128_cols} columns")
    out = {
        "token_ids": np.asarray(plan.token_ids, dtype=np.int64),
        "positions": pos,
        "seq_start": starts[rows],
        "state_slots": np.array([r.state_slot for r in reqs], dtype=np.int64)[rows],
        "req_rows": rows,
        "window_store": window_table[rows, pos // WINDOW] * WINDOW + pos % WINDOW,
        "c4_out": _out_loc(page_table, rows, pos, 4),
        "c128_out": _out_loc(page_table, rows, pos, 128),
        "c4_bound": (pos + 1) // 4,
        "page_table": page_table,
        "window_table": window_table,
        "c128_cols": c128_cols,  # an int: the width of the derived c128_slots
    }
    sample_idx = np.cumsum(counts)[[i for i, e in enumerate(entries) if e.sample]] - 1
    if padding is not None and padding.tokens_per_entry:
        rows = slotted_rows(counts, padding.tokens_per_entry)
        return _slot_tokens(out, rows, padding), rows[sample_idx]
    if padding is not None:
        out = _pad_tokens(out, padding)
    return out, sample_idx.astype(np.int64)


def slotted_rows(counts, n: int) -> np.ndarray:
    """Row of each packed token when request i's tokens start at row i * n (counts[i] <= n)."""
    counts = np.asarray(counts, dtype=np.int64)
    if len(counts) and int(counts.max()) > n:
        raise ValueError(f"a request of {int(counts.max())} tokens does not fit {n} rows")
    firsts = np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(np.arange(len(counts), dtype=np.int64) * n, counts) + (
        np.arange(int(counts.sum()), dtype=np.int64) - firsts
    )


_PAD_FILL = {"positions": 0, "seq_start": 0, "token_ids": 0, "c4_bound": 0}  # others: -1


def _slot_tokens(arrays: dict, rows: np.ndarray, padding: Padding) -> dict:
    """Packed per-token fields scattered to their slotted rows; every other row is a pad token
    whose request row is the last one (request rows past the step's requests are all -1)."""
    total, num_reqs = padding.num_tokens, len(arrays["page_table"])
    has_pads = len(rows) < total
    if num_reqs * padding.tokens_per_entry > total or (has_pads and num_reqs >= total):
        raise ValueError(f"{num_reqs} requests do not fit a slotted batch of "
                         f"{total // padding.tokens_per_entry}")  # fmt: skip
    out = {}
    for name, a in arrays.items():
        if name in ("page_table", "window_table"):
            pad = np.full((total - a.shape[0], a.shape[1]), -1, dtype=np.int64)
            out[name] = np.concatenate([a, pad])
        elif isinstance(a, np.ndarray):
            fill = {"state_slots": padding.scratch_slot, "req_rows": total - 1}.get(name)
            full = np.full(total, _PAD_FILL.get(name, -1) if fill is None else fill, np.int64)
            full[rows] = a
            out[name] = full
        else:
            out[name] = a
    return out


def _pad_tokens(arrays: dict, padding: Padding) -> dict:
    """Rows num_tokens.. of every array: pad tokens that read nothing and write only scratch."""
    n, total = len(arrays["positions"]), padding.num_tokens
    if n > total:
        raise ValueError(f"{n} tokens do not fit a padded batch of {total}")
    fill = {**_PAD_FILL, "state_slots": padding.scratch_slot, "req_rows": 0}
    out = {}
    for name, a in arrays.items():
        if not isinstance(a, np.ndarray):
            out[name] = a
            continue
        pad = np.full((total - a.shape[0], *a.shape[1:]), fill.get(name, -1), dtype=np.int64)
        if name == "req_rows":
            pad = np.arange(n, total, dtype=np.int64)
        out[name] = np.concatenate([a, pad])
    return out


def pack(arrays: dict, sample_idx: np.ndarray):
    """One flat int64 buffer and the (name, offset, shape) of each field inside it. Every field
    starts 16-byte aligned, as a tensor of its own would: kernels specialise on the alignment of
    their pointers, so an alignment that changed with the batch would compile new variants."""
    parts, layout, offset = [], [], 0
    names = [*INT_FIELDS, *(n for n in TABLE_FIELDS if n in arrays), "sample_idx"]
    for name in names:
        a = np.ascontiguousarray(sample_idx if name == "sample_idx" else arrays[name], np.int64)
        parts.append(a.ravel())
        layout.append((name, offset, a.shape))
        offset += a.size
        if offset % 2:
            parts.append(_ALIGN_PAD)
            offset += 1
    return np.concatenate(parts), layout


_ALIGN_PAD = np.zeros(1, dtype=np.int64)


def concat_packed(parts: list[tuple[np.ndarray, list]]) -> tuple[np.ndarray, list[list]]:
    """Several packed (flat, layout) pairs as one flat buffer (one upload) and each part's
    layout at its offset in it (every part's size is even, so fields stay aligned)."""
    layouts, base = [], 0
    for flat, layout in parts:
        layouts.append([(name, off + base, shape) for name, off, shape in layout])
        base += flat.size
    return np.concatenate([flat for flat, _ in parts]), layouts


def unpack(dev: torch.Tensor, layout) -> dict:
    """Views of the device buffer, one per field."""
    return {name: dev[off : off + int(np.prod(shape))].view(shape) for name, off, shape in layout}


def meta_from(dev, layout, plan: StepPlan, ropes, rope_len: int, static: bool = False,
              c128_cols: int = 1):  # fmt: skip
    fields = unpack(dev, layout)
    sample_ids = [e.req_id for e in plan.batch if e.sample]
    return BatchMeta(**fields, sample_req_ids=sample_ids, ropes=ropes, rope_len=rope_len,
                     static=static, c128_cols=c128_cols)  # fmt: skip


class HostStage:
    """Two pinned staging buffers used in turn: the copy of step n is long done when step n + 2
    fills its buffer again (each step ends with the sampled ids read back), and an event says so."""

    def __init__(self) -> None:
        self._bufs: list[torch.Tensor | None] = [None, None]
        self._events: list = [None, None]
        self._turn = 0

    def upload(self, flat: np.ndarray, device, out: torch.Tensor | None = None) -> torch.Tensor:
        """flat -> device int64 tensor (into `out` when given), without waiting for the device."""
        host = torch.from_numpy(flat)
        device = torch.device(device)
        if device.type != "cuda":
            if out is None:
                return host
            out[: flat.size].copy_(host)  # a bucket's buffer holds its largest step
            return out
        turn, self._turn = self._turn, 1 - self._turn
        buf = self._bufs[turn]
        if buf is None or buf.numel() < flat.size:
            buf = self._bufs[turn] = torch.empty(max(flat.size, 1 << 16), dtype=torch.int64,
                                                 pin_memory=True)  # fmt: skip
        elif self._events[turn] is not None:
            self._events[turn].synchronize()
        buf[: flat.size].copy_(host)
        if out is None:
            out = torch.empty(flat.size, dtype=torch.int64, device=device)
        out[: flat.size].copy_(buf[: flat.size], non_blocking=True)
        self._events[turn] = torch.cuda.Event()
        self._events[turn].record()
        return out


def id_table(rows: list[IdRow], width: int | None) -> np.ndarray:
    """[len(rows), width (None: the longest, at least 1)] int64, -1 past each row's ids."""
    longest = max(map(len, rows), default=0)
    if width is not None and longest > width:
        raise ValueError(f"{longest} pages do not fit a padded page table of {width} columns")
    width = max(width or longest, 1)
    if not rows:
        return np.full((0, width), -1, dtype=np.int64)
    return np.concatenate([row.padded(width) for row in rows]).reshape(len(rows), width)


def _check_windows(entries, window_table: np.ndarray, starts, counts) -> None:
    """Every window page a step's tokens read (positions p-127..p) is resident (window_table:
    [R, W], -1 where none); a missing one is a bookkeeping bug."""
    first = np.maximum(starts - WINDOW + 1, 0) // WINDOW
    last = (starts + counts - 1) // WINDOW
    width, rows = window_table.shape[1], np.arange(len(entries))
    bad = last >= width
    ends = (
        window_table[rows, np.minimum(first, width - 1)],
        window_table[rows, np.minimum(last, width - 1)],
    )
    bad |= (ends[0] < 0) | (ends[1] < 0)
    for i in np.flatnonzero((last - first > 1) & ~bad):  # a long chunk: the pages in between
        bad[i] = window_table[i, first[i] : last[i] + 1].min() < 0
    if bad.any():
        req_id = entries[int(np.flatnonzero(bad)[0])].req_id
        raise RuntimeError(f"{req_id}: a window page of its last 128 positions is gone")


def _window_slots_t(window_table, req_rows, positions) -> torch.Tensor:
    """[T, 128] window slots of positions p-127..p (-1 below 0 or where no page is resident)."""
    q = positions[:, None] + torch.arange(-WINDOW + 1, 1, device=positions.device)[None, :]
    idx = (q.clamp(min=0) // WINDOW).clamp(max=window_table.shape[1] - 1)
    page = window_table[req_rows[:, None], idx]
    return torch.where((q >= 0) & (page >= 0), page * WINDOW + q % WINDOW, -1)


def _entry_slots(page_table: np.ndarray, rows, entries, per_page: int) -> np.ndarray:
    """Entry indices [T, k] of each token's request (-1 = none) -> physical slots [T, k]."""
    safe = np.maximum(entries, 0)
    page = page_table[rows[:, None], np.minimum(safe // per_page, page_table.shape[1] - 1)]
    return np.where(entries >= 0, page * per_page + safe % per_page, -1)


def _entry_slots_t(page_table, req_rows, entries, per_page: int) -> torch.Tensor:
    """The device twin of _entry_slots for indices computed on the device (top-k)."""
    safe = entries.clamp(min=0)
    page = page_table[req_rows[:, None], (safe // per_page).clamp(max=page_table.shape[1] - 1)]
    return torch.where(
        entries >= 0, page * per_page + safe % per_page, torch.full_like(entries, -1)
    )


def _out_loc(page_table, rows, pos, ratio: int) -> np.ndarray:
    """Slot of the entry a block-completing token writes (full_loc // ratio), else -1."""
    done = (pos + 1) % ratio == 0
    slot = _entry_slots(page_table, rows, (pos // ratio)[:, None], PAGE // ratio)[:, 0]
    return np.where(done, slot, -1)


def _c128_slots_t(page_table, req_rows, positions, width: int) -> torch.Tensor:
    """[T, width] slots of every C128 entry a token sees ((p + 1) // 128 of them), -1 padded."""
    entries = torch.arange(width, device=positions.device)[None, :]
    visible = ((positions + 1) // 128)[:, None]
    entries = torch.where(entries < visible, entries, -1)
    return _entry_slots_t(page_table, req_rows, entries, PAGE // 128)
