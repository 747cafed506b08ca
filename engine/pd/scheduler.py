"""The decode engine's scheduler: requests whose prompt a prefill engine computes (pure Python).

A remote request (``mark_remote``) waits in the queue like any other; at the head it takes,
instead of a step, the ids its prompt's KV will be written into (``reserve_remote``):

    pages         [0, cdiv(n, 256)) of its n tokens (every compressed pool uses the same ids)
    window pages  trailing_windows(n): the window its next token reads
    state slot    the rows of its compressor rings

It then is a Transfer: it holds those ids, runs no step and is never a preemption victim. The
prefill engine's first token is appended when it arrives (``first_token``; it may finish the
request). When the decode stages found the received bytes intact, ``start_remote`` makes it a
running request with n tokens computed, announced to the stages in the next plan with
state_copy_from = STATE_TRANSFERRED. Any failure ends in ``fall_back``: the request waits again
at the front and is prefilled here. Ids that a prefill engine that has not answered yet may still
write are never reused: they stay held (``release_held`` frees them once it answered or died).
A preempted request that has generated tokens resumes here, prefilled locally: the prefill
engine would take them for prompt, and the token it samples next depends on which tokens are the
output (penalties, min_tokens, a grammar's state), which only this engine tracks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from dsv4ray.engine.handoff import STATE_TRANSFERRED, DeviceIds
from dsv4ray.engine.kv_manager import cdiv
from dsv4ray.engine.pd.handoff_plan import trailing_windows
from dsv4ray.engine.request import FinishedRequest, Request, Status
from dsv4ray.engine.scheduler import Scheduler, _Step


@dataclass
class Transfer:
    """A remote request holding reserved ids; num_tokens: how many positions the KV covers."""

    transfer_id: int
    req: Request
    num_tokens: int
    answered: bool = False  # the prefill engine answered: nothing more will be written

    @property
    def device_ids(self) -> DeviceIds:
        req = self.req
        windows = tuple(sorted(req.window_pages.items()))
        return DeviceIds(tuple(req.page_ids), windows, req.state_slot)


class DecodeScheduler(Scheduler):
    def __init__(self, config) -> None:
        super().__init__(config)
        self.remote: set[str] = set()  # requests to prefill remotely when they reach the head
        self.transfers: dict[str, Transfer] = {}  # by req_id
        self.held: dict[int, Request] = {}  # by transfer_id: ids a late write may still reach
        self.plan_wanted = False  # the engine has checks to run: schedule even an idle plan
        self._announce: list[Request] = []  # started, for the next plan's new_requests
        self._transfer_ids = itertools.count()

    def mark_remote(self, req_id: str) -> None:
        self.remote.add(req_id)

    def _preempt(self, req: Request, step: _Step) -> None:
        super()._preempt(req, step)
        if req.num_output_tokens:
            self.remote.discard(req.req_id)

    def reserve_remote(self) -> list[Transfer]:
        """Reserves ids for the remote requests at the head of the queue, first come first
        served, while the pools have room (a local request at the head stops it)."""
        started = []
        while self._waiting and self._waiting[0].req_id in self.remote:
            req = self._waiting[0]
            if not self._reserve(req):
                break
            self._waiting.popleft()
            transfer = Transfer(next(self._transfer_ids), req, req.num_tokens)
            self.transfers[req.req_id] = transfer
            started.append(transfer)
        return started

    def _reserve(self, req: Request) -> bool:
        windows = list(trailing_windows(req.num_tokens, self.config.window_page_size))
        num_pages = cdiv(req.num_tokens, self.config.page_size)
        if self.kv.state_slots.num_free < 1 or not self.kv.ensure_free(num_pages, len(windows)):
            return False
        req.page_ids = self.kv.pages.alloc(num_pages)
        req.window_pages = dict(zip(windows, self.kv.window_pages.alloc(len(windows))))
        req.state_slot = self.kv.state_slots.alloc(1)[0]
        if req.num_cached_tokens is None:
            req.num_cached_tokens = 0
        req.status = Status.RUNNING
        return True

    def first_token(self, req_id: str, token: int, cached: tuple[int, int] = (0, 0)):
        """Appends the prefill engine's token to a transferring request (its answer came, so
        its ids may be released); cached: the prompt tokens the prefill engine's prefix cache
        and host tier gave. Returns the request's end (FinishedRequest) if the token met a
        stop condition, else None."""
        transfer = self.transfers[req_id]
        transfer.answered = True
        transfer.req.num_cached_tokens, transfer.req.num_host_cached_tokens = cached
        transfer.req.token_ids.append(token)
        reason = self._stop_reason(transfer.req)
        return None if reason is None else self._terminate(transfer.req, reason)

    def start_remote(self, req_id: str) -> None:
        """The received KV checked out: the request runs from its transferred positions."""
        transfer = self.transfers.pop(req_id)
        req = transfer.req
        req.num_computed_tokens = transfer.num_tokens
        req.state_copy_from = STATE_TRANSFERRED
        req.admit_seq = next(self._admit_seq)
        self._running.append(req)
        self._announce.append(req)

    def fall_back(self, req_id: str) -> None:
        """The handoff failed: the request waits at the front and is prefilled here. Its ids are
        freed, or held if the prefill engine has not answered."""
        transfer = self.transfers.pop(req_id)
        self.remote.discard(req_id)
        self._give_back(transfer)
        transfer.req.status = Status.WAITING
        self._waiting.appendleft(transfer.req)

    def answered(self, transfer_id: int) -> None:
        """A prefill engine answered (or is gone) for a transfer that ended before: its held
        ids are free now."""
        holder = self.held.pop(transfer_id, None)
        if holder is not None:
            self.kv.release(holder)

    def _give_back(self, transfer: Transfer) -> None:
        req = transfer.req
        if transfer.answered:
            self.kv.release(req)
            return
        holder = Request(req.req_id, list(req.token_ids), req.sampling, req.seed)
        holder.page_ids, holder.window_pages, holder.state_slot = (
            req.page_ids,
            req.window_pages,
            req.state_slot,
        )
        self.held[transfer.transfer_id] = holder
        req.reset_cache_state()

    # ------------------------------------------------------------------ scheduler hooks
    def schedule(self):
        plan = super().schedule()
        if plan is None and self.plan_wanted:
            plan = self._build_plan(_Step(budget=self.config.max_num_batched_tokens))
        self.plan_wanted = False
        return plan

    def _schedule_running(self, step: _Step) -> None:
        announce, self._announce = self._announce, []
        super()._schedule_running(step)
        # a request started since the last plan is new to the stages (unless preempted just now)
        step.admitted.extend(req for req in announce if req.status is Status.RUNNING)

    def _try_admit(self, req: Request, step: _Step) -> bool:
        if req.req_id in self.remote:
            return False  # reserve_remote takes it
        return super()._try_admit(req, step)

    def _terminate(self, req: Request, reason: str) -> FinishedRequest:
        transfer = self.transfers.pop(req.req_id, None)
        if transfer is None:
            self.remote.discard(req.req_id)
            return super()._terminate(req, reason)
        self.remote.discard(req.req_id)
        self._give_back(transfer)
        # it holds nothing now: end it the way a waiting request ends
        req.status = Status.WAITING
        self._waiting.append(req)
        return super()._terminate(req, reason)

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "num_transferring": len(self.transfers)}

    def has_local_work(self) -> bool:
        """Whether a step could run now without waiting for a prefill engine."""
        head_local = bool(self._waiting) and self._waiting[0].req_id not in self.remote
        return bool(self._running or head_local or self._finished_ids or self.plan_wanted)

    def check_integrity(self) -> None:
        """As Scheduler's, with transferring requests and held ids as holders of their ids."""
        transferring = [t.req for t in self.transfers.values()]
        if any(req.status is not Status.RUNNING for req in self._running + transferring):
            raise RuntimeError("a running or transferring request is not running")
        if any(req.status is not Status.WAITING for req in self._waiting):
            raise RuntimeError("a request in the waiting queue is not waiting")
        num = len(self._running) + len(self._waiting) + len(transferring)
        if num != len(self._requests):
            raise RuntimeError("running + waiting + transferring differ from the known requests")
        holders = [*self._running, *transferring, *self.held.values()]
        self.kv.check_integrity(holders, self._waiting)
