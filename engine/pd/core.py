"""Engine cores of a prefill/decode pair (pure Python; cluster/pd.py puts them on Ray).

``PrefillCore`` serves PrefillRequests: each prompt runs to its first token, and the plan of the
step that samples it carries a KVSend with the request's destination, so every prefill stage
writes its own layers right after computing them (worker/pd/kv_export.py). The answer holds the
first token, its logprobs and every stage's SendReport.

``DecodeCore`` is an EngineCore whose requests are prefilled by a prefill engine:

    1. add_request marks a request remote (unless it is scored, asks for prompt logprobs, or
       the prefill engine is gone)
    2. each step reserves ids for remote requests at the head of the queue (DecodeScheduler)
       and sends a PrefillRequest for each through a PrefillClient
    3. an answer is checked: no error, every layer sent once, layout signatures equal to this
       engine's (check_reports). Its first token is delivered at once: the prefill engine
       computed it from its own KV, whatever happened on the wire
    4. the next plan carries a KVCheck; the decode stages checksum what they received
    5. equal to what was sent: the request runs from its transferred positions; any mismatch,
       error, timeout (pd_timeout_s) or a lost prefill engine: it is prefilled here instead
       (pd_local_prefills). Ids a prefill engine may still write are held until it answers.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from dsv4ray.engine.core import EngineCore, RequestUpdate
from dsv4ray.engine.handoff import (
    DeviceIds,
    Handoffs,
    KVCheck,
    KVDestination,
    KVSend,
    PrefillRequest,
    PrefillResult,
    SendReport,
)
from dsv4ray.engine.pd.handoff_plan import check_reports, compare_checksums
from dsv4ray.engine.pd.scheduler import DecodeScheduler
from dsv4ray.engine.sampling import SamplingParams

log = logging.getLogger("dsv4ray.pd")

POLL_S = 0.05  # how long an idle decode engine waits for an answer per step
LOST_GRACE_S = 2.0  # a lost prefill engine's stages may finish a write this long after it died
PD_STAT_NAMES = (
    "pd_remote_prefills",
    "pd_local_prefills",
    "pd_checksum_failures",
    "pd_transfer_bytes",
    "pd_transfer_seconds",
    "pd_checksum_seconds",
)


class PrefillClient(Protocol):
    """How a decode engine reaches its prefill engine (cluster/pd.py: a Ray actor)."""

    alive: bool  # False once the prefill engine is known to be gone

    def submit(self, request: PrefillRequest) -> Any: ...

    def wait(self, handles: list, timeout: float) -> list: ...  # the handles answered

    def result(self, handle: Any) -> PrefillResult: ...  # never raises (lost=True: gone)

    def placement(self) -> dict: ...

    def answers(self) -> bool: ...  # a ping, bounded: False when the engine is gone

    def restart(self) -> bool: ...  # a new engine started, or one starting came up: True when up

    def shutdown(self) -> None: ...


@dataclass
class Handoff:
    """A decode engine's view of one transfer. state: "prefill" (awaiting the answer),
    "check" (the next plan checks it), "checking" (plan step_id does), "orphan" (the request
    ended or fell back before the answer; its ids are held until the answer)."""

    transfer_id: int
    req_id: str
    num_tokens: int
    device: DeviceIds
    handle: Any
    started: float
    state: str = "prefill"
    reports: tuple[SendReport, ...] = ()
    step_id: int = -1
    release_at: float | None = None  # a lost orphan's ids are released then


class DecodeCore(EngineCore):
    scheduler_class = DecodeScheduler

    def __init__(self, config, model_config, pipeline, prefill: PrefillClient) -> None:
        self.prefill = prefill
        self.handoffs: dict[int, Handoff] = {}
        self.pd_stats = dict.fromkeys(PD_STAT_NAMES, 0)
        self.corrupt_transfers = config.pd_test_corrupt_transfers  # test hook (see EngineConfig)
        self.timeout_s = config.pd_timeout_s
        self._tag = uuid.uuid4().hex[:8]
        self._remote_on = False  # the warm-up runs here
        super().__init__(config, model_config, pipeline)
        self._remote_on = True

    def add_request(self, req_id, prompt_ids, params, score: bool = False) -> None:
        super().add_request(req_id, prompt_ids, params, score)
        # a scored prompt or one whose logprobs are asked for is prefilled here, where they
        # come back from
        local = score or params.prompt_logprobs is not None
        if self._remote_on and not local and self.prefill.alive:
            self.scheduler.mark_remote(req_id)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestUpdate]:
        updates = self._poll(0.0)
        self._launch()
        if not (self.in_flight or self.needs_rebuild or self.scheduler.has_local_work()):
            if not any(h.state in ("prefill", "orphan") for h in self.handoffs.values()):
                return updates + super().step()
            updates += self._poll(POLL_S)  # nothing runs until a prefill engine answers
            self._launch()
            if not self.scheduler.has_local_work():
                return updates
        return updates + super().step()

    def _launch(self) -> None:
        for transfer in self.scheduler.reserve_remote():
            req = transfer.req
            if not self.prefill.alive:
                transfer.answered = True  # nothing was asked: nothing can be written
                self.scheduler.fall_back(req.req_id)
                self.pd_stats["pd_local_prefills"] += 1
                continue
            corrupt = self.corrupt_transfers > 0
            self.corrupt_transfers -= int(corrupt)
            dest = KVDestination(tuple(self.pipeline.kv_endpoints), transfer.device_ids)
            request = PrefillRequest(
                f"{self._tag}-{transfer.transfer_id}",
                tuple(req.token_ids),
                req.sampling.to_dict(),
                req.seed,
                dest,
                corrupt,
            )
            handle = self.prefill.submit(request)
            self.handoffs[transfer.transfer_id] = Handoff(
                transfer.transfer_id, req.req_id, transfer.num_tokens, dest.device, handle,
                time.monotonic(),
            )  # fmt: skip

    def _poll(self, timeout: float) -> list[RequestUpdate]:
        """Handles the answers that came (waiting up to timeout for one), then timeouts."""
        waiting = {
            h.handle: h
            for h in self.handoffs.values()
            if h.state in ("prefill", "orphan") and h.handle is not None
        }
        updates = []
        if waiting:
            for handle in self.prefill.wait(list(waiting), timeout):
                updates += self._on_answer(waiting[handle], self.prefill.result(handle))
        elif timeout:
            time.sleep(timeout)  # only held ids of a lost engine are left: their grace runs
        self._expire(time.monotonic())
        return updates

    def _current(self, h: Handoff) -> bool:
        transfer = self.scheduler.transfers.get(h.req_id)
        return transfer is not None and transfer.transfer_id == h.transfer_id

    def _on_answer(self, h: Handoff, result: PrefillResult) -> list[RequestUpdate]:
        if result.lost and self.prefill.alive:
            log.error("prefill engine lost (%s): prefilling here from now on", result.error)
            self.prefill.alive = False
        if not self._current(h) or result.lost:
            if self._current(h):
                self._fall_back(h, result.error or "the prefill engine is gone")
            self._orphan_answered(h, lost=result.lost)
            return []
        self.scheduler.transfers[h.req_id].answered = True
        self._count_bytes(result.reports)
        if result.token is None:
            self._fall_back(h, result.error or "the prefill engine sampled no token")
            return []
        update = self._first_token(h, result)
        if not self._current(h):  # the first token ended the request
            del self.handoffs[h.transfer_id]
            return [update]
        num_layers = self.model_config.num_hidden_layers
        reason = check_reports(result, self.pipeline.kv_endpoints, num_layers)
        if reason is not None:
            self._fall_back(h, reason)
        else:
            h.state, h.reports = "check", result.reports
            self.scheduler.plan_wanted = True
        return [update]

    def _orphan_answered(self, h: Handoff, lost: bool) -> None:
        """An orphan's answer came: its held ids are free (after a grace when its engine died)."""
        h.state, h.handle = "orphan", None
        if lost:
            h.release_at = time.monotonic() + LOST_GRACE_S
            return
        self.scheduler.answered(h.transfer_id)
        self.handoffs.pop(h.transfer_id, None)

    def _first_token(self, h: Handoff, result: PrefillResult) -> RequestUpdate:
        finished = self.scheduler.first_token(
            h.req_id, result.token, (result.num_cached_tokens, result.num_host_cached_tokens)
        )
        delta, stop = self.outputs.on_token(h.req_id, result.token, result.logprobs)
        metrics = self.outputs.outputs[h.req_id].metrics
        metrics.kv_transfer_s = sum(r.write_s for r in result.reports)
        metrics.remote_prefill_s = result.prefill_s
        update = RequestUpdate(h.req_id, [result.token], delta)
        if stop and finished is None:
            finished = self.scheduler.finish(h.req_id, "stop")
        if finished is not None:
            update.output = self.outputs.on_finish(finished)
        return update

    def _expire(self, now: float) -> None:
        for h in list(self.handoffs.values()):
            if h.state == "prefill" and not self._current(h):
                h.state = "orphan"  # its request ended: the ids wait for the answer
            elif h.state == "prefill" and now - h.started > self.timeout_s:
                self._fall_back(h, f"no answer from the prefill engine in {self.timeout_s} s")
            elif h.release_at is not None and now >= h.release_at:
                self.scheduler.answered(h.transfer_id)
                del self.handoffs[h.transfer_id]

    def _fall_back(self, h: Handoff, reason: str) -> None:
        log.warning("request %s is prefilled here: %s", h.req_id, reason)
        answered = self.scheduler.transfers[h.req_id].answered
        self.scheduler.fall_back(h.req_id)
        self.pd_stats["pd_local_prefills"] += 1
        if answered:
            self.handoffs.pop(h.transfer_id, None)
        else:
            h.state = "orphan"

    def _count_bytes(self, reports) -> None:
        self.pd_stats["pd_transfer_bytes"] += sum(r.num_bytes for r in reports)
        self.pd_stats["pd_transfer_seconds"] += sum(r.write_s for r in reports)
        self.pd_stats["pd_checksum_seconds"] += sum(r.checksum_s for r in reports)

    def _prepare(self, plan) -> None:
        super()._prepare(plan)
        for h in list(self.handoffs.values()):
            if h.state != "check":
                continue
            if not self._current(h):  # it ended before its check (its ids went back then)
                del self.handoffs[h.transfer_id]
                continue
            plan.kv = plan.kv or Handoffs()
            plan.kv.checks.append(KVCheck(h.req_id, h.num_tokens, h.device))
            h.state, h.step_id = "checking", plan.step_id

    def _commit(self, plan, result) -> list[RequestUpdate]:
        updates = super()._commit(plan, result)
        checks = plan.kv.checks if plan.kv is not None else []
        reports = result.kv.checks if result.kv is not None else []
        for check in checks:
            h = self._checking(plan.step_id, check.req_id)
            if h is None:
                continue
            if not self._current(h):  # it ended while checked (its ids went back when it ended)
                del self.handoffs[h.transfer_id]
                continue
            self._verify(h, result, [c for c in reports if c.req_id == check.req_id])
        return updates

    def _checking(self, step_id: int, req_id: str) -> Handoff | None:
        for h in self.handoffs.values():
            if h.state == "checking" and h.step_id == step_id and h.req_id == req_id:
                return h
        return None

    def _verify(self, h: Handoff, result, checks) -> None:
        num_layers = self.model_config.num_hidden_layers
        if result.failed is not None:
            reason = "the step checking the received pages failed"
        else:
            reason = compare_checksums(h.reports, checks, num_layers)
            self.pd_stats["pd_checksum_failures"] += int(reason is not None)
        if reason is None:
            del self.handoffs[h.transfer_id]
            self.scheduler.start_remote(h.req_id)
            self.pd_stats["pd_remote_prefills"] += 1
        else:
            self._fall_back(h, reason)

    def _rebuild(self):
        # the stages that received are gone with their pools: no write can land anywhere now
        self.handoffs.clear()
        return super()._rebuild()

    def check_liveness(self) -> list[RequestUpdate]:
        """Between requests, the decode pipeline's check, then the prefill engine's: one found
        dead while idle (or lost earlier) is restarted in the background; until it is up, this
        engine prefills locally, and remote prefill resumes once it answers."""
        updates = super().check_liveness()
        if self.in_flight or self.scheduler.has_unfinished() or self.handoffs:
            return updates
        if self.prefill.alive and not self.prefill.answers():
            log.error("prefill engine lost while idle: prefilling here until it is restarted")
            self.prefill.alive = False
        if not self.prefill.alive and self.prefill.restart():
            log.info("prefill engine restarted: prefilling there again")
        return updates

    def stats(self) -> dict:
        return {**super().stats(), **self.pd_stats}

    def describe(self) -> dict:
        return {**super().describe(), **self.prefill.placement()}

    def shutdown(self) -> None:
        super().shutdown()
        self.prefill.shutdown()


