"""DraftWorker: the MTP draft layer as a plain class (the draft actor is a thin shell over it).

It holds the MTP block (``mtp.0.*``) with the target's embedding and lm head, and its own paged
pools (cache/draft_pools.py) under the scheduler's ids. It runs after the last stage of every
step (``execute(plan, last_stage_result)``):

1. Bookkeeping, as a stage: drop finished and preempted requests, create new ones (rings reset,
   or copied from a prefix hit's snapshot), apply diffs (a rollback cuts the page table).
2. The exact pass: every position whose next token is known after the step (worker/spec/verify.py's
   draft spans: accepted positions, whole prefill chunks) runs through the block with the
   target's pre-head residual row and the next token, x = e_proj(enorm(embed(next))) +
   h_proj(hnorm(h)), writing the draft layer's window KV (and C4 entries) at real slots; a
   DSA-style draft attends to the target's last C4 layer's top-k of each position. Snapshots of
   the draft's C4 rings are taken here, as the stages take theirs.
3. Chain drafting for requests that sampled: the last exact row's logits give draft 1 (top-1);
   step j feeds the block's own output stack of step j - 1 with draft j at the next position, and
   its logits give draft j + 1. Chain steps write their window KV to the request's scratch page,
   complete no C4 entry, and (DSA-style) reuse step 0's top-k: the top-k of the last exact
   position (``stats["num_topk_reuse_rows"]`` counts the rows that reused it). Their index
   fields are computed on the device from the exact pass's (worker/spec/draft_chain.py).

Decode steps (every span sampled, at most k + 1 positions) replay one CUDA graph for the exact
pass and the chain together (worker/spec/draft_graphs.py); others run eagerly. After a replayed
verification in the same process the graph takes the step's rows and the target's tokens on
the device and finds the accepted drafts itself, so the host waits once per step, after
drafting. In an actor of its own (``held``) a pass is launched and the step returns at once:
the proposals are read back when the next plan asks for them (``held_values``), so the driver
commits a step while its draft pass runs.

A failure inside the draft pass costs drafts, never tokens: the step's result goes on without
proposals.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from dsv4ray.cache.draft_pools import DraftPools
from dsv4ray.cache.pool_sizes import PoolSizes
from dsv4ray.config import ModelConfig
from dsv4ray.engine.plan import BatchEntry, DraftResult, NewRequest, StageResult, StepPlan
from dsv4ray.engine.spec import DRAFT_STAT_NAMES, SpecConfig
from dsv4ray.kernels import dispatch
from dsv4ray.model.loader import load_draft
from dsv4ray.worker import ops
from dsv4ray.worker.batch import HostStage, build_batch, slotted_rows
from dsv4ray.worker.graphs.device_link import DeviceLink
from dsv4ray.worker.paged import paged_block
from dsv4ray.worker.req_table import ReqTable
from dsv4ray.worker.rope_tables import RopeTables
from dsv4ray.worker.spec.draft_chain import chain_metas
from dsv4ray.worker.spec.draft_fill import DraftFill, HeldDrafts, PendingDrafts, fill_held_drafts
from dsv4ray.worker.spec.draft_graphs import DraftGraphs, verified_spans
from dsv4ray.worker.spec.verify import DraftSpan, Handoff, draft_spans, hand_over, settle_handoff
from dsv4ray.worker.stage_spec import DraftSpec

log = logging.getLogger("dsv4ray.draft")


class DraftWorker:
    """Two-phase start like StageWorker: load the weights, then ``allocate`` the pools."""

    def __init__(self, spec: DraftSpec, cfg: ModelConfig | None = None) -> None:
        """cfg: the checkpoint's config when the caller has it (else read from spec.model)."""
        num_steps, kv_cache_dtype, device = spec.num_steps, spec.kv_cache_dtype, spec.device
        self.cfg = cfg or ModelConfig.from_hf(spec.model)
        SpecConfig(num_steps, spec.eagle_topk).check_draft_layer(self.cfg.mtp_ratio, [])
        if not num_steps:
            raise ValueError("a draft worker needs speculative_num_steps >= 1")
        self.reuses_topk = self.cfg.mtp_ratio == 4
        if self.reuses_topk and 4 not in self.cfg.layer_ratios:
            raise ValueError("a DSA-style draft layer needs a C4 layer's top-k to reuse")
        self.num_steps, self.kv_cache_dtype = num_steps, kv_cache_dtype
        self.device = torch.device(device)
        dispatch.for_device(self.device)
        self.weight_format = ops.resolve_weight_format(spec.weight_format, self.cfg, self.device)
        self.model = load_draft(spec.model, spec.dtype or self.cfg.torch_dtype, device, self.cfg,
                                self.weight_format)  # fmt: skip
        self.block = self.model.block
        fp8_prefill = ops.check_fp8_prefill(spec.fp8_prefill, self.weight_format, self.cfg,
                                            self.device, self.model.dtype)  # fmt: skip
        # as the stages: experts stacked, kernels bound and compiled before serving
        ops.prepare([self.block], self.model.dtype, fp8_prefill)
        ops.bind_few_row_kernels(self.block)
        self.ropes = RopeTables([self.cfg.mtp_layer.rope], self.device)
        self.pools: DraftPools | None = None
        self.tables: dict[str, ReqTable] = {}
        self.stage = HostStage()
        self.stats = dict.fromkeys(DRAFT_STAT_NAMES, 0)
        self.graphs: DraftGraphs | None = None
        # proposals left on the device as PendingDrafts: in process the next plan's stages take
        # them there, and the host reads them only before it settles that plan
        self.defer_drafts = False
        # in an actor of its own: proposals held here until the next plan asks (``held_values``)
        self.held: HeldDrafts | None = None
        # the last stage's rows through device memory, on its GPU (``open_link``)
        self.in_link: DeviceLink | None = None
        self._ticket = None

    def host_pool_bytes(self, sizes: PoolSizes) -> int:
        """Bytes the CPU pools ``allocate`` would take for these sizes."""
        return DraftPools(self.cfg, sizes, self.kv_cache_dtype, torch.device("meta")).nbytes()

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

    def execute(
        self, plan: StepPlan, inputs: StageResult, draft_fill: DraftFill | None = None
    ) -> StageResult:
        """``prepare`` then ``execute_prepared`` (the draft worker of this process)."""
        return self.execute_prepared(self.prepare(plan), inputs, draft_fill)

    @torch.inference_mode()  # it writes into buffers that capture_graphs made
    def prepare(self, plan: StepPlan, values: dict[str, list[int]] | None = None) -> PreparedDraft:
        """The part of a step that needs nothing from the last stage: its bookkeeping and, in an
        actor of its own, the held proposals written into the plan's pending drafts (values:
        those the stages got) and a verification's bucket staged (its metadata uploaded) while
        the last stage still verifies. A staging failure fails the pass when it runs."""
        self._apply(plan)
        prepared = PreparedDraft(plan)
        if self.held is None:
            return prepared
        fill_held_drafts(plan, values or {})
        self.held.drop(e.req_id for e in plan.batch)  # this step proposes anew
        if self.graphs is not None and plan.batch and all(e.sample for e in plan.batch):
            try:
                key = self.graphs.pick(verified_spans(plan))
                if key is not None:
                    prepared.staged = (key, self.graphs.stage_verified(plan, key))
            except Exception as exc:  # reported with the pass, like a failure in it
                prepared.error = exc
        return prepared

    @torch.inference_mode()
    def execute_prepared(self, prepared: PreparedDraft, inputs: StageResult,
                         draft_fill: DraftFill | None = None) -> StageResult:  # fmt: skip
        """The last stage's result without its tensors, with proposals in ``spec.proposals``
        (or ``spec.pending``, or held: ``spec.held``); draft_fill: the plan's drafts still on
        the device, if any."""
        plan = prepared.plan
        self._receive(inputs)
        verified = inputs.spec or DraftResult()  # the verification's; this pass's proposals next
        spec = dataclasses.replace(verified, proposals={}, stats={})
        out = dataclasses.replace(inputs, residual=None, topk=None, handoff=None, link=None,
                                  token_ids=None, verified=False, spec=spec)  # fmt: skip
        if inputs.failed is not None or not plan.batch:
            self._release(inputs)
            return out
        try:
            if prepared.error is not None:
                raise prepared.error
            self._run(plan, inputs, out, draft_fill, prepared.staged)
        except Exception:
            # the step's tokens stand (verification never trusts a draft); its proposals are
            # lost, and the draft layer's cache may miss the step's rows, which can lower these
            # requests' later acceptance
            log.exception("draft pass of step %d failed", plan.step_id)
            out.spec.proposals, out.spec.pending, out.spec.held = {}, None, []
            out.spec.stats = {"num_failed_draft_passes": 1}
            self.stats["num_failed_draft_passes"] += 1
        finally:  # every read of the linked rows is enqueued: the last stage may reuse them
            self._release(inputs)
        return out

    def open_link(self, depth: int, rows: int) -> dict:
        """A ring the last stage on this GPU writes the rows it hands over into
        (worker/graphs/device_link.py) -> what it maps the ring with (its ``map_link``)."""
        self.in_link = DeviceLink.for_model(self.cfg, self.cfg.num_hidden_layers, depth, rows,
                                            self.model.dtype, self.device)  # fmt: skip
        return self.in_link.export()

    def link_peer(self, handles: list) -> None:
        self.in_link.peer_fences(handles)

    def _verified_rows(self, plan: StepPlan, inputs: StageResult) -> Handoff | None:
        """A last stage's replayed verification as it came from another process (``verified``:
        its slotted rows and target tokens), as the Handoff this process's stage would leave."""
        if not inputs.verified:
            return None
        c, n = self.cfg, self.num_steps + 1
        stack = inputs.residual.view(-1, c.hc_mult, c.hidden_size)
        rows = slotted_rows([e.num_tokens for e in plan.batch], n)
        return Handoff(stack, inputs.topk, rows, inputs.token_ids)

    def _receive(self, inputs: StageResult) -> None:
        """The last stage's rows, as views of the link's slot when they came through one."""
        if self.in_link is not None:
            self._ticket = self.in_link.receive(inputs)

    def _release(self, inputs: StageResult) -> None:
        if self.in_link is not None:
            self.in_link.release(self._ticket)
            self._ticket = None

    # ------------------------------------------------------------------ bookkeeping
    def held_values(self) -> dict[str, list[int]]:
        """The proposals held for the next plans (req_id -> k drafts; waits for their passes)."""
        return self.held.values() if self.held is not None else {}

    def _apply(self, plan: StepPlan) -> None:
        for req_id in [*plan.finished_ids, *plan.preempted_ids]:
            self.tables.pop(req_id, None)
        if self.held is not None:
            self.held.drop([*plan.finished_ids, *plan.preempted_ids])
        for new in plan.new_requests:
            self._add(new)
        for diff in plan.diffs:
            self.tables[diff.req_id].apply(diff)

    def _add(self, new: NewRequest) -> None:
        self.tables[new.req_id] = ReqTable(new.state_slot, new.page_ids, new.window_page_ids)
        self.pools.reset_rings([new.state_slot])
        if new.state_copy_from >= 0:
            self.pools.copy_rings([self.pools.cached_row(new.state_copy_from)], [new.state_slot])

    def _snapshots(self, plan: StepPlan) -> None:
        if plan.snapshots:
            src = [self.tables[req_id].state_slot for req_id, _ in plan.snapshots]
            self.pools.copy_rings(src, [self.pools.cached_row(slot) for _, slot in plan.snapshots])

    # ------------------------------------------------------------------ the passes
    @torch.inference_mode()  # as every step runs: warm-up and eager buckets record no autograd
    def capture_graphs(self, max_batch: int, max_len: int, capture: bool = True) -> None:
        """Graphs of decode steps' passes (after allocate; worker/spec/draft_graphs.py);
        capture=False runs the same static buckets eagerly (any device; for tests)."""
        self.graphs = DraftGraphs(self, max_batch, max_len, capture)
        self.graphs.capture_all()

    def _run(self, plan: StepPlan, inputs: StageResult, out: StageResult,
             draft_fill: DraftFill | None, staged=None) -> None:  # fmt: skip
        handoff = inputs.handoff or self._verified_rows(plan, inputs)
        if handoff is not None:  # a replayed verification, still on the device
            spans = verified_spans(plan)
            if staged is not None:  # staged by ``prepare``
                drafts = self.graphs.replay_verified(plan, handoff, *staged)
            else:
                key = self.graphs.pick(spans) if self.graphs is not None else None
                drafts = None if key is None else self.graphs.run_verified(plan, handoff, key,
                                                                           draft_fill)  # fmt: skip
            if drafts is not None:
                self._snapshots(plan)
                self._record(spans, drafts, out, graphed=True)
                return
        if inputs.verified:  # the last stage settles it beside this pass: no accepted rows here
            log.warning("step %d: no draft bucket for a handed-off verification; no proposals",
                        plan.step_id)  # fmt: skip
            return
        if draft_fill is not None:  # what follows reads the plan's drafts on the host
            draft_fill.resolve()
        if inputs.handoff is not None:
            settle_handoff(plan, inputs)
        elif handoff is not None:  # settled on the last stage: the accepted positions' rows
            hand_over(plan, inputs, handoff.stack, handoff.topk, handoff.rows)
        spans = draft_spans(plan, inputs)
        key = self.graphs.pick(spans) if self.graphs is not None else None
        if key is not None:
            drafts = self.graphs.run(spans, inputs.residual, inputs.topk, key)
            self._snapshots(plan)
            self._record(spans, drafts, out, graphed=True)
            return
        x = meta = None
        if spans:
            x, meta = self._exact(plan.step_id, spans, inputs)
        self._snapshots(plan)
        sampled = [s for s in spans if s.sampled]
        if not sampled:
            return
        rows = meta.sample_idx
        topk = inputs.topk.index_select(0, rows) if self.reuses_topk else None
        metas = self._chain_metas(sampled, meta, rows)
        self._record(sampled, self.propose(x.index_select(0, rows), metas, topk), out)

    def _record(self, spans: list[DraftSpan], drafts: torch.Tensor, out: StageResult,
                graphed: bool = False) -> None:  # fmt: skip
        """Files drafts [R, k] (device) by request, and the step's counters."""
        req_ids = [s.req_id for s in spans]
        if self.held is not None:  # read back when the next plan asks: the driver commits now
            self.held.hold(PendingDrafts(req_ids, drafts))
            out.spec.held = req_ids
        elif self.defer_drafts:
            out.spec.pending = PendingDrafts(req_ids, drafts)
        else:
            out.spec.proposals = dict(zip(req_ids, drafts.cpu().tolist(), strict=True))
        chain_rows = len(spans) * (self.num_steps - 1)
        step_stats = {
            "num_draft_passes": 1,
            "num_draft_graph_passes": int(graphed),
            "num_drafted_tokens": len(spans) * self.num_steps,
            "num_topk_reuse_rows": chain_rows if self.reuses_topk else 0,
        }
        for name, value in step_stats.items():
            self.stats[name] += value
        out.spec.stats = step_stats

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
        return self.exact_pass(h, meta, inputs.topk), meta

    def exact_pass(self, h: torch.Tensor, meta, topk) -> torch.Tensor:
        """The target's pre-head rows h [T, hc, hidden] and the next tokens (meta.token_ids)
        through the block -> its output stack [T, hc, hidden] (window KV, C4 entries written)."""
        x = self.block.mix(h, self.model.embed(meta.token_ids))
        return paged_block(self.block, x, meta.derive(), self.pools, topk)[0]

    def propose(self, x: torch.Tensor, chain_metas, topk) -> torch.Tensor:
        """x [R, hc, hidden]: the block's output at each request's last exact position -> drafts
        [R, k] int64 (top-1 at every step); chain step j reads chain_metas[j - 1] and, DSA-style,
        the reused top-k [R, k'] of the last exact position."""
        head = self.model.head.weight
        tokens = self.block.head_logits(x, head).argmax(-1)  # [R]
        drafts = [tokens]
        for meta in chain_metas:
            x = self.block.mix(x, self.model.embed(tokens))
            x, _ = paged_block(self.block, x, meta, self.pools, topk)
            tokens = self.block.head_logits(x, head).argmax(-1)
            drafts.append(tokens)
        return torch.stack(drafts, dim=1)

    def _chain_metas(self, spans: list[DraftSpan], meta, rows: torch.Tensor) -> list:
        """The k - 1 chain steps' index tensors for the spans whose last exact rows of ``meta``
        are ``rows``, built on the device."""
        last = max(s.start_pos + len(s.next_tokens) for s in spans) + self.num_steps - 2
        rope_len = self.ropes.ensure(last + 1)
        return chain_metas(meta, rows, meta.positions.index_select(0, rows), self.pools,
                           self.num_steps, self.ropes, rope_len)  # fmt: skip


@dataclasses.dataclass
class PreparedDraft:
    """A step with the draft worker's bookkeeping applied (``DraftWorker.prepare``): a
    verification's staged bucket ((key, staged) for ``replay_verified``), a staging failure."""

    plan: StepPlan
    staged: tuple | None = None
    error: Exception | None = None
