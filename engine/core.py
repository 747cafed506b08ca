"""EngineCore: the synchronous heart shared by ``LLM``, ``AsyncEngine``, the job runner and Serve.

It owns the scheduler and a pipeline (in-process stages or Ray stage actors) and turns one call of
``step()`` into a list of per-request updates (new tokens, text deltas, finished outputs). Up to
``pipeline.depth`` plans are in flight (micro-batches); the scheduler never schedules a request
that is in flight, and stages apply plans in order. With overlap scheduling a step's commit submits
the next plan as soon as the scheduler has taken the step's tokens, and only then detokenises them
and builds the updates, so the stages never wait for that work. If a stage dies, every unfinished
request ends with finish_reason "abort" and an error saying so, in the step that saw the failure;
the next step rebuilds the pipeline with fresh pools before it schedules anything, and the engine
keeps serving. A rebuild that fails ends the requests then waiting with an error (no caller waits
on a pipeline that is not there) and is tried again at the next step. If only the draft worker
died, no request ends: each resumes on the rebuilt pipeline from the tokens it has (recomputed as
its prompt, with its seed), so its output is the one an undisturbed run gives.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from dsv4ray.cache.formats import PAGE_SIZE
from dsv4ray.config import ModelConfig
from dsv4ray.engine import spec
from dsv4ray.engine.checks import check_request_id, check_sampling
from dsv4ray.engine.config import EngineConfig, SchedulerConfig
from dsv4ray.engine.interrupts import deferred
from dsv4ray.engine.output_processor import OutputProcessor
from dsv4ray.engine.outputs import RequestOutput
from dsv4ray.engine.pipeline import Pipeline, PipelineFailure
from dsv4ray.engine.plan import NO_DRAFTS
from dsv4ray.engine.sampling import SamplingParams, check_text
from dsv4ray.engine.scheduler import Scheduler
from dsv4ray.engine.stats import hisparse_totals
from dsv4ray.engine.warm_up import warm_up
from dsv4ray.text.tokenizer import Tokenizer

log = logging.getLogger("dsv4ray.engine")


@dataclass
class RequestUpdate:
    """What one step did for one request: new token ids and text, their logprobs when the
    request asked for them (one {token id: logprob} per token), the prompt's logprobs with the
    first tokens (RequestOutput.prompt_logprobs); ``output`` when finished."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    output: RequestOutput | None = None
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list | None = None  # the request's, with its first tokens (if asked)


