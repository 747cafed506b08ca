"""Continuous-batching scheduler (pure Python on ints; no torch, no Ray).

One request model: num_computed_tokens catches up with num_tokens (prompt + generated). A step
gives requests tokens within a per-step budget: running decodes first (1 token), then running
partial prefills, then waiting requests FCFS. Prefill chunks end on page boundaries (256 tokens)
unless they reach the last token, so every chunk starts page-aligned (also after a prefix hit) and
snapshots land on boundaries. A request samples when its step reaches its last token.

Ids (full pages, window pages, state slots, cached-state slots, radix index) live in
``KVCacheManager``. Running out never fails a request: admission waits; a running request that
cannot grow evicts cached prefixes, then preempts the most recently admitted running request by
recompute (it frees everything, keeps its generated tokens, and waits at the front of the queue).

Prefix reuse: at admission, the radix match (at most (len - 1) // 256 pages, ending at a snapshot)
gives shared pages, the window page of the prefix's last 128 tokens and a cached-state slot to
copy into the rings. A step ending on a page boundary takes a snapshot (the request keeps the
newest, inserted on release); at the last boundary an identical prompt can match and where the
request leaves the cached path (a shared system prompt), chunks end and the snapshot is shared at
once (``KVCacheManager.share_boundaries``).

Speculative decoding (engine/spec.py): a running decode that holds draft tokens schedules them
behind its last token; ``commit`` appends the verified ones and rolls the rest back.

Several plans may be in flight (pipeline micro-batches): a request in flight is not scheduled
again until ``commit`` of its step, except for one lookahead token with overlap scheduling
(engine/lookahead.py); with ``micro_batches`` > 1 a plan takes at most its share of the running
decodes, so that each stage of a pipeline of stage actors computes a different micro-batch.
Stages apply plans in order, so ids freed while a step is in flight are reused only by later
plans. ``schedule`` returns None when nothing can run now.
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dsv4ray.engine import lookahead, spec, sync
from dsv4ray.engine.config import SchedulerConfig
from dsv4ray.engine.kv_manager import KVCacheManager
from dsv4ray.engine.outcome import StepOutcome
from dsv4ray.engine.outputs import FINISH_REASONS
from dsv4ray.engine.plan import LOOKAHEAD_TOKEN, PENDING_DRAFT, BatchEntry, DraftPlan, StepPlan
from dsv4ray.engine.request import FinishedRequest, Request, Status
from dsv4ray.engine.sampling import SamplingParams

__all__ = ["FinishedRequest", "Scheduler", "SchedulerConfig", "StepOutcome"]


@dataclass
class _Step:
    """A plan under construction."""

    budget: int
    # tokens the decodes leave to prefills: a step whose prompts could not start the step
    # before (the decodes took all but less than a page) keeps a page for them
    reserve: int = 0
    prefilled: bool = False  # the step runs a prefill chunk
    held: list[Request] = field(default_factory=list)  # decodes the reserve kept out
    entries: list[tuple[Request, int, int]] = field(default_factory=list)  # (req, start, n)
    admitted: list[Request] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    lookahead: list[Request] = field(default_factory=list)  # entries (req, num_tokens, 1)

    def add(self, req: Request, start: int, num_tokens: int) -> None:
        self.entries.append((req, start, num_tokens))
        self.budget -= num_tokens
        self.prefilled = self.prefilled or req.num_tokens - start > 1

    @property
    def decode_budget(self) -> int:
        return self.budget - self.reserve

    def drop(self, req: Request) -> None:
        for i, (entry_req, _, num_tokens) in enumerate(self.entries):
            if entry_req is req:
                del self.entries[i]
                self.budget += num_tokens
                return


class Scheduler:
    """Admits, batches, preempts and finishes requests; emits StepPlans."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = KVCacheManager(config)
        self._requests: dict[str, Request] = {}
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # admission order
        self._in_flight: dict[int, list[tuple[Request, int, int]]] = {}
        self._finished_ids: list[str] = []  # known to stages, not yet reported in a plan
        self._step_ids = itertools.count()
        self._admit_seq = itertools.count()
        self._rng = random.Random()
        self.lookahead_steps = 0  # lookahead entries scheduled (engine/lookahead.py)
        # the last step left a prompt waiting for a chunk: the next one reserves it a page
        self._prefill_starved = False

    # ------------------------------------------------------------------ public API
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        """Requests to run, or host tier copies still to hand to the stages."""
        return bool(self._requests) or self.kv.has_pending_host_ops()

    def get_request(self, req_id: str) -> Request:
        return self._requests[req_id]

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        use_prefix_cache: bool = True,
    ) -> None:
        """Queue a request; ValueError for a duplicate id, an empty or too long prompt.
        use_prefix_cache=False computes every position (scoring needs each position's logits)."""
        if req_id in self._requests:
            raise ValueError(f"request id {req_id!r} is already in use")
        if len(prompt_token_ids) == 0:
            raise ValueError(f"request {req_id!r}: the prompt is empty")
        if len(prompt_token_ids) >= self.config.max_model_len:
            raise ValueError(
                f"request {req_id!r}: prompt has {len(prompt_token_ids)} tokens, max_model_len is "
                f"{self.config.max_model_len} (the prompt must leave room for one new token)"
            )
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in prompt_token_ids):
            raise ValueError(f"request {req_id!r}: token ids must be ints >= 0")
        sampling = sampling or SamplingParams()
        seed = sampling.seed if sampling.seed is not None else self._rng.getrandbits(63)
        req = Request(req_id, list(prompt_token_ids), sampling, seed)
        req.use_prefix_cache = use_prefix_cache
        self._requests[req_id] = req
        self._waiting.append(req)

    def abort(self, req_id: str) -> FinishedRequest | None:
        """End a request now (finish_reason "abort"); None if the id is unknown or finished."""
        req = self._requests.get(req_id)
        return None if req is None else self._terminate(req, "abort")

    def finish(self, req_id: str, reason: str = "stop") -> FinishedRequest | None:
        """End a request for a reason found outside the scheduler (a stop string)."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish reason must be one of {FINISH_REASONS}, got {reason!r}")
        req = self._requests.get(req_id)
        return None if req is None else self._terminate(req, reason)

    def schedule(self) -> StepPlan | None:
        """The next step, or None when nothing can run and there is nothing to report."""
        page = self.config.page_size if self._prefill_starved else 0
        step = _Step(budget=self.config.max_num_batched_tokens, reserve=page)
        self._schedule_running(step)
        if not step.preempted_ids:  # a preemption means the pools are short: admit nobody
            self._admit_waiting(step)
        if step.held and not step.prefilled:
            self._schedule_held(step)
        self._prefill_starved = not step.prefilled and self._prefill_waits()
        idle = not (step.entries or step.preempted_ids or self._finished_ids)
        if idle and not self.kv.has_pending_host_ops():
            return None
        return self._build_plan(step)

    def commit(
        self,
        plan: StepPlan,
        sampled: Mapping[str, int],
        accepted: Mapping[str, Sequence[int]] | None = None,
        drafts: Mapping[str, Sequence[int]] | None = None,
    ) -> StepOutcome:
        """Apply a step that ran: advance computed tokens, append sampled tokens (sampled maps
        req_id -> token for the plan's sampling entries, accepted the drafts verified before it),
        free old window pages, finish requests that met a stop condition, keep new drafts."""
        if plan.step_id not in self._in_flight:
            raise ValueError(f"step {plan.step_id} is not in flight")
        # Requests preempted, aborted or finished while the step ran are skipped.
        entries = [e for e in self._in_flight[plan.step_id] if e[0].in_flight_step == plan.step_id]
        missing = [
            req.req_id
            for req, start, n in entries
            if start + n >= req.num_tokens and req.req_id not in sampled
        ]
        if missing:
            raise ValueError(f"step {plan.step_id} sampled no token for {missing}")
        # steps commit in the order they were scheduled: an earlier one still here was
        # abandoned (its caller was interrupted while it ran and aborted its requests)
        for step_id in [s for s in self._in_flight if s <= plan.step_id]:
            del self._in_flight[step_id]
        self.kv.confirm_host_ops(plan.step_id)
        outcome = StepOutcome(frozenset(req.req_id for req, _, _ in entries), {}, [])
        accepted, drafts = accepted or {}, drafts or {}
        for req, start, num_tokens in entries:
            lookahead.promote(req)
            if start + num_tokens < req.num_tokens:  # a prefill chunk: nothing sampled
                req.num_computed_tokens = start + num_tokens
                self.kv.promote_snapshot(req)
                self.kv.free_old_windows(req)
                continue
            got, token = accepted.get(req.req_id, ()), sampled[req.req_id]
            self._append(req, start + num_tokens, got, token, outcome)
            req.draft_token_ids = list(drafts.get(req.req_id, ()))
            self.kv.adopt_later_snapshot(req)
        return outcome

    def expect_drafts(self, req_ids: Sequence[str], num_drafts: int) -> None:
        """Proposals of a committed step still on the device: each request still running holds
        num_drafts PENDING_DRAFT ids, which its next plan schedules as drafts to fill
        (plan.draft_lookahead) and ``keep_drafts`` replaces with their values."""
        for req_id in req_ids:
            req = self._requests.get(req_id)
            if req is not None and req.status is Status.RUNNING:
                req.draft_token_ids = [PENDING_DRAFT] * num_drafts

    def keep_drafts(self, drafts: Mapping[str, Sequence[int]]) -> None:
        """Pending proposals as they reached the host: each request still running that waits
        for them keeps its own values (finished, aborted and preempted ones are gone)."""
        for req_id, tokens in drafts.items():
            req = self._requests.get(req_id)
            pending = req is not None and req.draft_token_ids[:1] == [PENDING_DRAFT]
            if pending and req.status is Status.RUNNING:
                req.draft_token_ids = list(tokens)

    def pending_drafts(self) -> list[str]:
        """Running requests whose proposals have not reached the host."""
        return [r.req_id for r in self._running if r.draft_token_ids[:1] == [PENDING_DRAFT]]

    def _append(self, req: Request, end: int, accepted, token: int, outcome) -> None:
        """Appends the accepted drafts, then the sampled token, checking stop conditions after
        each; what the step wrote past the verified positions (up to end) is rolled back."""
        if accepted and list(accepted) != req.draft_token_ids[: len(accepted)]:
            raise ValueError(f"request {req.req_id!r}: accepted tokens are not its drafts")
        verify = end > req.num_tokens
        req.num_computed_tokens = req.num_tokens + len(accepted)
        req.rejected = spec.rejected_span(req, end)
        appended, reason = spec.append_verified(req, [*accepted, token], self._stop_reason)
        # a stop inside the accepted drafts keeps fewer tokens than the step computed: a
        # snapshot past them holds state for tokens the request does not have
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
        self.kv.settle_snapshot(req)  # before any release: a snapshot past the end is dropped
        outcome.tokens[req.req_id] = appended[-1]
        if verify:
            outcome.extra_tokens[req.req_id] = appended[:-1]
            outcome.accepted_drafts[req.req_id] = min(len(accepted), len(appended))
        if reason is not None:
            outcome.finished.append(self._terminate(req, reason))
            return
        self.kv.cut_pages(req)
        self.kv.free_old_windows(req)

    def stats(self) -> dict[str, int]:
        """Counters for metrics: queue lengths and the pools' free, cached and total ids."""
        return {"num_running": len(self._running), "num_waiting": len(self._waiting),
                **self.kv.stats()}  # fmt: skip

    @property
    def uses_host_tier(self) -> bool:
        return self.kv.hicache

    def drop_host_residency(self) -> None:
        """The host tier is gone: forget host copies and make no new ones."""
        self.kv.radix.drop_host_residency()

    def num_cached_tokens(self, req_id: str) -> int:
        """Prompt tokens the request reused from the prefix cache (0 before admission)."""
        return self._requests[req_id].num_cached_tokens or 0

    # ------------------------------------------------------------------ scheduling
    def _prefill_waits(self) -> bool:
        """A prompt waits for its first or next chunk. Chunks end on page boundaries, so decodes
        that leave less than a page of the budget would hold it back for as long as they run:
        the next step then keeps a page for it (steps alternate at worst, and both progress)."""
        if self._waiting:
            return True
        return any(r.in_flight_step is None and r.num_tokens - r.num_computed_tokens > 1
                   for r in self._running)  # fmt: skip

    def _chunk_len(self, req: Request, start: int, budget: int) -> int:
        """Tokens to run from start: all that remain if they fit, else up to a page boundary;
        a chunk also ends at a share boundary so that a snapshot can be taken there."""
        end = min(req.num_tokens, start + budget)
        if end < req.num_tokens:
            end = end // self.config.page_size * self.config.page_size
        end = min([end] + [b for b in req.share_boundaries if b > start])
        return max(0, end - start)

    def _schedule_running(self, step: _Step) -> None:
        # Decodes (one token left) before partial prefills; the sort is stable (admission order).
        ordered = sorted(self._running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        decodes = -(-len(ordered) // self.config.micro_batches)  # this plan's share of them
        for req in ordered:
            if req.in_flight_step is not None:
                self._look_ahead(req, step)
            if req.status is not Status.RUNNING or req.in_flight_step is not None:
                continue  # preempted earlier in this loop, or its previous step is in flight
            decode = req.num_tokens - req.num_computed_tokens == 1
            if decode:
                if decodes == 0:
                    continue  # the next plan in flight decodes it
                decodes -= 1
                if step.decode_budget <= 0:  # the prefills' page: decoded after them if unused
                    step.held.append(req)
                    continue
            self._schedule(req, step, step.decode_budget if decode else step.budget)

    def _schedule_held(self, step: _Step) -> None:
        """The decodes a page kept for prompts held back, when no prompt took the page (none
        could be admitted): the whole budget is theirs again."""
        step.reserve = 0
        for req in step.held:
            if req.in_flight_step is not None:
                self._look_ahead(req, step)
            elif req.status is Status.RUNNING:
                self._schedule(req, step, step.budget)

    def _schedule(self, req: Request, step: _Step, budget: int) -> None:
        """req's next chunk or decode (with its drafts) within budget, growing its pages (or
        preempting the newest requests for them)."""
        start = req.num_computed_tokens
        num_tokens = self._chunk_len(req, start, budget)
        page = self.config.page_size if self.kv.prefix_caching else None
        num_drafts = spec.draft_len(req, budget, self.config.max_model_len, page)
        if num_drafts and not self.kv.grow(req, 1 + num_drafts):
            num_drafts = 0  # no room for the drafts: decode without them
        if num_drafts or (num_tokens and self._grow_or_preempt(req, num_tokens, step)):
            step.add(req, start, num_tokens + num_drafts)

    def _look_ahead(self, req: Request, step: _Step) -> None:
        """A lookahead entry for a decode in flight, when the pools have room (engine/lookahead)."""
        if not self.config.lookahead or step.budget <= 0:
            return
        if step.decode_budget <= 0:
            step.held.append(req)
        elif lookahead.grow(req, self.kv, self.config):
            step.add(req, req.num_tokens, 1)
            step.lookahead.append(req)
            self.lookahead_steps += 1

    def _grow_or_preempt(self, req: Request, num_tokens: int, step: _Step) -> bool:
        while not self.kv.grow(req, num_tokens):
            # The newest running request yields, possibly req itself: the oldest always progresses.
            victim = max(self._running, key=lambda r: r.admit_seq)
            self._preempt(victim, step)
            if victim is req:
                return False
        return True

    def _admit_waiting(self, step: _Step) -> None:
        while self._waiting and step.budget > 0:
            if not self._try_admit(self._waiting[0], step):
                return  # FCFS: nobody overtakes the head of the queue
            self._waiting.popleft()

    def _try_admit(self, req: Request, step: _Step) -> bool:
        page_ids, node = self.kv.match(req)
        start = len(page_ids) * self.config.page_size
        req.share_boundaries = self.kv.share_boundaries(req, start)
        num_tokens = self._chunk_len(req, start, step.budget)
        if num_tokens == 0 or not self.kv.admit(req, page_ids, node, num_tokens):
            req.share_boundaries = ()
            return False
        if req.num_cached_tokens is None:
            req.num_cached_tokens = start
        req.status, req.admit_seq = Status.RUNNING, next(self._admit_seq)
        self._running.append(req)
        step.admitted.append(req)
        step.add(req, start, num_tokens)
        return True

    # ------------------------------------------------------------------ plans
    def _build_plan(self, step: _Step) -> StepPlan:
        step_id = next(self._step_ids)
        plan = StepPlan(step_id=step_id, preempted_ids=step.preempted_ids)
        plan.snapshots = self.kv.take_step_snapshots(step.entries, step.lookahead)
        eos = self.config.eos_token_id
        plan.new_requests = [sync.new_request(req, eos) for req in step.admitted]
        plan.diffs = [diff for req in self._running if (diff := sync.pop_diff(req)) is not None]
        if self.config.num_speculative_steps > 0:
            plan.drafts = DraftPlan()
        lookahead_reqs = set(step.lookahead)
        for req, start, num_tokens in step.entries:
            if req in lookahead_reqs:
                plan.batch.append(BatchEntry(req.req_id, start, 1, True))
                plan.token_ids.append(LOOKAHEAD_TOKEN)
                plan.lookahead.append(req.req_id)
                req.lookahead_step = step_id
                self._want_logprobs(plan, req)
                continue
            num_drafts = max(0, start + num_tokens - req.num_tokens)
            sample = start + num_tokens >= req.num_tokens
            plan.batch.append(BatchEntry(req.req_id, start, num_tokens, sample, num_drafts))
            plan.token_ids.extend(req.token_ids[start : start + num_tokens - num_drafts])
            plan.token_ids.extend(req.draft_token_ids[:num_drafts])
            if num_drafts and req.draft_token_ids[0] == PENDING_DRAFT:
                plan.drafts.lookahead.append(req.req_id)
            if sample:
                self._want_logprobs(plan, req)
            elif plan.drafts is not None:
                plan.drafts.next_tokens[req.req_id] = req.token_ids[start + num_tokens]
            req.in_flight_step, req.samples_in_flight = step_id, sample
        plan.finished_ids, self._finished_ids = self._finished_ids, []
        self._in_flight[step_id] = list(step.entries)
        self.kv.attach_host_ops(plan)
        return plan

    @staticmethod
    def _want_logprobs(plan: StepPlan, req: Request) -> None:
        if req.sampling.logprobs is not None:
            plan.logprobs[req.req_id] = req.sampling.logprobs

    def _stop_reason(self, req: Request) -> str | None:
        token, sampling = req.token_ids[-1], req.sampling
        if token in sampling.stop_token_ids:
            return "stop"
        if token == self.config.eos_token_id and not sampling.ignore_eos:
            return "stop"
        if req.num_output_tokens >= sampling.max_tokens:
            return "length"
        if req.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _preempt(self, req: Request, step: _Step) -> None:
        """Recompute later: free everything, keep the generated tokens, wait at the front."""
        self.kv.release(req)
        step.drop(req)
        if req.known_to_stages:
            step.preempted_ids.append(req.req_id)
            req.known_to_stages = False
        self._running.remove(req)
        req.status = Status.WAITING
        self._waiting.appendleft(req)

    def _terminate(self, req: Request, reason: str) -> FinishedRequest:
        if req.status is Status.RUNNING:
            self.kv.release(req)
            self._running.remove(req)
        else:
            self._waiting.remove(req)
        if req.known_to_stages:
            self._finished_ids.append(req.req_id)
        req.status = Status.FINISHED
        del self._requests[req.req_id]
        return FinishedRequest(
            req_id=req.req_id,
            prompt_token_ids=req.token_ids[: req.prompt_len],
            output_token_ids=req.output_token_ids,
            finish_reason=reason,
            num_cached_tokens=req.num_cached_tokens or 0,
            num_host_cached_tokens=req.num_host_cached_tokens,
        )

    def reset_device_state(self) -> None:
        """After the stages restarted with empty pools (every request already ended): forget
        steps in flight and every device copy in the prefix index, keeping host-tier copies."""
        if self._requests:
            raise RuntimeError("reset_device_state with unfinished requests")
        self._in_flight.clear()
        self._finished_ids = []
        self.kv.radix.drop_device_residency()

    def check_integrity(self) -> None:
        """RuntimeError unless the queues agree and every id is accounted for (KVCacheManager)."""
        if any(req.status is not Status.RUNNING for req in self._running):
            raise RuntimeError("a request in the running list is not running")
        if any(req.status is not Status.WAITING for req in self._waiting):
            raise RuntimeError("a request in the waiting queue is not waiting")
        if len(self._running) + len(self._waiting) != len(self._requests):
            raise RuntimeError("running + waiting requests differ from the known requests")
        self.kv.check_integrity(self._running, self._waiting)
