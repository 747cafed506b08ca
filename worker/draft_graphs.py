"""CUDA graphs of the draft worker's decode steps: the exact pass and the chain, in one replay.

After a verification step every request has 1 .. k + 1 exact positions (its accepted drafts and
the target's next token) and then k - 1 chain steps of one token. A bucket (b, L) holds such a
step at fixed shapes, all its index fields in one int64 buffer:

    exact pass   slotted rows (worker/batch.py): request i's positions from row i * (k + 1),
                 pad rows after them, page-table columns L / 256, C128 columns L / 128
    last rows    [b] the row of each request's last exact position (the chain starts there)
    chain steps  k - 1 sets of index fields for b rows (worker/draft.py's chain_arrays)
    span rows    [<= b (k + 1)] the slotted row of each residual row the last stage handed over

The target's residual rows (and top-k rows) are copied to their slotted rows of static tensors
before the replay (pad rows keep earlier steps' finite values; their top-k rows are -1). The
graph's output is the drafts [b, k] int64. Steps with prefill chunks, more requests than the
largest bucket or longer contexts run eagerly.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from dsv4ray.engine.plan import BatchEntry, StepPlan
from dsv4ray.worker.batch import (
    PAGE,
    Padding,
    concat_packed,
    host_arrays,
    meta_from,
    pack,
    slotted_rows,
    unpack,
)  # fmt: skip
from dsv4ray.worker.cuda_graphs import (
    VERIFY_MAX_BATCH,
    GraphBucket,
    batch_buckets,
    capture_bucket,
    context_buckets,
)
from dsv4ray.worker.verify import DraftSpan

log = logging.getLogger("dsv4ray.draft")


class DraftGraphs:
    """The graphs of one DraftWorker (``worker``: its block, pools, tables and chain steps)."""

    def __init__(self, worker, max_batch: int, max_len: int, capture: bool = True) -> None:
        self.w, self.capture, self.device = worker, capture, worker.device
        self.n = worker.num_steps + 1
        self.batches = batch_buckets(min(max_batch, VERIFY_MAX_BATCH))
        self.contexts = context_buckets(max_len)
        c, rows = worker.cfg, max(self.batches) * self.n
        self.h = torch.zeros(rows, c.hc_mult, c.hidden_size, dtype=worker.model.dtype,
                             device=self.device)  # fmt: skip
        self.topk = torch.full((rows, c.index_topk), -1, dtype=torch.int64, device=self.device)
        self.graphs: dict[tuple[int, int], GraphBucket] = {}
        self.pool = None
        self.replays: dict[tuple[int, int], int] = {}  # bucket -> steps it ran

    def capture_all(self) -> None:
        t0 = time.perf_counter()
        self.w.ropes.ensure(max(self.contexts))
        for ctx in self.contexts:
            for b in reversed(self.batches):
                self.graphs[(b, ctx)] = self._capture(b, ctx)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        log.info(
            "%s %d draft graphs (batch %s x context %s, %d steps) in %.1f s",
            "captured" if self.capture else "built", len(self.graphs), self.batches,
            self.contexts, self.n - 1, time.perf_counter() - t0,
        )  # fmt: skip

    def _capture(self, b: int, ctx: int) -> GraphBucket:
        padding = Padding(b * self.n, ctx // PAGE, ctx // 128, self.w.pools.scratch_row, self.n)
        flat, layouts = self._host([], padding)
        static = torch.from_numpy(flat).to(self.device)
        g = GraphBucket(padding, static, self.capture)
        g.meta = self._metas(static, layouts, padding)
        self.pool = capture_bucket(g, self._forward, self.device, self.pool)
        return g

    def pick(self, spans: list[DraftSpan]) -> tuple[int, int] | None:
        """The bucket of a step whose spans all sampled and fit k + 1 rows, else None."""
        if not self.graphs or not spans:
            return None
        if not all(s.sampled and len(s.next_tokens) <= self.n for s in spans):
            return None
        batch = next((b for b in self.batches if b >= len(spans)), None)
        # the chain's last step runs at position start + len + k - 2
        last = max(s.start_pos + len(s.next_tokens) for s in spans) + self.n - 2
        pages = max(len(self.w.tables[s.req_id].page_ids) for s in spans)
        ctx = next((c for c in self.contexts if c > last and c // PAGE >= pages), None)
        return None if batch is None or ctx is None else (batch, ctx)

    def run(self, spans: list[DraftSpan], residual: torch.Tensor, topk, key) -> torch.Tensor:
        """residual [N, hc * hidden] (top-k [N, k'] or None): the spans' rows in order ->
        drafts [len(spans), k] int64 on the device."""
        g = self.graphs[key]
        flat, layouts = self._host(spans, g.padding)
        self.w.stage.upload(flat, self.device, out=g.static)
        num_rows = residual.shape[0]
        span_rows = unpack(g.static, [("span_rows", layouts[-1][1], (num_rows,))])["span_rows"]
        c = self.w.cfg
        stack = residual.view(num_rows, c.hc_mult, c.hidden_size).to(self.h.dtype)
        self.h.index_copy_(0, span_rows, stack)
        if self.w.reuses_topk:
            self.topk.fill_(-1)
            self.topk[:, : topk.shape[1]].index_copy_(0, span_rows, topk.to(torch.int64))
        g.replay(self._forward)
        self.replays[key] = self.replays.get(key, 0) + 1
        return g.out[: len(spans)]

    def _host(self, spans: list[DraftSpan], padding: Padding):
        """The bucket's flat buffer and each part's layout: exact, last rows, chain steps, span
        rows (the span rows' layout: (name, offset, capacity))."""
        sub = StepPlan(step_id=-1)
        for s in spans:
            sub.batch.append(BatchEntry(s.req_id, s.start_pos, len(s.next_tokens), True))
            sub.token_ids.extend(s.next_tokens)
        b = padding.num_tokens // self.n
        arrays, last_rows = host_arrays(sub, self.w.tables, padding)
        last = np.arange(b, dtype=np.int64) * self.n  # pad requests: their first (pad) row
        last[: len(spans)] = last_rows
        parts = [pack(arrays, last)]
        for step in range(1, self.n - 1):
            chain = self.w.chain_arrays(spans, step, b, padding.page_cols)
            parts.append(pack(chain, np.zeros(0, dtype=np.int64)))
        rows = slotted_rows([len(s.next_tokens) for s in spans], self.n)
        span = np.zeros(padding.num_tokens, dtype=np.int64)
        span[: len(rows)] = rows
        flat, layouts = concat_packed(parts)
        layouts.append(("span_rows", flat.size, (padding.num_tokens,)))
        return np.concatenate([flat, span]), layouts

    def _metas(self, static: torch.Tensor, layouts, padding: Padding):
        """(exact meta, last rows [b], chain metas) over views of the static buffer."""
        w, empty = self.w, StepPlan(step_id=-1)
        rope_len = w.ropes.length
        exact = meta_from(static, layouts[0], empty, w.ropes, rope_len, True, padding.c128_cols)
        last = exact.sample_idx
        chain = [meta_from(static, lay, empty, w.ropes, rope_len, True) for lay in layouts[1:-1]]
        return exact, last, chain

    def _forward(self, metas) -> torch.Tensor:
        exact, last, chain = metas
        rows = exact.num_tokens
        topk = self.topk[:rows] if self.w.reuses_topk else None
        x = self.w.exact_pass(self.h[:rows], exact, topk)
        topk = topk.index_select(0, last) if topk is not None else None
        return self.w.propose(x.index_select(0, last), chain, topk)