class PrefillCore(EngineCore):
    """An engine that runs prefills for decode engines (``add_prefill``, then ``collect`` the
    answers from step updates)."""

    def __init__(self, config, model_config, pipeline) -> None:
        self.requests: dict[str, PrefillRequest] = {}
        self.reports: dict[str, list[SendReport]] = {}
        self.first_logprobs: dict[str, list] = {}
        super().__init__(config, model_config, pipeline)

    def add_prefill(self, request: PrefillRequest) -> None:
        """ValueError when the prompt cannot run here (too long for these pools, ...)."""
        params = SamplingParams.from_dict(request.sampling)
        # the first token alone: with min_tokens >= 1 it still may not end the request
        params = dataclasses.replace(
            params, max_tokens=1, min_tokens=min(params.min_tokens, 1), seed=request.seed
        )
        self.add_request(request.key, list(request.prompt_ids), params)
        self.requests[request.key] = request

    def _prepare(self, plan) -> None:
        super()._prepare(plan)
        for entry in plan.batch:
            request = self.requests.get(entry.req_id)
            if request is not None and entry.sample:
                num_tokens = entry.start_pos + entry.num_tokens
                plan.kv = plan.kv or Handoffs()
                plan.kv.sends.append(
                    KVSend(entry.req_id, num_tokens, request.dest, request.corrupt)
                )

    def _commit(self, plan, result) -> list[RequestUpdate]:
        for report in result.kv.sends if result.kv is not None else []:
            self.reports.setdefault(report.req_id, []).append(report)
        for req_id, logprobs in result.logprobs.items():
            if req_id in self.requests:
                self.first_logprobs[req_id] = logprobs
        return super()._commit(plan, result)

    def collect(self, updates: list[RequestUpdate]) -> list[PrefillResult]:
        """The answers of the prefills that the updates finished (their outputs are popped)."""
        done = []
        for update in updates:
            if update.output is None or update.request_id not in self.requests:
                continue
            key = update.request_id
            self.requests.pop(key)
            out = self.pop_output(key)
            done.append(
                PrefillResult(
                    key,
                    out.token_ids[0] if out.token_ids else None,
                    self.first_logprobs.pop(key, None),
                    tuple(self.reports.pop(key, [])),
                    out.error if out.finish_reason == "abort" else None,
                    num_cached_tokens=out.metrics.num_cached_tokens,
                    num_host_cached_tokens=out.metrics.num_host_cached_tokens,
                    prefill_s=out.metrics.e2e_s or 0.0,
                )
            )
        return done
