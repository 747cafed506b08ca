"""CUDA graphs of the draft worker's decode steps: the exact pass and the chain, in one replay.

After a verification step every request has 1 .. k + 1 exact positions (its accepted drafts and
the target's next token) and then k - 1 chain steps of one token. A bucket (b, L) holds such a
step at fixed shapes, all its index fields in one int64 buffer:

    exact pass   slotted rows (worker/batch.py): request i's positions from row i * (k + 1),
                 pad rows after them, page-table columns L / 256, C128 columns L / 128; its
                 sample_idx holds each request's first row
    drafts       [b, k] the tokens each request's rows' next tokens are compared with, in order
                 (-2 pads: no token equals it)
    span rows    [<= b (k + 1)] the slotted row of each residual row the last stage handed over

The graph counts each request's accepted drafts a (leading rows whose next token equals its
draft) and starts the chain at row a, its k - 1 steps' index fields computed on the device from
the exact pass's (worker/spec/draft_chain.py). Fed from the host, the next tokens are known and the
drafts are those tokens, so a is the last exact row. Fed from a replayed verification on the
device (``run_verified``), every position of the step is an exact row with the target's token
as its next token, and a is the accepted count the host learns only later: rows past it write
window slots (and C4 ring rows) of positions past the request's tokens, which the exact pass
that reaches those positions rewrites before anything reads them (the chain reads positions
past the start from its scratch page, and top-k only up to the start).

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
from dsv4ray.worker.graphs.cuda_graphs import (
    VERIFY_MAX_BATCH,
    GraphBucket,
    batch_buckets,
    capture_bucket,
    context_buckets,
)
from dsv4ray.worker.spec.draft_chain import chain_metas
from dsv4ray.worker.spec.draft_fill import DraftFill
from dsv4ray.worker.spec.verify import DraftSpan, Handoff

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
        self.num_verified = 0  # of them, steps fed from a verification on the device

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
        flat, layouts = self._host([], [], padding)
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
        drafts = [s.next_tokens[:-1] for s in spans]  # every row's next token matches: a = last
        g, span_rows = self._upload(spans, drafts, key)
        c = self.w.cfg
        stack = residual.view(residual.shape[0], c.hc_mult, c.hidden_size)
        return self._replay(g, key, span_rows, stack, topk, len(spans))

    def run_verified(self, plan: StepPlan, handoff: Handoff, key,
                     draft_fill: DraftFill | None = None) -> torch.Tensor:  # fmt: skip
        """A replayed verification's rows on the device (every batch entry a decode with its
        drafts; draft_fill: those still on the device) -> drafts [len(plan.batch), k] int64 on
        the device, each request's chain starting after its accepted drafts."""
        staged = self.stage_verified(plan, key)
        if draft_fill is not None:
            draft_fill.write_table(staged[0].meta[2])
        return self.replay_verified(plan, handoff, key, staged)

    def stage_verified(self, plan: StepPlan, key):
        """The host half of ``run_verified``: the bucket's metadata from the plan alone, uploaded
        (a draft actor stages while the last stage still verifies) -> what ``replay_verified``
        takes."""
        spans, drafts, first = verified_spans(plan), [], 0
        for e in plan.batch:
            drafts.append(plan.token_ids[first + 1 : first + e.num_tokens])
            first += e.num_tokens
        return self._upload(spans, drafts, key)

    def replay_verified(self, plan: StepPlan, handoff: Handoff, key, staged) -> torch.Tensor:
        """The device half: the verification's rows and tokens into the staged bucket, then the
        replay -> drafts [len(plan.batch), k] int64 on the device."""
        g, span_rows = staged
        self.num_verified += 1
        exact_tokens = g.meta[0].token_ids  # -1 (logits not finite) embeds as 0; it aborts
        exact_tokens.index_copy_(0, span_rows, handoff.token_ids.clamp(min=0))
        stack = handoff.stack.index_select(0, span_rows)
        topk = handoff.topk.index_select(0, span_rows) if handoff.topk is not None else None
        return self._replay(g, key, span_rows, stack, topk, len(plan.batch))

    def _upload(self, spans, drafts, key):
        g = self.graphs[key]
        flat, layouts = self._host(spans, drafts, g.padding)
        self.w.stage.upload(flat, self.device, out=g.static)
        num_rows = sum(len(s.next_tokens) for s in spans)
        span_rows = unpack(g.static, [("span_rows", layouts[-1][1], (num_rows,))])["span_rows"]
        return g, span_rows

    def _replay(self, g, key, span_rows, stack, topk, num_spans: int) -> torch.Tensor:
        self.h.index_copy_(0, span_rows, stack.to(self.h.dtype))
        if self.w.reuses_topk:
            self.topk.fill_(-1)
            self.topk[:, : topk.shape[1]].index_copy_(0, span_rows, topk.to(torch.int64))
        g.replay(self._forward)
        self.replays[key] = self.replays.get(key, 0) + 1
        return g.out[:num_spans]

    def _host(self, spans: list[DraftSpan], drafts: list, padding: Padding):
        """The bucket's flat buffer and each part's layout (exact, drafts, span rows: (name,
        offset, capacity))."""
        sub = StepPlan(step_id=-1)
        for s in spans:
            sub.batch.append(BatchEntry(s.req_id, s.start_pos, len(s.next_tokens), True))
            sub.token_ids.extend(s.next_tokens)
        b = padding.num_tokens // self.n
        arrays, _ = host_arrays(sub, self.w.tables, padding)
        parts = [pack(arrays, np.arange(b, dtype=np.int64) * self.n)]
        table = np.full((b, self.n - 1), -2, dtype=np.int64)
        for i, tokens in enumerate(drafts):
            table[i, : len(tokens)] = tokens
        parts.append(_raw("drafts", table))
        rows = slotted_rows([len(s.next_tokens) for s in spans], self.n)
        span = np.zeros(padding.num_tokens, dtype=np.int64)
        span[: len(rows)] = rows
        flat, layouts = concat_packed(parts)
        layouts.append(("span_rows", flat.size, (padding.num_tokens,)))
        return np.concatenate([flat, span]), layouts

    def _metas(self, static: torch.Tensor, layouts, padding: Padding):
        """(exact meta, first rows [b], drafts [b, k]) over views of the static buffer."""
        w, empty = self.w, StepPlan(step_id=-1)
        exact = meta_from(static, layouts[0], empty, w.ropes, w.ropes.length, True,
                          padding.c128_cols)  # fmt: skip
        return exact, exact.sample_idx, unpack(static, layouts[1])["drafts"]

    def _forward(self, metas) -> torch.Tensor:
        exact, first, drafts = metas
        w, rows = self.w, exact.num_tokens
        next_tokens = exact.token_ids.view(-1, self.n)[:, :-1]  # [b, k]
        accepted = (next_tokens == drafts).long().cumprod(1).sum(1)  # [b]
        last = first + accepted  # each request's last exact row
        chain = chain_metas(exact, last, exact.positions.index_select(0, last), w.pools,
                            w.num_steps, w.ropes, exact.rope_len, static=True)  # fmt: skip
        topk = self.topk[:rows] if w.reuses_topk else None
        x = w.exact_pass(self.h[:rows], exact, topk)
        topk = topk.index_select(0, last) if topk is not None else None
        return w.propose(x.index_select(0, last), chain, topk)


def verified_spans(plan: StepPlan) -> list[DraftSpan]:
    """Every position of a verification step as exact rows (next tokens: placeholders the
    device fills with the target's tokens)."""
    spans, first = [], 0
    for e in plan.batch:
        spans.append(DraftSpan(e.req_id, e.start_pos, first, [0] * e.num_tokens, True))
        first += e.num_tokens
    return spans


def _raw(name: str, values: np.ndarray):
    """One packed part of a single field (even size, so later parts stay aligned)."""
    flat = np.ascontiguousarray(values, dtype=np.int64).ravel()
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, dtype=np.int64)])
    return flat, [(name, 0, values.shape)]
