"""CUDA graphs of pure-decode steps: the whole stage forward captured per (batch, context) bucket.

A decode step (every request one token, nothing but sampling asked of it) is launch-bound: the
stage forward is thousands of small kernels. Each bucket owns one static int64 buffer that holds
every index tensor of worker/batch.py at fixed shapes:

    batch bucket b in (1, 2, 4, ..., max_batch): rows = tokens = b (rows past the step's requests
    are pad rows: no reads, -1 write slots, the scratch compressor state slot);
    context bucket L in (4096, 16384, 65536) up to the longest context: page-table columns L / 256,
    C128 columns L / 128, RoPE tables covering L.

A step fills its bucket's buffer with one non-blocking upload and replays the graph; the step's
logits [b, V] fp32 (head included) come back in the graph's output tensor (valid until the next
replay).
Prefill, mixed and longer-context steps run eagerly. Graphs are captured once at startup, so no
Triton compilation or capture happens while serving.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from dsv4ray.engine.plan import StepPlan
from dsv4ray.worker.batch import PAGE, HostStage, Padding, host_arrays, meta_from, pack
from dsv4ray.worker.rope_tables import RopeTables

log = logging.getLogger("dsv4ray.worker")
CONTEXT_BUCKETS = (4096, 16384, 65536)


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Powers of two below max_batch, then max_batch itself."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return (*sizes, max_batch)


def context_buckets(max_len: int) -> tuple[int, ...]:
    """CONTEXT_BUCKETS up to max_len; max_len (rounded up to a page) alone when it is shorter."""
    sizes = tuple(c for c in CONTEXT_BUCKETS if c <= max_len)
    return sizes or (-(-max_len // PAGE) * PAGE,)


class _Graph:
    def __init__(self, padding: Padding, static: torch.Tensor, layout, num_fixed: int):
        self.padding, self.static, self.layout, self.num_fixed = padding, static, layout, num_fixed
        self.graph = torch.cuda.CUDAGraph()
        self.out: torch.Tensor | None = None


class DecodeGraphs:
    """Captures and replays the decode graphs of one whole-model stage (first and last)."""

    def __init__(self, forward, ropes: RopeTables, scratch_slot: int, max_batch: int,
                 max_len: int, device) -> None:  # fmt: skip
        self.forward, self.ropes, self.device = forward, ropes, torch.device(device)
        self.scratch_slot = scratch_slot
        self.batches, self.contexts = batch_buckets(max_batch), context_buckets(max_len)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.stage = HostStage()
        self.pool = None
        self.replays: dict[tuple[int, int], int] = {}  # bucket -> steps it ran

    def capture_all(self) -> None:
        """Every bucket, largest batch first (later captures reuse its memory pool)."""
        t0 = time.perf_counter()
        self.ropes.ensure(max(self.contexts))
        for ctx in self.contexts:
            for b in reversed(self.batches):
                self.graphs[(b, ctx)] = self._capture(b, ctx)
        torch.cuda.synchronize(self.device)
        log.info(
            "captured %d decode graphs (batch %s x context %s) in %.1f s",
            len(self.graphs), self.batches, self.contexts, time.perf_counter() - t0,
        )  # fmt: skip

    def _capture(self, b: int, ctx: int) -> _Graph:
        padding = Padding(b, ctx // PAGE, ctx // 128, self.scratch_slot)
        empty = StepPlan(step_id=-1)
        arrays, _ = host_arrays(empty, {}, padding)
        # every row sampling: the largest buffer a step of this bucket packs
        flat, layout = pack(arrays, np.arange(b, dtype=np.int64))
        static = torch.empty(flat.size, dtype=torch.int64, device=self.device)
        static[: flat.size].copy_(torch.from_numpy(flat))
        g = _Graph(padding, static, layout, flat.size)
        meta = meta_from(static, layout, empty, self.ropes, self.ropes.length, True, ctx // 128)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # compile and warm up outside the capture
            for _ in range(2):
                self.forward(meta)
        torch.cuda.current_stream(self.device).wait_stream(side)
        with torch.cuda.graph(g.graph, pool=self.pool):
            g.out = self.forward(meta)
        self.pool = g.graph.pool()
        return g

    def pick(self, plan: StepPlan, tables) -> tuple[int, int] | None:
        """The bucket that runs this step, or None when it must run eagerly."""
        if not self.graphs or not plan.batch or plan.full_logits or plan.has_host_ops or plan.eager:
            return None
        if any(e.num_tokens != 1 for e in plan.batch):
            return None
        batch = next((b for b in self.batches if b >= len(plan.batch)), None)
        last = max(e.start_pos for e in plan.batch) + 1
        pages = max(len(tables[e.req_id].page_ids) for e in plan.batch)
        ctx = next((c for c in self.contexts if c >= last and c // PAGE >= pages), None)
        return None if batch is None or ctx is None else (batch, ctx)

    def run(self, plan: StepPlan, tables, key: tuple[int, int], fill=None):
        """Fills the bucket's buffer and replays it -> (logits [b, V] fp32, meta). fill(token_ids)
        may rewrite the uploaded token ids on the device before the replay (lookahead tokens)."""
        g = self.graphs[key]
        arrays, sample_idx = host_arrays(plan, tables, g.padding)
        flat, layout = pack(arrays, sample_idx)
        self.stage.upload(flat, self.device, out=g.static)
        cols = g.padding.c128_cols
        meta = meta_from(g.static, layout, plan, self.ropes, self.ropes.length, True, cols)
        if fill is not None:
            fill(meta.token_ids)
        g.graph.replay()
        self.replays[key] = self.replays.get(key, 0) + 1
        return g.out, meta
