"""DraftWorker: the MTP draft layer as a plain class (the draft actor is a thin shell over it).

It holds the MTP block (``mtp.0.*``) with the target's embedding and lm head, and its own paged
pools (cache/draft_pools.py) under the scheduler's ids. It runs after the last stage of every
step (``execute(plan, last_stage_result)``):

1. Bookkeeping, as a stage: drop finished and preempted requests, create new ones (rings reset,
   or copied from a prefix hit's snapshot), apply diffs (a rollback cuts the page table).
2. The exact pass: every position whose next token is known after the step (worker/verify.py's
   draft spans: accepted positions, whole prefill chunks) runs through the block with the
   target's pre-head residual row and the next token, x = e_proj(enorm(embed(next))) +
   h_proj(hnorm(h)), writing the draft layer's window KV (and C4 entries) at real slots; a
   DSA-style draft attends to the target's last C4 layer's top-k of each position. Snapshots of
   the draft's C4 rings are taken here, as the stages take theirs.
3. Chain drafting for requests that sampled: the last exact row's logits give draft 1 (top-1);
   step j feeds the block's own output stack of step j - 1 with draft j at the next position, and
   its logits give draft j + 1. Chain steps write their window KV to the request's scratch page,
   complete no C4 entry, and (DSA-style) reuse step 0's top-k: the top-k of the last exact
   position (``stats["num_topk_reuse_rows"]`` counts the rows that reused it).

A failure inside the draft pass costs drafts, never tokens: the step's result goes on without
proposals.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from dsv4ray.cache.draft_pools import DraftPools
from dsv4ray.cache.pools import PoolSizes
from dsv4ray.config import ModelConfig
from dsv4ray.engine.plan import BatchEntry, NewRequest, StageResult, StepPlan
from dsv4ray.engine.spec import DRAFT_STAT_NAMES, SpecConfig
from dsv4ray.model.loader import load_draft
from dsv4ray.worker.batch import WINDOW, HostStage, ReqTable, build_batch, meta_from, pack
from dsv4ray.worker.paged import paged_block
from dsv4ray.worker.rope_tables import RopeTables
from dsv4ray.worker.verify import DraftSpan, draft_spans

log = logging.getLogger("dsv4ray.draft")


class DraftWorker:
    """Two-phase start like StageWorker: load the weights, then ``allocate`` the pools."""

    def __init__(
        self,
        model_path: str,
        num_steps: int,
        kv_cache_dtype: str = "fp8",
        dtype: torch.dtype | str | None = None,
        device: str | torch.device = "cpu",
        cfg: ModelConfig | None = None,
        eagle_topk: int = 1,
    ) -> None:
        self.cfg = cfg or ModelConfig.from_hf(model_path)
        SpecConfig(num_steps, eagle_topk).check_draft_layer(self.cfg.mtp_ratio, [])
        if not num_steps:
            raise ValueError("a draft worker needs speculative_num_steps >= 1")
        self.reuses_topk = self.cfg.mtp_ratio == 4
        if self.reuses_topk and 4 not in self.cfg.layer_ratios:
            raise ValueError("a DSA-style draft layer needs a C4 layer's top-k to reuse")
        self.num_steps, self.kv_cache_dtype = num_steps, kv_cache_dtype
        self.device = torch.device(device)
        self.model = load_draft(model_path, dtype or self.cfg.torch_dtype, device, self.cfg)
        self.block = self.model.block
        self.ropes = RopeTables([self.cfg.mtp_layer.rope], self.device)
        self.pools: DraftPools | None = None
        self.tables: dict[str, ReqTable] = {}
        self.stage = HostStage()
        self.stats = dict.fromkeys(DRAFT_STAT_NAMES, 0)

    def allocate(self, sizes: PoolSizes) -> int:
        self.pools = DraftPools(self.cfg, sizes, self.kv_cache_dtype, self.device)
        log.info(
            "draft layer (%s, %d steps): pools %.1f MiB in %s pages",
            "DSA-style" if self.reuses_topk else "window-only",
            self.num_steps,
            self.pools.nbytes() / 2**20,
            self.kv_cache_dtype,
        )
        return self.pools.nbytes()

    @torch.no_grad()
    def execute(self, plan: StepPlan, inputs: StageResult) -> StageResult:
        """The last stage's result without its tensors, with proposals in ``drafts``."""
        self._apply(plan)
        out = dataclasses.replace(inputs, residual=None, topk=None, drafts={}, draft_stats={})
        if inputs.failed is not None or not plan.batch:
            return out
        try:
            self._run(plan, inputs, out)
        except Exception:  # the step's tokens stand; only its proposals are lost
            log.exception("draft pass of step %d failed", plan.step_id)
            out.drafts = {}
        return out

    # ------------------------------------------------------------------ bookkeeping
    def _apply(self, plan: StepPlan) -> None:
        for req_id in [*plan.finished_ids, *plan.preempted_ids]:
            self.tables.pop(req_id, None)
        for new in plan.new_requests:
            self._add(new)
        for diff in plan.diffs:
            table = self.tables[diff.req_id]
            if diff.num_pages >= 0:
                del table.page_ids[diff.num_pages :]
            table.page_ids.extend(diff.new_page_ids)
            for idx, page in diff.new_window_pages:
                if idx >= len(table.window_page_ids):
                    table.window_page_ids.extend([-1] * (idx + 1 - len(table.window_page_ids)))
                table.window_page_ids[idx] = page
            for idx in diff.freed_window_idxs:
                table.window_page_ids[idx] = -1

    def _add(self, new: NewRequest) -> None:
        self.tables[new.req_id] = ReqTable(
            new.state_slot, list(new.page_ids), list(new.window_page_ids)
        )
        self.pools.reset_rings([new.state_slot])
        if new.state_copy_from >= 0:
            self.pools.copy_rings([self.pools.cached_row(new.state_copy_from)], [new.state_slot])

    def _snapshots(self, plan: StepPlan) -> None:
        if plan.snapshots:
            src = [self.tables[req_id].state_slot for req_id, _ in plan.snapshots]
            self.pools.copy_rings(src, [self.pools.cached_row(slot) for _, slot in plan.snapshots])

    # ------------------------------------------------------------------ the passes
    def _run(self, plan: StepPlan, inputs: StageResult, out: StageResult) -> None:
        spans = draft_spans(plan, inputs)
        x = meta = None
        if spans:
            x, meta = self._exact(plan.step_id, spans, inputs)
        self._snapshots(plan)
        sampled = [s for s in spans if s.sampled]
        if not sampled:
            return
        rows = meta.sample_idx
        topk = inputs.topk.index_select(0, rows) if self.reuses_topk else None
        drafts, num_reused = self._chain(sampled, x.index_select(0, rows), topk)
        out.drafts = {s.req_id: d for s, d in zip(sampled, drafts, strict=True)}
        step_stats = {
            "num_draft_passes": 1,
            "num_drafted_tokens": len(sampled) * self.num_steps,
            "num_topk_reuse_rows": num_reused,
        }
        for name, value in step_stats.items():
            self.stats[name] += value
        out.draft_stats = step_stats

    def _exact(self, step_id: int, spans: list[DraftSpan], inputs: StageResult):
        """The block over every span's positions with the target's rows -> (its output stack
        [N, hc, hidden], the batch meta; meta.sample_idx = last row of each sampled span)."""
        sub = StepPlan(step_id=step_id)
        for s in spans:
            sub.batch.append(BatchEntry(s.req_id, s.start_pos, len(s.next_tokens), s.sampled))
            sub.token_ids.extend(s.next_tokens)
        meta = build_batch(sub, self.tables, self.device, self.ropes, self.stage)
        c = self.cfg
        h = inputs.residual.view(meta.num_tokens, c.hc_mult, c.hidden_size).to(self.model.dtype)
        x = self.block.mix(h, self.model.embed(meta.token_ids))
        x, _ = paged_block(self.block, x, meta, self.pools, inputs.topk)
        return x, meta

    def _chain(self, spans: list[DraftSpan], x: torch.Tensor, topk):
        """x [R, hc, hidden]: the block's output at each span's last position -> (k drafts per
        span, top-1 at every step; the rows whose attention read the reused top-k)."""
        head = self.model.head.weight
        tokens = self.block.head_logits(x, head).argmax(-1)  # [R]
        drafts, num_reused = [tokens], 0
        last = np.array([s.start_pos + len(s.next_tokens) - 1 for s in spans], dtype=np.int64)
        for step in range(1, self.num_steps):
            meta = self._chain_meta(spans, last + step, last)
            x = self.block.mix(x, self.model.embed(tokens))
            x, _ = paged_block(self.block, x, meta, self.pools, topk)
            num_reused += topk.shape[0] if topk is not None else 0
            tokens = self.block.head_logits(x, head).argmax(-1)
            drafts.append(tokens)
        return torch.stack(drafts, dim=1).cpu().tolist(), num_reused

    def _chain_meta(self, spans, positions: np.ndarray, last: np.ndarray):
        """Index tensors of one chain step: one token per span at `positions`; window keys up to
        `last` (the last exact position) from the real window pages, later ones (this chain's
        earlier steps) and the token's own KV from the span's scratch page. Token ids stay 0:
        the draft block's MoE routes by score, and its embedding input never leaves the device."""
        tables = [self.tables[s.req_id] for s in spans]
        slots = np.array([t.state_slot for t in tables], dtype=np.int64)
        scratch = np.array([self.pools.scratch_page(int(s)) for s in slots], dtype=np.int64)
        q = positions[:, None] + np.arange(-WINDOW + 1, 1, dtype=np.int64)[None, :]
        real = np.full(q.shape, -1, dtype=np.int64)
        for i, table in enumerate(tables):  # every window page of the last 128 is resident
            ok = (q[i] >= 0) & (q[i] <= last[i])
            real[i, ok] = np.asarray(table.window_page_ids)[q[i, ok] // WINDOW] * WINDOW
            real[i, ok] += q[i, ok] % WINDOW
        window_slots = np.where(q > last[:, None], scratch[:, None] * WINDOW + q % WINDOW, real)
        n = len(spans)
        pages = max(len(t.page_ids) for t in tables)
        page_table = np.full((n, max(pages, 1)), -1, dtype=np.int64)
        for i, table in enumerate(tables):
            page_table[i, : len(table.page_ids)] = table.page_ids
        none = np.full(n, -1, dtype=np.int64)
        arrays = {
            "token_ids": np.zeros(n, dtype=np.int64), "positions": positions,
            "seq_start": positions, "req_rows": np.arange(n, dtype=np.int64),
            "state_slots": np.full(n, self.pools.scratch_row, dtype=np.int64),
            "window_store": window_slots[:, -1].copy(), "c4_out": none, "c128_out": none,
            "c4_bound": (positions + 1) // 4, "page_table": page_table,
            "window_slots": window_slots, "c128_slots": np.full((n, 1), -1, dtype=np.int64),
        }  # fmt: skip
        flat, layout = pack(arrays, np.arange(n, dtype=np.int64))
        sub = StepPlan(step_id=-1, batch=[BatchEntry(s.req_id, 0, 1, True) for s in spans],
                       token_ids=[0] * n)  # fmt: skip
        dev = self.stage.upload(flat, self.device)
        return meta_from(dev, layout, sub, self.ropes, self.ropes.ensure(int(positions.max()) + 1))
