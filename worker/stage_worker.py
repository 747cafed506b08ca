"""StageWorker: one pipeline stage as a plain class (the stage actor is a thin shell over it).

It holds the weights of layers [start, end) (plus the embedding on the first stage and the head
on the last) and this stage's pools. ``execute(plan, inputs)`` applies the plan's bookkeeping in
order (drop finished and preempted requests, create new ones, apply diffs), runs its layers on
the step's tokens and, on the last stage, samples. Between stages travel the residual stack
[T, hc * hidden] and the running top-k [T, k] of logical C4 positions.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from dsv4ray.cache.host_layout import HostLayout
from dsv4ray.cache.pool_sizes import PoolSizes
from dsv4ray.cache.pools import StagePools
from dsv4ray.config import ModelConfig
from dsv4ray.engine.handoff import STATE_TRANSFERRED, to_dict
from dsv4ray.engine.plan import FLUSH_STEP, NO_RESULT, NewRequest, StageResult, StepPlan
from dsv4ray.kernels import dispatch
from dsv4ray.kernels.jit_cache import compiled_variants
from dsv4ray.model.loader import load_stage
from dsv4ray.worker import ops
from dsv4ray.worker.batch import BatchMeta, HostStage, build_batch
from dsv4ray.worker.cpu_pools import check_host_memory, host_pool_bytes
from dsv4ray.worker.graphs.device_link import DeviceLink
from dsv4ray.worker.graphs.overlap import SampledTokens, fill_tokens, record_samples, take_samples
from dsv4ray.worker.graphs.stage_graphs import Staged, StageGraphs
from dsv4ray.worker.host.hisparse_io import scratch_step
from dsv4ray.worker.host.host_io import HostIO, LayerEvents
from dsv4ray.worker.paged import paged_block
from dsv4ray.worker.pd.kv_export import KVPort, run_handoffs
from dsv4ray.worker.req_table import ReqTable
from dsv4ray.worker.rope_tables import RopeTables
from dsv4ray.worker.spec.draft_fill import DraftFill, fill_held_drafts
from dsv4ray.worker.spec.verify import Handoff, PendingVerify, hand_over
from dsv4ray.worker.stage_sampling import StageSampling
from dsv4ray.worker.stage_spec import StageSpec

log = logging.getLogger("dsv4ray.worker")


def _with_pad_slot(sizes: PoolSizes) -> PoolSizes:
    """One more state slot than the scheduler uses: the compressor ring that the pad rows of
    captured steps write."""
    return dataclasses.replace(sizes, num_state_slots=sizes.num_state_slots + 1)


class StageWorker:
    """Two-phase start: the constructor loads the weights; ``allocate`` creates the pools once
    the engine has sized them (the same page ids name pages in every stage, so every stage gets
    the pipeline's minimum capacity)."""

    def __init__(self, spec: StageSpec, cfg: ModelConfig | None = None) -> None:
        """cfg: the checkpoint's config when the caller has it (else read from spec.model)."""
        start, end, model_path = spec.start, spec.end, spec.model
        self.cfg = cfg or ModelConfig.from_hf(model_path)
        self.kv_cache_dtype = spec.kv_cache_dtype
        self.device = torch.device(spec.device)
        dispatch.for_device(self.device)
        self.weight_format = ops.resolve_weight_format(spec.weight_format, self.cfg, self.device)
        self.model_path = model_path
        self.model = load_stage(model_path, start, end, spec.dtype or self.cfg.torch_dtype,
                                self.device, self.cfg, self.weight_format)  # fmt: skip
        blocks = [self.model.block(i) for i in range(start, end)]
        fp8_prefill = ops.check_fp8_prefill(spec.fp8_prefill, self.weight_format, self.cfg,
                                            self.device, self.model.dtype)  # fmt: skip
        ops.prepare(blocks, self.model.dtype, fp8_prefill)
        ops.bind_few_row_kernels(self.model)
        self.pools: StagePools | None = None
        self.host_io = None
        self.kv_port: KVPort | None = None  # prefill/decode handoffs, once open_transfer ran
        self.tables: dict[str, ReqTable] = {}
        specs = [self.cfg.layers[i].rope for i in range(start, end)]
        self.ropes = RopeTables(specs, self.device)
        self.stage = HostStage()
        # every stage captures its own layer range, on CUDA
        self.use_graphs = spec.cuda_graphs and self.device.type == "cuda"
        self.graphs: StageGraphs | None = None
        # the latest sampled id of every state slot, on the first stage (lookahead entries)
        self.sampled: SampledTokens | None = None
        self.sampler: StageSampling | None = None  # the last stage's sampling
        self.num_eager_steps = 0  # steps with a batch that ran without a graph
        self.held: StageResult | None = None  # a lagged step's result, sampling still deferred
        # rows from the stage before / to the stage after through device memory (one GPU)
        self.in_link: DeviceLink | None = None
        self.out_link: DeviceLink | None = None
        self.hands_off = False  # replayed verifications' rows go to a draft actor as they are
        self.unsettled: dict[int, object] = {}  # step id -> its handed-off verification
        self.executions = 0  # steps run (one per graph execution on a stage actor)

    def gpu_uuid(self) -> str | None:
        """The physical GPU this stage runs on (stages that share one share its memory and
        cannot form an NCCL pair), None on CPU."""
        if self.device.type != "cuda":
            return None
        return str(torch.cuda.get_device_properties(self.device).uuid)

    def available_bytes(self, memory_fraction: float) -> float | None:
        """Free device memory for pools after the weights (None on CPU: size by tokens)."""
        if self.device.type != "cuda":
            return None
        torch.cuda.empty_cache()  # blocks this process cached but no longer uses count as free
        free, _ = torch.cuda.mem_get_info(self.device)
        return free * memory_fraction

    def host_pool_bytes(self, sizes: PoolSizes) -> int:
        """Bytes the CPU pools `allocate` would take for these sizes."""
        return host_pool_bytes(self.cfg, self.model.start, self.model.end,
                               _with_pad_slot(sizes), self.kv_cache_dtype)  # fmt: skip

    def allocate(self, sizes: PoolSizes) -> int:
        sizes = _with_pad_slot(sizes)
        if self.device.type == "cpu":  # sized by tokens, not by memory: check they fit
            check_host_memory(self.cfg, self.model.start, self.model.end, sizes,
                              self.kv_cache_dtype)  # fmt: skip
        self.pools = StagePools(
            self.cfg, self.model.start, self.model.end, sizes, self.kv_cache_dtype, self.device
        )
        if self.is_first:
            self.sampled = SampledTokens.allocate(sizes.num_state_slots, self.device)
        if self.is_last:
            slots = sizes.num_state_slots
            self.sampler = StageSampling(self.model, self.model_path, slots, self.device,
                                         self.sampled)  # fmt: skip
        if self.pools.indexer:
            dispatch.compile_indexer_variants(
                self.cfg.index_n_heads, self.pools.layouts["indexer"], self.device
            )
        log.info(
            "stage [%d, %d): pools %.1f MiB in %s pages",
            self.model.start,
            self.model.end,
            self.pools.nbytes() / 2**20,
            self.kv_cache_dtype,
        )
        if self.pools.hisparse is not None:
            log.info(
                "stage [%d, %d): HiSparse C4 history %.1f MiB in host memory, %d hot rows per "
                "request and C4 layer",
                self.model.start,
                self.model.end,
                self.pools.hisparse.host_bytes() / 2**20,
                self.pools.hisparse.hot_rows,
            )
        return self.pools.nbytes()

    @torch.inference_mode()  # as every step runs: warm-up and eager buckets record no autograd
    def capture_graphs(self, max_batch: int, max_len: int, draft_steps: int = 0,
                       capture: bool = True) -> None:  # fmt: skip
        """Captures the decode graphs (after allocate; a no-op unless graphs are on), or with a
        draft worker (draft_steps = k) the verification graphs of k + 1 tokens per request.
        capture=False: the same static buckets run eagerly (any device; for tests)."""
        if capture and not self.use_graphs:
            return
        if draft_steps and self.pools.hisparse is not None:
            log.info("verification steps run eagerly with HiSparse (their C4 reads are staged)")
            return
        self.graphs = StageGraphs(self, max_batch, max_len, draft_steps, capture)
        self.graphs.capture_all()

    @property
    def is_first(self) -> bool:
        return self.model.is_first

    @property
    def is_last(self) -> bool:
        return self.model.is_last

    def attach_host(self, layout_args: dict, path: str) -> int:
        """Maps this stage's host-tier region (same byte layout on every process)."""
        layout = HostLayout(
            self.cfg, self.model.start, self.model.end, self.kv_cache_dtype, **layout_args
        )
        self.host_io = HostIO(self.pools, layout, path)
        log.info(
            "stage [%d, %d): host region %s (%.1f MiB)",
            self.model.start,
            self.model.end,
            path,
            layout.nbytes / 2**20,
        )
        return layout.nbytes

    def detach_host(self) -> None:
        self.host_io = None

    def stats(self) -> dict:
        """This stage's counters: steps replayed from CUDA graphs (by "batch x context"
        bucket) and run eagerly, Triton kernel variants compiled in its process; HiSparse hits,
        misses and bytes when it is on."""
        store = self.pools.hisparse if self.pools is not None else None
        out = store.stats() if store is not None else {}
        replays = self.graphs.replays if self.graphs is not None else {}
        out["num_graph_steps"] = sum(replays.values())
        out["graph_steps"] = {f"{b}x{ctx}": n for (b, ctx), n in sorted(replays.items())}
        out["num_eager_steps"] = self.num_eager_steps
        out["num_kernel_variants"] = sum(compiled_variants().values())  # of this process
        return out

    def open_transfer(self, transport) -> dict:
        """Registers the pools with a transfer engine (worker/pd/transfer.py) for prefill/decode
        handoffs; returns the stage's endpoint (``engine.handoff.StageEndpoint`` as a dict)."""
        self.kv_port = KVPort(self.pools, transport)
        return to_dict(self.kv_port.endpoint)

    def step(self, plan: StepPlan, inputs: StageResult | None = None,
             drafts: dict[str, list[int]] | None = None) -> StageResult:  # fmt: skip
        """One step as a pipeline's transport runs it: ``prepare`` then ``step_prepared``."""
        return self.step_prepared(self.prepare(plan, drafts), inputs)

    @torch.inference_mode()  # it writes into buffers that capture_graphs made
    def prepare(self, plan: StepPlan, drafts: dict[str, list[int]] | None = None) -> Prepared:
        """The part of a step that needs no rows from the stage before: its host-tier copies
        and bookkeeping applied, a replayed step's metadata uploaded into its bucket (stream-
        ordered after the steps launched before). A stage actor after the first runs it while
        the stage before computes. A staging failure fails the step when it computes.
        drafts: the proposals a draft actor held (its ``proposals``; None without one), written
        into the plan's pending drafts first (worker/spec/draft_fill.py)."""
        resolved = fill_held_drafts(plan, drafts)
        events = self._host_ops(plan)
        self._apply(plan)
        prepared = Prepared(plan, events, resolved=resolved)
        if plan.batch and self.graphs is not None:
            try:
                key = self.graphs.pick(plan)
                prepared.staged = self.graphs.stage(plan, key) if key is not None else None
            except Exception as exc:  # reported with the step, like a compute failure
                prepared.error = exc
        return prepared

    def step_prepared(self, prepared: Prepared, inputs: StageResult | None = None) -> StageResult:
        """A prepared step, its rows received from and sent to stages on this GPU through
        device links (``open_link``). With plan.lag the last stage launches a step that has a
        batch, then settles and returns the one it held before (NO_RESULT when none), so the
        device runs this step while the driver commits the previous one and schedules the next.
        A plan without a batch computes nothing and answers for itself; a flush (FLUSH_STEP)
        returns the held step."""
        self.executions += 1
        if self.sampled is not None:  # its lookahead ids: those of every execution before
            self.sampled.awaited = self.executions - 1
        ticket = self.in_link.receive(inputs) if self.in_link and inputs is not None else None
        try:
            out = self._step_prepared(prepared, inputs)
        finally:  # the slot is free once this stream read it, whatever the step did
            if self.in_link is not None:
                self.in_link.release(ticket)
        self._post_count()
        handed = out.handoff is not None  # a verification replayed for the draft actor
        if handed:
            self._hand_off(prepared.plan, out)
        if self.out_link is not None:
            self.out_link.send(out)
        return out

    def _post_count(self) -> None:
        """The last stage, sharing its GPU with the first: this execution's sampled ids are
        written and their event recorded (or it had none), so the first stage may issue its
        wait for them (worker/graphs/overlap.py)."""
        peer = self.sampler.peer_tokens if self.sampler is not None else None
        if peer is not None and peer.posted is not None:
            peer.posted.write(self.executions)

    def settle(self, drafted: StageResult) -> StageResult:
        """The last stage beside a draft actor, after the draft actor launched from this
        step's result (drafted: its result, this stage's without tensors, with the proposals):
        a handed-off verification is read back here, then the result goes to the driver."""
        drafted.pending = self.unsettled.pop(drafted.step_id, None)
        return self.finish(drafted)

    def hand_off_verifications(self) -> None:
        """The last stage, beside a draft actor that replays graphs: a replayed verification's
        rows and target tokens go to it as they are (``_hand_off``), and it finds the accepted
        drafts on the device, as the draft worker of this process would."""
        self.hands_off = True

    def _hand_off(self, plan: StepPlan, result: StageResult) -> None:
        """Puts a replayed verification's slotted rows [b n, hc * hidden] (and top-k) and the
        target's token per batch token [T] into the result (``verified``); the step is settled
        (``settle``) after they left."""
        h, result.handoff = result.handoff, None
        self.unsettled[result.step_id], result.pending = result.pending, None  # stays here
        rows = len(plan.batch) * self.graphs.n
        result.residual = h.stack[:rows].flatten(-2)
        result.topk = h.topk[:rows] if h.topk is not None else None
        result.token_ids, result.verified = h.token_ids, True

    def _step_prepared(self, prepared: Prepared, inputs: StageResult | None) -> StageResult:
        plan = prepared.plan
        flush = plan.step_id == FLUSH_STEP
        if not (plan.lag and self.is_last) or not (plan.batch or flush):
            return self.run(prepared, inputs, handoff=self.hands_off)
        result = self.run(prepared, inputs, defer_sampling=True)
        self._post_count()  # launched: the first stage may run the next execution
        held, self.held = self.held, (None if flush else result)
        out = self.finish(held) if held is not None else StageResult(NO_RESULT)
        # this step's sampled ids travel on to the first stage now (``take``)
        out.samples, result.samples = result.samples, None
        return out

    def execute(self, plan: StepPlan, inputs: StageResult | None = None, *args, **options):
        """``prepare`` then ``run`` (a stage in the engine's process; args, options: ``run``'s)
        -> StageResult."""
        return self.run(self.prepare(plan), inputs, *args, **options)

    @torch.inference_mode()  # no autograd at all: each op costs less host time than no_grad's
    def run(
        self,
        prepared: Prepared,
        inputs: StageResult | None = None,
        defer_sampling: bool = False,
        handoff: bool = False,
        draft_fill: DraftFill | None = None,
    ) -> StageResult:
        """Computes a prepared step. A compute failure (here or on an earlier stage) is returned
        in ``failed`` with the bookkeeping applied, so every stage stays in step with the
        scheduler and only the step's requests are lost.
        defer_sampling: return without waiting for the sampled ids (``finish`` reads them).
        handoff: a replayed verification step leaves its rows and tokens on the device for the
        draft worker of this process (``result.handoff``) and is settled by ``finish``.
        draft_fill: the plan's drafts still on the device (worker/spec/draft_fill.py)."""
        plan = prepared.plan
        result = StageResult(plan.step_id)
        if inputs is not None and inputs.failed is not None:
            result.failed = inputs.failed
            return result
        try:
            self._compute(prepared, inputs, result, handoff, draft_fill)
        except Exception as exc:  # an engine bug or a bad input must not take the stage down
            self._fail(plan.step_id, exc, result)
        if plan.kv is not None:  # prefill/decode handoffs, with the step's samples
            run_handoffs(self.kv_port, plan, self.tables, inputs, self.finish(result))
        if self.is_last and prepared.resolved:  # the engine keeps the drafts it verified
            result.spec_section().resolved = prepared.resolved
        deferred = defer_sampling or result.handoff is not None
        return result if deferred else self.finish(result)

    def finish(self, result: StageResult) -> StageResult:
        """Reads back the sampled ids a deferred step left on the device into ``sampled``,
        ``logprobs`` and ``errors`` (a failure there fails the step)."""
        pending, result.pending = result.pending, None
        if pending is not None:
            try:
                if isinstance(pending, PendingVerify):
                    pending.settle(result)
                else:
                    record_samples(result, *pending)
            except Exception as exc:
                self._fail(result.step_id, exc, result)
        return result

    def _fail(self, step_id: int, exc: Exception, result: StageResult) -> None:
        log.exception("step %d failed on stage [%d, %d)", step_id, *self._range)
        result.failed = f"{type(exc).__name__} on stage {self._range}: {exc}"[:500]

    @property
    def _range(self) -> tuple[int, int]:
        return self.model.start, self.model.end

    def _compute(self, prepared: Prepared, inputs, result: StageResult, handoff: bool,
                 draft_fill: DraftFill | None):  # fmt: skip
        plan = prepared.plan
        if not plan.batch:
            self._snapshots(plan)
            return
        if prepared.error is not None:
            raise prepared.error
        if prepared.staged is not None:
            self._replay(plan, inputs, prepared.staged, result, handoff, draft_fill)
            return
        self.num_eager_steps += 1
        meta = build_batch(plan, self.tables, self.device, self.ropes, self.stage)
        meta.hisparse_step = scratch_step(
            plan, self.pools, self.tables, self.cfg.index_topk, self.device, self.stage
        )
        self.fill_tokens(plan, meta.token_ids, inputs)
        if draft_fill is not None:
            draft_fill.write_tokens(meta.token_ids)
        x, topk = self.run_layers(meta, inputs, prepared.events)
        self._snapshots(plan)
        if self.is_last:
            if draft_fill is not None:  # verifying on the host reads the drafts
                draft_fill.resolve()
            self.sampler.sample(plan, meta, x, result, self.tables)
            if plan.draft:
                hand_over(plan, self.finish(result), x, topk)
        else:
            result.residual, result.topk = x.flatten(-2), topk
            result.token_ids = meta.token_ids if plan.lookahead else None

    def _replay(self, plan: StepPlan, inputs, staged: Staged, result: StageResult, handoff: bool,
                draft_fill: DraftFill | None) -> None:  # fmt: skip
        """A step replayed from the stage's graphs: an earlier stage hands its rows on, the last
        samples from every row's logits (a decode bucket) or verifies drafts."""
        out, meta, rows = self.graphs.run(plan, inputs, staged, draft_fill)
        self._snapshots(plan)
        if not self.is_last:
            self.graphs.hand_on(out, rows, result)
            result.token_ids = meta.token_ids[: len(rows)] if plan.lookahead else None
        elif self.graphs.n == 1:
            self.sampler.sample(plan, meta, None, result, self.tables, out[meta.sample_idx])
        else:
            self._verify_graph(plan, out, rows, result, handoff, draft_fill)

    def _verify_graph(self, plan: StepPlan, out, rows, result: StageResult, handoff: bool,
                      draft_fill: DraftFill | None) -> None:  # fmt: skip
        """A replayed verification step: its logits, stack and top-k are in slotted rows."""
        logits, x, topk = out
        launched = self.sampler.verify(plan, logits, rows, draft_fill)
        if handoff:  # every batch token is scored: its target token is token_ids[its index]
            result.pending = launched
            result.handoff = Handoff(x, topk, rows, launched.token_ids)
            return
        if draft_fill is not None:
            draft_fill.resolve()
        launched.settle(result)
        hand_over(plan, result, x, topk, rows)

    def _host_ops(self, plan: StepPlan) -> LayerEvents:
        if not plan.has_host_ops:
            return LayerEvents()
        if self.host_io is None:
            raise RuntimeError(f"step {plan.step_id} has host tier copies but no region is mapped")
        return self.host_io.run(plan)

    def run_layers(self, meta: BatchMeta, inputs: StageResult | None, events: LayerEvents):
        """The stage's layers over a step -> (stack [T, hc, hidden], running top-k or None)."""
        meta = meta.derive()  # a captured step derives its slot lists inside its graph
        if self.is_first:
            x, topk = self.model.embed_tokens(meta.token_ids), None
        else:
            x = inputs.residual.view(meta.num_tokens, self.cfg.hc_mult, self.cfg.hidden_size)
            topk = inputs.topk
        for layer_id in range(self.model.start, self.model.end):
            events.wait(layer_id)
            x, topk = paged_block(self.model.block(layer_id), x, meta, self.pools, topk)
        return x, topk

    def export_tokens(self):
        """The first stage's table of sampled ids, for a last stage on the same GPU."""
        return self.sampled.export()

    def map_tokens(self, exported) -> bytes:
        """The last stage writes its sampled ids into the first stage's table (same GPU);
        returns the handle of the event it records after each write."""
        self.sampler.peer_tokens, handle = SampledTokens.open_peer(exported)
        return handle

    def wait_for_tokens(self, event_handle: bytes) -> None:
        self.sampled.wait_for(event_handle)

    def open_link(self, depth: int, rows: int) -> dict:
        """A ring of depth slots of rows tokens that the stage before (on this GPU) writes its
        rows into (worker/graphs/device_link.py) -> what it maps the ring with (``map_link``)."""
        self.in_link = DeviceLink.for_model(self.cfg, self.model.start, depth, rows,
                                            self.model.dtype, self.device)  # fmt: skip
        log.info("stage [%d, %d): device link of %d x %d rows (%.1f MiB)", *self._range, depth,
                 rows, self.in_link.nbytes() / 2**20)  # fmt: skip
        return self.in_link.export()

    def map_link(self, exported: dict) -> list:
        """The next stage's ring (``open_link`` there): this stage's rows go through it ->
        the handles of the events that say a slot was written (``link_peer`` there)."""
        self.out_link = DeviceLink.open(exported)
        return self.out_link.fences.export()

    def link_peer(self, handles: list) -> None:
        self.in_link.peer_fences(handles)

    def take(self, plan: StepPlan, result: StageResult) -> StageResult:
        """The first stage, after the last stage of a lagged plan (worker/graphs/overlap.py)."""
        return take_samples(self.sampled, plan, result, self.tables)

    def fill_tokens(self, plan: StepPlan, token_ids: torch.Tensor, inputs) -> None:
        """Lookahead entries' ids on the first stage; a later stage takes the filled ids."""
        if plan.lookahead:
            fill_tokens(self.sampled, plan, token_ids, inputs, self.tables)

    def _apply(self, plan: StepPlan) -> None:
        for req_id in [*plan.finished_ids, *plan.preempted_ids]:
            self.tables.pop(req_id, None)
            if self.sampler is not None:
                self.sampler.drop(req_id)
        for new in plan.new_requests:
            self._add(new)
        resets = []  # (state slot, positions) whose C128 ring rows rejected drafts wrote
        for diff in plan.diffs:
            table = self.tables[diff.req_id]
            if diff.rejected:
                resets.append((table.state_slot, range(*diff.rejected)))
            table.apply(diff)
        if resets:
            self.pools.reset_c128_rows(resets)

    def _add(self, new: NewRequest) -> None:
        self.tables[new.req_id] = ReqTable(new.state_slot, new.page_ids, new.window_page_ids)
        if new.state_copy_from == STATE_TRANSFERRED:  # a handoff wrote the rings, not the
            self.pools.reset_hot_rows([new.state_slot])  # hot rows the slot's last user left
        else:
            self.pools.reset_rings([new.state_slot])  # C128 ring: empty at a page boundary
        if new.state_copy_from >= 0:
            self.pools.copy_c4_rings([self.pools.cached_row(new.state_copy_from)], [new.state_slot])
        if self.sampler is not None:
            self.sampler.add(new)

    def _snapshots(self, plan: StepPlan) -> None:
        if plan.snapshots:
            src = [self.tables[req_id].state_slot for req_id, _ in plan.snapshots]
            dst = [self.pools.cached_row(slot) for _, slot in plan.snapshots]
            self.pools.copy_c4_rings(src, dst)


@dataclasses.dataclass
class Prepared:
    """A step with its bookkeeping applied (``StageWorker.prepare``): its host-tier copies'
    events, its staged bucket when it replays a graph, a staging failure to report, the
    proposals a draft actor held for it."""

    plan: StepPlan
    events: LayerEvents
    staged: Staged | None = None
    error: Exception | None = None
    resolved: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # held drafts
