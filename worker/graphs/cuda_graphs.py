"""CUDA graphs of pure-decode steps: the whole stage forward captured per (batch, context) bucket.

A decode step (every request one token, nothing but sampling asked of it) is launch-bound: the
stage forward is thousands of small kernels. Each bucket owns one static int64 buffer that holds
every index tensor of worker/batch.py at fixed shapes:

    batch bucket b in (1, 2, 4, ..., max_batch): rows = tokens = b (rows past the step's requests
    are pad rows: no reads, -1 write slots, the scratch compressor state slot);
    context bucket L in (4096, 16384, 65536, then doubling: 131072 .. 1048576 ..), the last one the
    longest context rounded up to a page, so every context up to it has a bucket: page-table
    columns L / 256, C128 columns L / 128, RoPE tables covering L.

A step fills its bucket's buffer with one non-blocking upload and replays the graph; the step's
logits [b, V] fp32 (head included) come back in the graph's output tensor (valid until the next
replay).
With a draft worker the buckets are verification steps instead: n = k + 1 slotted rows per
request (worker/batch.py), every request a decode whose last token is followed by up to k
drafts, and the graph returns the logits of every row, the pre-head residual stack and the
running top-k the draft worker reads (VERIFY_MAX_BATCH bounds those buckets: their logits are
n times a decode graph's).
Every stage of a pipeline captures its own layer range: the first embeds the step's tokens, a
later one copies the residual stack [T, hc, hidden] and top-k [T, k] it received into its static
input rows before the replay (``prepare``), and the last runs the head. Prefill and mixed steps
run eagerly. Graphs are captured once at startup, so no Triton compilation or capture happens
while serving. capture=False keeps the static buffers
and runs the forward on them eagerly at each step: the same padded layouts on any device.
"""

from __future__ import annotations

import copy
import logging
import time

import numpy as np
import torch

from dsv4ray.engine.plan import StepPlan
from dsv4ray.worker.batch import PAGE, BatchMeta, HostStage, Padding, host_arrays, meta_from, pack
from dsv4ray.worker.rope_tables import RopeTables

log = logging.getLogger("dsv4ray.worker")
FIRST_CONTEXT = 4096
QUAD_UNTIL = 65536  # buckets grow 4x up to here, then 2x (padding costs at most half the bucket)
VERIFY_MAX_BATCH = 64


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Powers of two below max_batch, then max_batch itself."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return (*sizes, max_batch)


