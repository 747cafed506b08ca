"""The captured decode and verification steps of one pipeline stage, whatever its layer range.

A stage replays one graph per (batch, context) bucket (worker/graphs/cuda_graphs.py) over its own
layers:

    first stage   embeds the bucket's token ids (lookahead and draft tokens written into them on
                  the device before the replay)
    later stage   reads its static inputs: the residual stack [rows, hc, hidden] and running
                  top-k [rows, k] (-1 rows: none), into which the rows it received are copied
                  before the replay
    last stage    runs the head: logits of every row (a verification bucket also returns the
                  pre-head stack and the top-k the draft worker reads)
    earlier one   returns the stack and top-k of every row

Between stages travel the rows of the step's tokens in batch order ([T, hc * hidden], [T, k]),
whichever way each stage ran: a decode bucket's tokens are its first T rows, a verification
bucket's are slotted (request i from row i * n). Pad rows of the static inputs keep earlier
steps' finite values and read nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from dsv4ray.engine.plan import StageResult, StepPlan
from dsv4ray.worker.batch import BatchMeta, slotted_rows
from dsv4ray.worker.graphs.cuda_graphs import DecodeGraphs
from dsv4ray.worker.host.host_io import LayerEvents
from dsv4ray.worker.sampling.sampler import to_device


class GraphedStage(Protocol):
    """What a stage's graphs read of their stage (``StageWorker``); a protocol, since the
    worker imports this module."""

    cfg: Any
    model: Any
    pools: Any
    tables: Any
    ropes: Any
    device: torch.device
    is_first: bool
    is_last: bool

    def run_layers(self, meta: BatchMeta, inputs: StageResult | None,
                   events: LayerEvents) -> tuple: ...  # fmt: skip

    def fill_tokens(self, plan: StepPlan, token_ids: torch.Tensor, inputs) -> None: ...


class TokenFill(Protocol):
    """The drafts of a plan still on the device (``worker.spec.draft_fill.DraftFill``)."""

    def write_tokens(self, token_ids: torch.Tensor, rows=None) -> None: ...


@dataclass
class Staged:
    """A step's bucket with its metadata uploaded; rows: the bucket row of each batch token."""

    key: tuple[int, int]
    meta: BatchMeta
    rows: np.ndarray


class StageGraphs:
    """The buckets of one stage (``worker``: its model, pools, tables and layer loop)."""

    def __init__(self, worker: GraphedStage, max_batch: int, max_len: int, draft_steps: int,
                 capture: bool) -> None:  # fmt: skip
        self.w, self.n = worker, draft_steps + 1
        scratch = worker.pools.sizes.num_state_slots - 1
        self.graphs = DecodeGraphs(self._forward, worker.ropes, scratch, max_batch, max_len,
                                   worker.device, self.n, capture)  # fmt: skip
        rows = max(self.graphs.batches) * self.n
        self.residual = self.topk = None
        if not worker.is_first:
            c = worker.cfg
            self.residual = torch.zeros(rows, c.hc_mult, c.hidden_size, dtype=worker.model.dtype,
                                        device=worker.device)  # fmt: skip
            if any(spec.compress_ratio == 4 for spec in c.layers[: worker.model.start]):
                self.topk = torch.full((rows, c.index_topk), -1, dtype=torch.int64,
                                       device=worker.device)  # fmt: skip

    def capture_all(self) -> None:
        self.graphs.capture_all()

    @property
    def replays(self) -> dict:
        return self.graphs.replays

    def pick(self, plan: StepPlan) -> tuple[int, int] | None:
        """The bucket of a step (decode buckets take plain steps, verification buckets those
        that feed a draft worker), or None when it runs eagerly."""
        if (self.n > 1) != plan.draft:
            return None
        return self.graphs.pick(plan, self.w.tables)

    def stage(self, plan: StepPlan, key) -> Staged:
        """Uploads the step's metadata into its bucket (needs no rows from the stage before)."""
        counts = [e.num_tokens for e in plan.batch]
        rows = slotted_rows(counts, self.n) if self.n > 1 else np.arange(sum(counts))
        return Staged(key, self.graphs.stage(plan, self.w.tables, key), rows)

    def run(self, plan: StepPlan, inputs: StageResult | None, staged: Staged,
            draft_fill: TokenFill | None):  # fmt: skip
        """Replays a staged step's bucket -> (its output, meta, rows: the row of each batch
        token, numpy [T])."""
        rows = staged.rows

        def prepare(meta: BatchMeta) -> None:
            if not self.w.is_first:
                self._take_inputs(inputs, rows)
            self.w.fill_tokens(plan, meta.token_ids, inputs)
            if draft_fill is not None:  # hash-routed layers read the drafts' ids too
                draft_fill.write_tokens(meta.token_ids, rows if self.n > 1 else None)

        out = self.graphs.replay(staged.key, staged.meta, prepare)
        return out, staged.meta, rows

    def hand_on(self, out, rows: np.ndarray, result: StageResult) -> None:
        """An earlier stage's output rows of the batch tokens, in batch order, into result."""
        x, topk = out
        if self.n == 1:  # packed: the tokens are the first rows
            num = len(rows)
            result.residual, result.topk = x[:num].flatten(-2), None if topk is None else topk[:num]
            return
        idx = to_device(rows.tolist(), torch.long, x.device)
        result.residual = x.index_select(0, idx).flatten(-2)
        result.topk = topk.index_select(0, idx) if topk is not None else None

    def _take_inputs(self, inputs: StageResult, rows: np.ndarray) -> None:
        """The received rows [T, hc * hidden] (top-k [T, k]) into the static inputs."""
        c, num = self.w.cfg, len(rows)
        received = inputs.residual.view(num, c.hc_mult, c.hidden_size)
        if self.n == 1:
            self.residual[:num].copy_(received)
            if self.topk is not None:
                self.topk[:num].copy_(inputs.topk)
            return
        idx = to_device(rows.tolist(), torch.long, self.residual.device)
        self.residual.index_copy_(0, idx, received.to(self.residual.dtype))
        if self.topk is not None:
            self.topk.index_copy_(0, idx, inputs.topk.to(torch.int64))

    def _forward(self, meta: BatchMeta):
        """The captured forward over the bucket's rows (see the module doc for its output)."""
        num = meta.num_tokens
        inputs = None
        if not self.w.is_first:
            inputs = StageResult(-1, residual=self.residual[:num].flatten(-2))
            inputs.topk = self.topk[:num] if self.topk is not None else None
        x, topk = self.w.run_layers(meta, inputs, LayerEvents())
        if not self.w.is_last:
            return x, topk
        logits = self.w.model.logits(x)
        return (logits, x, topk) if self.n > 1 else logits