class EngineCore:
    scheduler_class = Scheduler  # a decode engine of a prefill/decode pair uses a subclass

    def __init__(self, config: EngineConfig, model_config: ModelConfig, pipeline: Pipeline) -> None:
        """pipeline: built by the caller for this config (in-process stages or Ray stage
        actors); the core drives it and rebuilds it when a stage dies."""
        self.config = config
        self.model_config = model_config
        self.tokenizer = Tokenizer(config.model)
        self.pipeline = pipeline
        self.host_pages, self.host_snapshots = self._attach_host_tier()
        self.scheduler = self._new_scheduler()
        self.outputs = OutputProcessor(self.tokenizer)
        self.closed = False  # shut down: takes no request and never rebuilds its pipeline
        self.in_flight: deque = deque()
        self.scoring: set[str] = set()
        self.num_rebuilds = 0
        self.num_preemptions = 0
        self.needs_rebuild = False  # a stage died: rebuild before the next plan
        self.resume: dict[str, spec.Resume] = {}  # requests to resume after a draft worker died
        self.spec_stats = dict.fromkeys(spec.STAT_NAMES, 0)
        # the last committed step's proposals still on the device (in-process draft worker)
        self.pending_drafts = None
        self._fill_in_commit = False  # a step's commit submits the next plan (overlap only)
        if config.device == "cuda":
            warm_up(self)

    def run_plan(self, plan) -> list[RequestUpdate]:
        """Runs one plan to its commit at once (nothing else in flight): the warm-up's steps."""
        return self._commit(plan, self.pipeline.collect(self.pipeline.submit(plan)))

    def restart_scheduler(self) -> None:
        """A fresh scheduler over the same pools (after the warm-up: nothing of it stays)."""
        self.scheduler = self._new_scheduler()
        self.pending_drafts = None

    def _attach_host_tier(self) -> tuple[int, int]:
        """HiCache: host pages (host_cache_tokens, default twice the device pool) per stage."""
        if not self.config.enable_hicache:
            return 0, 0
        cap = self.pipeline.capacity
        tokens = self.config.host_cache_tokens or 2 * cap.num_full_tokens
        pages = max(1, tokens // PAGE_SIZE)
        snapshots = max(4, pages // 8)
        self.pipeline.attach_host(pages, snapshots)
        log.info(
            "host tier: %d pages (%d tokens), %d snapshots per stage, policy %s",
            pages,
            pages * PAGE_SIZE,
            snapshots,
            self.config.hicache_write_policy,
        )
        return pages, snapshots

    def _new_scheduler(self) -> Scheduler:
        cap, cfg, ec = self.pipeline.capacity, self.model_config, self.config
        asked = ec.max_model_len or cfg.max_position_embeddings
        self.max_model_len = min(asked, cap.num_full_tokens)
        if ec.max_model_len is not None and self.max_model_len < ec.max_model_len:
            log.warning(
                "max_model_len %d is more than the pools hold (%d tokens): serving contexts up "
                "to %d tokens (raise max_total_tokens or memory_fraction for longer ones)",
                ec.max_model_len,
                cap.num_full_tokens,
                self.max_model_len,
            )
        log.info(
            "engine: %s, pp=%d, capacity %d tokens, max_model_len %d, %s",
            ec.model,
            ec.pp_size,
            cap.num_full_tokens,
            self.max_model_len,
            spec.describe(ec.speculative_num_steps),
        )
        return self.scheduler_class(
            SchedulerConfig(
                num_pages=cap.num_pages,
                num_window_pages=cap.num_window_pages,
                num_state_slots=cap.num_state_slots,
                num_cached_state_slots=cap.num_cached_state_slots,
                max_model_len=self.max_model_len,
                eos_token_id=self.tokenizer.eos_token_id,
                max_num_batched_tokens=ec.max_num_batched_tokens,
                enable_prefix_caching=ec.enable_prefix_caching,
                num_host_pages=self.host_pages,
                num_host_snapshots=self.host_snapshots,
                hicache_write_policy=ec.hicache_write_policy,
                lookahead=ec.uses_overlap,
                num_speculative_steps=ec.speculative_num_steps,
                micro_batches=ec.micro_batches,
            )
        )

    # ------------------------------------------------------------------ requests
    def prompt_ids(self, prompt) -> list[int]:
        """A string (tokenised) or a list of token ids (checked against the vocabulary)."""
        if isinstance(prompt, str):
            check_text("prompt", prompt)
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (bytes, bytearray)):  # a Sequence of ints, but not token ids
            raise ValueError("a prompt must be a string or a list of token ids, got bytes "
                             "(decode it to a string)")  # fmt: skip
        ints = isinstance(prompt, Sequence) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        )
        if ints:
            vocab = self.model_config.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
            return list(prompt)
        if isinstance(prompt, Sequence) and prompt:
            kinds = sorted({type(t).__name__ for t in prompt
                            if not isinstance(t, int) or isinstance(t, bool)})  # fmt: skip
            raise ValueError(f"a prompt must be a string or a list of int token ids; this list "
                             f"holds {', '.join(kinds)}")  # fmt: skip
        raise ValueError(
            f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}"
        )

    def add_request(
        self, req_id: str, prompt_ids: list[int], params: SamplingParams, score: bool = False
    ) -> None:
        """ValueError for anything a plan could not carry: a request is checked whole before it
        reaches the scheduler, so no step ever fails on one request's data. RuntimeError once
        the engine is shut down."""
        if self.closed:
            raise RuntimeError("the engine is shut down; start a new one to generate")
        check_request_id(req_id)
        check_sampling(params, self.model_config.vocab_size)
        limit = self.hisparse_host_limit
        if limit is not None and len(prompt_ids) >= limit:
            raise ValueError(
                f"request {req_id!r}: its C4 history ({len(prompt_ids)} prompt tokens and one "
                f"more) does not fit the HiSparse host store of {limit} tokens "
                "(hisparse_host_tokens)"
            )
        whole = score or params.prompt_logprobs is not None  # every position computed
        with deferred():  # the scheduler and the outputs know it, or neither does
            self.scheduler.add_request(req_id, prompt_ids, params, use_prefix_cache=not whole)
            self.outputs.add(req_id, prompt_ids, params)
            if score:
                self.scoring.add(req_id)

    def abort(self, req_id: str, error: str | None = None) -> RequestOutput | None:
        self.scoring.discard(req_id)
        finished = self.scheduler.abort(req_id)
        if finished is None:
            return None
        return self.outputs.on_finish(finished, error)

    def drop(self, req_id: str, error: str) -> None:
        """Aborts the request if it runs and forgets it, output included (an unknown id, or one
        already popped, is fine): what a caller that gives up on its requests calls."""
        with deferred():
            self.abort(req_id, error)
            if req_id in self.outputs.outputs:
                self.outputs.pop(req_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.in_flight)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestUpdate]:
        """Submits plans up to the pipeline depth, then commits the oldest one in flight."""
        if self.closed:  # what a shut-down engine still held ends here, with no rebuild
            return self.abort_all("the engine was shut down")
        if self.needs_rebuild:
            refused = self._rebuild()
            if refused is None:
                return self.abort_all("the pipeline could not be restarted after a stage failed")
            if refused:
                return refused
        with deferred():  # scheduling, submitting and a failed submit's recovery (Ctrl-C: after)
            failure = self._fill()
            recovered = self._recover(failure) if failure is not None else None
        if recovered is not None:
            return recovered
        if not self.in_flight:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler has unfinished requests but nothing to run")
            return []
        plan, handle = self.in_flight.popleft()
        try:  # waiting for the step: a Ctrl-C here abandons the plan, which the next commit
            result = self.pipeline.collect(handle)  # forgets (the steps run in order)
        except PipelineFailure as exc:
            return self._recover(exc)
        self._fill_in_commit = self.config.uses_overlap
        try:
            with deferred():  # a commit is applied whole
                return self._commit(plan, result)
        finally:
            self._fill_in_commit = False

    def _fill(self) -> PipelineFailure | None:
        """Schedules and submits plans up to the pipeline depth; the failure of a submit."""
        while len(self.in_flight) < self.pipeline.depth:
            plan = self.scheduler.schedule()
            self._settle_skipped_drafts(plan)
            if plan is None:
                break
            self._prepare(plan)
            if plan.has_host_ops and not self.pipeline.host_alive():
                self._host_tier_lost()  # this plan's copies still reach the stages' mappings
            try:
                self.in_flight.append((plan, self.pipeline.submit(plan)))
            except PipelineFailure as exc:
                return exc
        return None

    def _settle_skipped_drafts(self, plan) -> None:
        """Pending proposals go to the next plan, which fills them on the device; those of
        requests that plan skips (or of every request, with no plan) are read now."""
        pending, self.pending_drafts = self.pending_drafts, None
        if pending is None:
            return
        skipped = set(self.scheduler.pending_drafts()) - set(plan.draft_lookahead if plan else ())
        if skipped:
            values = pending.result()
            self.scheduler.keep_drafts({r: values[r] for r in skipped if r in values})

    def _prepare(self, plan) -> None:
        """What the engine adds to a scheduled plan before the stages get it, and counts of it."""
        plan.full_logits = [e.req_id for e in plan.batch if e.req_id in self.scoring]
        plan.prompt_logprobs = self.outputs.prompt_targets(plan.batch)
        self.outputs.on_scheduled(e.req_id for e in plan.batch)
        self.num_preemptions += len(plan.preempted_ids)

    def _commit(self, plan, result) -> list[RequestUpdate]:
        updates: dict[str, RequestUpdate] = {}
        for req_id, error in self._step_errors(plan, result).items():
            log.error("request %s aborted: %s", req_id, error)
            out = self.abort(req_id, error)  # before commit: its step entry no longer counts
            if out is not None:
                updates[req_id] = RequestUpdate(req_id, output=out)
        drafts = result.spec or NO_DRAFTS
        self.scheduler.keep_drafts(drafts.resolved)  # the values its drafts had
        outcome = self.scheduler.commit(plan, result.sampled, drafts.accepted, drafts.proposals)
        finished = outcome.finished
        spec.count_drafts(plan, outcome, result, self.outputs.outputs, self.spec_stats)
        k = self.config.speculative_num_steps
        if drafts.pending is not None:  # the next plan takes them on the device
            self.scheduler.expect_drafts(drafts.pending.req_ids, k)
            self.pending_drafts = drafts.pending
        elif drafts.held:  # a draft actor holds them; the next plan's stages take them
            self.scheduler.expect_drafts(drafts.held, k)
        # With overlap the next plan goes out now, before this step's tokens are detokenised
        # and handed over: the stages start it while the host makes the outputs. A stop string
        # found below ends its request after that plan took it, like a request that ends while
        # its lookahead step runs (the entry is skipped at commit).
        failure = self._fill() if self._fill_in_commit else None
        starts = {e.req_id: e.start_pos for e in plan.batch} if result.full_logits else {}
        for req_id, logits in result.full_logits.items():
            if req_id in outcome.applied:
                self.outputs.on_logits(req_id, starts[req_id], logits)
        for req_id, (start, entries) in result.prompt_logprobs.items():
            if req_id in outcome.applied:
                self.outputs.on_prompt_logprobs(req_id, start, entries)
        for req_id, token in outcome.tokens.items():
            tokens = [*outcome.extra_tokens.get(req_id, ()), token]
            try:
                tokens, delta, stop = self._feed(req_id, tokens, result)
            except Exception as exc:  # text or stop handling of one request fails alone
                log.exception("request %s: output handling failed", req_id)
                finished = [f for f in finished if f.req_id != req_id]
                out = self._end(req_id, f"output handling failed: {type(exc).__name__}")
                updates[req_id] = RequestUpdate(req_id, output=out)
                continue
            out = self.outputs.outputs[req_id]
            recorded = out.logprobs  # the tokens' are its last ones
            logprobs = None if recorded is None else recorded[len(recorded) - len(tokens) :]
            updates[req_id] = RequestUpdate(req_id, tokens, delta, None, logprobs)
            if out.prompt_logprobs is not None and len(out.token_ids) == len(tokens):
                updates[req_id].prompt_logprobs = out.prompt_logprobs  # with the first tokens
            if stop and not any(f.req_id == req_id for f in finished):
                done = self.scheduler.finish(req_id, "stop")
                finished += [done] if done is not None else []
        for f in finished:
            update = updates.setdefault(f.req_id, RequestUpdate(f.req_id))
            update.output = self.outputs.on_finish(f)
            self.scoring.discard(f.req_id)
        if failure is not None:  # the next plan's submit found a dead stage
            for update in self._recover(failure):
                updates.setdefault(update.request_id, update).output = update.output
        return list(updates.values())

    def _feed(self, req_id: str, tokens: list[int], result) -> tuple[list[int], str, bool]:
        """Hands a step's tokens of a request to its output one by one, up to a stop string:
        (the tokens taken, their text, whether a stop string ended the request)."""
        if len(tokens) == 1:  # a decode's one token (no drafts accepted)
            delta, stop = self.outputs.on_token(req_id, tokens[0], result.logprobs.get(req_id))
            return tokens, delta, stop
        accepted = (result.spec or NO_DRAFTS).accepted_logprobs.get(req_id)
        logprobs = accepted or [None] * (len(tokens) - 1)
        logprobs = [*logprobs, result.logprobs.get(req_id)]
        text = ""
        for i, token in enumerate(tokens):
            delta, stop = self.outputs.on_token(req_id, token, logprobs[i])
            text += delta
            if stop:
                return tokens[: i + 1], text, True
        return tokens, text, False

    @staticmethod
    def _step_errors(plan, result) -> dict[str, str]:
        """Requests the step could not serve: all of its batch when a stage's compute failed,
        else those whose sampling failed. The messages are for users: no internals."""
        if result.failed is not None:
            log.error("step %d failed: %s", plan.step_id, result.failed)
            reason = "the step computing this request failed on a pipeline stage"
            return {entry.req_id: reason for entry in plan.batch}
        return dict(result.errors)

    def _end(self, req_id: str, error: str) -> RequestOutput:
        """Aborts a request the scheduler may already have finished (its output stays)."""
        out = self.abort(req_id, error)
        if out is None:
            out = self.outputs.outputs[req_id]
            out.finish_reason, out.error = "abort", error
        return out

    def _recover(self, exc: PipelineFailure) -> list[RequestUpdate]:
        """A stage died: every unfinished request ends now, with the reason; the next step
        rebuilds the pipeline (seconds to minutes), so no caller waits for it to learn."""
        self.needs_rebuild = True
        self.pending_drafts = None
        if self.pipeline.draft_lost():
            log.error("draft worker lost (%s): rebuilding; requests resume from their tokens", exc)
            self.in_flight.clear()
            self.resume = spec.resume_points(self.scheduler, self.outputs.unfinished())
            for req_id in self.scoring:
                self.outputs.logits.pop(req_id, None)  # a scored prompt is scored again
            return []
        log.error("pipeline stage failed: %s; rebuilding the pipeline", exc)
        return self.abort_all("a pipeline stage failed while the request ran")

    def _rebuild(self) -> list[RequestUpdate] | None:
        """Fresh stage actors and pools. With a host tier the prefix index keeps what the host
        holds, so restarted stages load cached prefixes back instead of recomputing them.
        Returns the waiting requests the restarted pipeline cannot take (smaller pools), ended;
        None when the rebuild failed (logged; the next step tries again)."""
        self.num_rebuilds += 1
        old_capacity = self.pipeline.capacity
        try:
            self.pipeline.rebuild()
        except Exception:  # a stage died again, or the cluster cannot start one now
            log.exception("pipeline rebuild failed")
            return None
        self.needs_rebuild = False
        waiting = self._take_waiting()
        if self.pipeline.host_lost and self.scheduler.uses_host_tier:
            log.error("the host tier came back empty: its cached prefixes are forgotten")
            self.scheduler.drop_host_residency()
        if self.scheduler.uses_host_tier and self.pipeline.capacity == old_capacity:
            self.scheduler.reset_device_state()
            log.info("prefix index kept its host-tier pages across the restart")
        else:
            self.scheduler = self._new_scheduler()
        self.scoring &= set(waiting)
        return self._queue_again(waiting)

    def _queue_again(self, waiting: list[str]) -> list[RequestUpdate]:
        refused = []
        for req_id in waiting:  # same order: first come, first served
            prompt = self.outputs.outputs[req_id].prompt_token_ids
            params = self.outputs.params[req_id]
            point = self.resume.pop(req_id, None)
            if point is not None:  # it ran before its draft worker died: resume where it was
                prompt = point.prompt_token_ids
                params = dataclasses.replace(params, max_tokens=point.max_tokens, seed=point.seed,
                                             min_tokens=point.min_tokens)  # fmt: skip
            try:
                whole = req_id in self.scoring or params.prompt_logprobs is not None
                self.scheduler.add_request(req_id, prompt, params, not whole)
            except ValueError as exc:  # too long for the restarted pipeline's pools
                out = self._end(req_id, f"the restarted pipeline cannot take it: {exc}")
                refused.append(RequestUpdate(req_id, output=out))
        return refused

    def _take_waiting(self) -> list[str]:
        """Unfinished requests (added after the failure, so none has run) leave the scheduler
        quietly; ``_rebuild`` queues them again on the restarted pipeline."""
        waiting = self.outputs.unfinished()
        for req_id in waiting:
            self.scheduler.abort(req_id)
        return waiting

    def _host_tier_lost(self) -> None:
        log.error("host tier lost: dropping host residency, serving from device pools only")
        self.scheduler.drop_host_residency()
        self.pipeline.drop_host()

    @property
    def hisparse_host_limit(self) -> int | None:
        """Tokens the HiSparse host store holds when it, not the device, caps the capacity."""
        host = self.config.hisparse_host_tokens if self.config.enable_hisparse else None
        if host is None:
            return None
        host = host // PAGE_SIZE * PAGE_SIZE
        return host if host <= self.pipeline.capacity.num_full_tokens else None

    def stats(self) -> dict:
        """Counters for metrics and tests: requests, pages, host pages, pipeline rebuilds,
        preemptions (of requests the stages had seen); with HiSparse the stages' hot-row hits
        and misses, host bytes and device C4 bytes."""
        out = {
            **self.scheduler.stats(),
            **self.spec_stats,
            "num_host_pages": self.host_pages,
            "num_pipeline_rebuilds": self.num_rebuilds,
            "num_preemptions": self.num_preemptions,
        }
        if self.config.enable_hisparse:
            try:
                stage_stats = self.pipeline.stage_stats()
            except Exception as exc:  # a dead stage: counters are absent until the rebuild
                log.warning("stage counters unavailable: %s", exc)
                stage_stats = []
            out.update(hisparse_totals(stage_stats))
        return out

    def check_liveness(self) -> list[RequestUpdate]:
        """Between requests: a stage or draft worker that died while idle is found and the
        pipeline rebuilt now, before a request needs it (so none fails for it). Returns what a
        step would (nothing, unless a rebuild refuses waiting requests)."""
        if self.closed or self.in_flight or self.scheduler.has_unfinished():
            return []
        if not self.needs_rebuild and self.pipeline.stages_alive():
            return []
        log.error("a pipeline actor died while the engine was idle: rebuilding the pipeline")
        self.needs_rebuild, self.pending_drafts = True, None
        return self._rebuild() or []

    def describe(self) -> dict:
        """Where the stages run and how many tokens their pools hold."""
        return {
            **self.pipeline.placement(),
            "capacity_tokens": self.pipeline.capacity.num_full_tokens,
        }

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def abort_all(self, error: str) -> list[RequestUpdate]:
        """Ends every unfinished request with finish_reason "abort" and ``error``."""
        self.in_flight.clear()
        self.resume = {}
        self.pending_drafts = None
        updates = []
        for req_id in self.outputs.unfinished():
            finished = self.scheduler.abort(req_id)
            if finished is not None:
                out = self.outputs.on_finish(finished, error)
                updates.append(RequestUpdate(req_id, output=out))
        return updates

    def run_until_done(self, req_ids: set[str]) -> None:
        while any(not self.outputs.outputs[r].finished for r in req_ids):
            self.step()

    def pop_logits(self, req_id: str) -> list:
        """A scoring request's [n, V] fp32 logits per step, in order (popped)."""
        return self.outputs.pop_logits(req_id)

    def pop_output(self, req_id: str) -> RequestOutput:
        return self.outputs.pop(req_id)

    def shutdown(self) -> None:
        self.closed = True
        self.pipeline.shutdown()