def context_buckets(max_len: int) -> tuple[int, ...]:
    """4096, 16384, 65536, 131072, 262144, ... below max_len, then max_len rounded up to a page:
    every context up to max_len replays a graph."""
    top = -(-max_len // PAGE) * PAGE
    sizes, ctx = [], FIRST_CONTEXT
    while ctx < top:
        sizes.append(ctx)
        ctx *= 4 if ctx < QUAD_UNTIL else 2
    return (*sizes, top)


class GraphBucket:
    """One bucket: its padding, static buffer, the graph (None: replayed eagerly) and its output
    (valid until the next replay); meta: the static step the forward reads."""

    def __init__(self, padding: Padding, static: torch.Tensor, capture: bool):
        self.padding, self.static = padding, static
        self.graph = torch.cuda.CUDAGraph() if capture else None
        self.out = self.meta = None
        self.sample_offset = 0  # where the step's sample_idx starts in static

    def replay(self, forward) -> None:
        if self.graph is None:
            self.out = forward(self.meta)
        else:
            self.graph.replay()


def capture_bucket(g: GraphBucket, forward, device, pool):
    """Warms the forward up on a side stream (Triton compiles outside the capture), then
    captures it into g.graph from pool (None: a new pool); returns the pool. Without a graph the
    output comes from one eager run."""
    if g.graph is None:
        g.out = forward(g.meta)
        return pool
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            forward(g.meta)
    torch.cuda.current_stream(device).wait_stream(side)
    with torch.cuda.graph(g.graph, pool=pool):
        g.out = forward(g.meta)
    return g.graph.pool()


class DecodeGraphs:
    """Captures and replays the decode graphs of one stage (any layer range);
    tokens_per_entry > 1: verification steps of that many slotted rows per request."""

    def __init__(self, forward, ropes: RopeTables, scratch_slot: int, max_batch: int,
                 max_len: int, device, tokens_per_entry: int = 1,
                 capture: bool = True) -> None:  # fmt: skip
        self.forward, self.ropes, self.device = forward, ropes, torch.device(device)
        self.scratch_slot, self.n, self.capture = scratch_slot, tokens_per_entry, capture
        if tokens_per_entry > 1:
            max_batch = min(max_batch, VERIFY_MAX_BATCH)
        self.batches, self.contexts = batch_buckets(max_batch), context_buckets(max_len)
        self.graphs: dict[tuple[int, int], GraphBucket] = {}
        self.stage_buf = HostStage()  # pinned staging of the buckets' metadata
        self.pool = None
        self.replays: dict[tuple[int, int], int] = {}  # bucket -> steps it ran

    def capture_all(self) -> None:
        """Every bucket, largest batch first (later captures reuse its memory pool)."""
        t0 = time.perf_counter()
        self.ropes.ensure(max(self.contexts))
        for ctx in self.contexts:
            for b in reversed(self.batches):
                self.graphs[(b, ctx)] = self._capture(b, ctx)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        kind = "decode" if self.n == 1 else f"verification ({self.n} tokens per request)"
        log.info(
            "%s %d %s graphs (batch %s x context %s) in %.1f s",
            "captured" if self.capture else "built", len(self.graphs), kind, self.batches,
            self.contexts, time.perf_counter() - t0,
        )  # fmt: skip

    def _padding(self, b: int, ctx: int) -> Padding:
        slotted = self.n if self.n > 1 else 0
        return Padding(b * self.n, ctx // PAGE, ctx // 128, self.scratch_slot, slotted)

    def _capture(self, b: int, ctx: int) -> GraphBucket:
        padding = self._padding(b, ctx)
        empty = StepPlan(step_id=-1)
        arrays, _ = host_arrays(empty, {}, padding)
        # every row sampling: the largest buffer a step of this bucket packs
        flat, layout = pack(arrays, np.arange(b, dtype=np.int64))
        static = torch.empty(flat.size, dtype=torch.int64, device=self.device)
        static[: flat.size].copy_(torch.from_numpy(flat))
        g = GraphBucket(padding, static, self.capture)
        g.meta = meta_from(static, layout, empty, self.ropes, self.ropes.length, True, ctx // 128)
        g.sample_offset = layout[-1][1]
        self.pool = capture_bucket(g, self.forward, self.device, self.pool)
        return g

    def pick(self, plan: StepPlan, tables) -> tuple[int, int] | None:
        """The bucket that runs this step, or None when it must run eagerly."""
        if not self.graphs or not plan.batch or plan.has_host_ops or plan.eager:
            return None
        if plan.full_logits or plan.prompt_logprobs:  # rows beyond the sampled ones
            return None
        if not all(self._fits(e) for e in plan.batch):
            return None
        batch = next((b for b in self.batches if b >= len(plan.batch)), None)
        last = max(e.start_pos + e.num_tokens for e in plan.batch)
        pages = max(len(tables[e.req_id].page_ids) for e in plan.batch)
        ctx = next((c for c in self.contexts if c >= last and c // PAGE >= pages), None)
        return None if batch is None or ctx is None else (batch, ctx)

    def _fits(self, entry) -> bool:
        """One token (decode); verification buckets: a sampling decode and up to n - 1 drafts."""
        if self.n == 1:
            return entry.num_tokens == 1
        decode = entry.sample and entry.num_tokens - entry.num_drafts == 1
        return decode and entry.num_tokens <= self.n

    def stage(self, plan: StepPlan, tables, key: tuple[int, int]) -> BatchMeta:
        """Uploads the step's metadata into the bucket's buffer (stream-ordered: a replay of the
        bucket launched before still reads the previous step's) -> the step's meta."""
        g = self.graphs[key]
        arrays, sample_idx = host_arrays(plan, tables, g.padding)
        flat, layout = pack(arrays, sample_idx)
        self.stage_buf.upload(flat, self.device, out=g.static)
        name, offset, _ = layout[-1]  # fixed shapes: only sample_idx's length varies
        if name != "sample_idx" or offset != g.sample_offset:
            raise RuntimeError(f"bucket {key}: the step's layout is not the captured one")
        meta = copy.copy(g.meta)  # the captured views over g.static, this step's samples
        meta.sample_idx = g.static[offset : offset + len(sample_idx)]
        meta.sample_req_ids = [e.req_id for e in plan.batch if e.sample]
        return meta

    def replay(self, key: tuple[int, int], meta: BatchMeta, prepare=None):
        """Replays a staged bucket -> the forward's output. The last stage's: logits [b, V] fp32
        of a decode bucket; (logits [b n, V] fp32, stack [b n, hc, hidden], top-k [b n, k] or
        None) in slotted rows of a verification bucket. An earlier stage's: (stack, top-k or
        None) over the bucket's rows. prepare(meta) runs on the device before the replay:
        lookahead and draft tokens into meta.token_ids, or a later stage's received rows into
        its static inputs."""
        g = self.graphs[key]
        if prepare is not None:
            prepare(meta)
        g.replay(self.forward)
        self.replays[key] = self.replays.get(key, 0) + 1
        return g.out
