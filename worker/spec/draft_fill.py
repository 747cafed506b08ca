"""Drafts scheduled before they reach the host (in-process speculation).

The engine commits a step's tokens without waiting for its draft pass, and schedules the next
plan while that pass still runs: each entry of ``plan.draft_lookahead`` holds PENDING_DRAFT where
its drafts go. The proposals are still on the device (``PendingDrafts``: [R, k] int64, row i for
req_ids[i]); ``DraftFill`` copies them into the step's token ids (and the draft graph's draft
table) on the device, in stream order after the pass that wrote them, and ``resolve`` writes
their values into plan.token_ids once the host copy is in: before anything on the host reads a
draft (settling the verification, an eager draft pass, the commit).

A draft worker in an actor of its own holds its proposals instead (``HeldDrafts``): it launches
a step's draft pass and returns at once, so the driver commits the step while the pass runs; the
next plan's first call on the draft actor reads them back, and every stage writes them into the
plan's token ids before it prepares the step (``fill_held_drafts``).
"""

from __future__ import annotations

import numpy as np
import torch

from dsv4ray.engine.plan import StepPlan
from dsv4ray.worker.sampling.sampler import to_device

FILLER_DRAFT = 0  # stands in for proposals that never came


class PendingDrafts:
    """Proposals [R, k] int64 of the requests req_ids, their host copy issued (pinned,
    non-blocking) on CUDA; ``result`` waits for it. ``device`` stays valid until the draft
    graph that wrote it replays again, which is after every read of the next step is queued."""

    def __init__(self, req_ids: list[str], drafts: torch.Tensor) -> None:
        self.req_ids, self.device, self.event = req_ids, drafts, None
        if drafts.is_cuda:
            self.host = torch.empty(drafts.shape, dtype=drafts.dtype, pin_memory=True)
            self.host.copy_(drafts, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = drafts.clone()

    def result(self) -> dict[str, list[int]]:
        if self.event is not None:
            self.event.synchronize()
        return dict(zip(self.req_ids, self.host.tolist(), strict=True))


class HeldDrafts:
    """A draft actor's proposals by request: each request's latest pass (the one of the last
    step that sampled it), read back when asked for. A request's entry is dropped when it
    ends, or when a new step of it starts its pass (a pass that then fails leaves none)."""

    def __init__(self) -> None:
        self.passes: dict[str, PendingDrafts] = {}

    def hold(self, pending: PendingDrafts) -> None:
        for req_id in pending.req_ids:
            self.passes[req_id] = pending

    def drop(self, req_ids) -> None:
        for req_id in req_ids:
            self.passes.pop(req_id, None)

    def values(self) -> dict[str, list[int]]:
        """req_id -> its k proposals, for every request held (each pass read back once)."""
        out, read = {}, {}
        for req_id, pending in self.passes.items():
            if id(pending) not in read:
                read[id(pending)] = pending.result()
            out[req_id] = read[id(pending)][req_id]
        return out


def fill_held_drafts(plan: StepPlan, values: dict[str, list[int]] | None) -> dict[str, list[int]]:
    """Writes the proposals a draft actor held into the drafts of plan.draft_lookahead (their
    PENDING_DRAFT ids), which are then drafts like any other -> the proposals the plan's step
    reports to the engine: values, plus FILLER_DRAFT ones for an entry whose proposals were
    lost (its draft actor failed or was replaced; a filler is verified like any draft, so
    tokens stay exact). values None: no draft actor, the plan is left as it is."""
    if values is None:
        return {}
    resolved, wanted, first = dict(values), set(plan.draft_lookahead), 0
    for e in plan.batch:
        if e.req_id in wanted and e.num_drafts:
            got = resolved.get(e.req_id)
            if got is None or len(got) < e.num_drafts:
                got = resolved[e.req_id] = [FILLER_DRAFT] * e.num_drafts
            start = first + e.num_tokens - e.num_drafts
            plan.token_ids[start : start + e.num_drafts] = got[: e.num_drafts]
        first += e.num_tokens
    if plan.drafts is not None:
        plan.drafts.lookahead = []
    return resolved


class DraftFill:
    """The pending drafts of one plan: where each goes (the entry's draft tokens, in batch
    token order) and where it comes from (row, column of the proposals)."""

    def __init__(self, plan: StepPlan, pending: PendingDrafts) -> None:
        self.plan, self.pending = plan, pending
        rows = {req_id: i for i, req_id in enumerate(pending.req_ids)}
        wanted, k = set(plan.draft_lookahead), pending.device.shape[1]
        dst, src, table, first = [], [], [], 0
        for i, e in enumerate(plan.batch):
            if e.req_id in wanted:
                if e.req_id not in rows:
                    raise RuntimeError(f"step {plan.step_id}: no pending drafts of {e.req_id}")
                start = first + e.num_tokens - e.num_drafts
                dst += range(start, start + e.num_drafts)
                src += [rows[e.req_id] * k + j for j in range(e.num_drafts)]
                table += [i * k + j for j in range(e.num_drafts)]
            first += e.num_tokens
        self.dst, self.src = np.array(dst, dtype=np.int64), src
        self.table = table  # flat [b, k] index of each draft: entry i's j-th draft
        self.k = k
        self._src_dev = self._table_dev = None  # device copies of src and table
        self.resolved: dict[str, list[int]] | None = None

    def _values(self) -> torch.Tensor:
        """The drafts on the device, in dst order."""
        if self._src_dev is None:
            self._upload([])
        return self.pending.device.reshape(-1).index_select(0, self._src_dev)

    def _upload(self, rows: list[int]) -> torch.Tensor:
        """rows, the source and the table indices in one upload; keeps the last two -> rows."""
        n, m = len(rows), len(self.src)
        idx = to_device(rows + self.src + self.table, torch.long, self.pending.device.device)
        self._src_dev, self._table_dev = idx[n : n + m], idx[n + m :]
        return idx[:n]

    def write_tokens(self, token_ids: torch.Tensor, row_of: np.ndarray | None = None) -> None:
        """Writes the drafts into a step's token ids on the device; row_of: the row of each
        batch token (slotted layouts), None: the batch token index itself."""
        if not len(self.dst):
            return
        rows = self.dst if row_of is None else row_of[self.dst]
        idx = self._upload(rows.tolist())
        token_ids.index_copy_(0, idx, self._values())

    def write_table(self, table: torch.Tensor) -> None:
        """Writes the drafts into a draft graph's [b, k] table of drafts to compare with."""
        if not len(self.dst):
            return
        if table.shape[1] != self.k:
            raise ValueError(f"a draft table of {table.shape[1]} columns for {self.k} drafts")
        values = self._values()  # uploads the indices unless write_tokens did
        table.view(-1).index_copy_(0, self._table_dev, values)

    def resolve(self) -> dict[str, list[int]]:
        """Waits for the proposals' host copy and writes the drafts into plan.token_ids; returns
        every pending request's proposals (req_id -> k drafts). Idempotent."""
        if self.resolved is None:
            values = self.pending.result()
            flat = [v for req_id in self.pending.req_ids for v in values[req_id]]
            for pos, src in zip(self.dst.tolist(), self.src, strict=True):
                self.plan.token_ids[pos] = flat[src]
            wanted = set(self.plan.draft_lookahead)
            self.resolved = {r: v for r, v in values.items() if r in wanted}
        return self.resolved
