"""The stages' side of overlap scheduling (engine/lookahead.py): a lookahead entry's token id is
filled on the device from the token its request sampled last, and sampled ids reach the host only
when the engine collects the step.

The first stage keeps ``SampledTokens``: the latest sampled id of every compressor-state slot
[num_slots] on its device (slot ids are the same in every stage). A lookahead entry is a request's
one token that its previous plan samples; that plan's sampling wrote the request's slot before
this plan's fill reads it:

    one stage       it samples and fills in stream order;
    several stages  the last stage's ids reach the first before the next plan runs there: in
                    process it writes them itself; a stage actor hands them back in
                    StageResult.samples (the graph's edge from the last stage to the first,
                    ``take``), or writes them into the first stage's table through CUDA IPC when
                    both share a GPU, with an interprocess event the first stage's stream waits on
                    before it fills. A wait binds to the event's latest record when it is issued,
                    so the first stage issues it for a graph execution only once the last stage
                    has posted every execution before it (``PostedCount``, shared host memory:
                    the last stage counts an execution once its writes are recorded). The driver
                    submits the next plan without reading the outputs before it, and the first
                    stage readies that plan while the last one computes; no graph edge goes back
                    to the first stage.

A row that could not sample holds -1; the request ends at that plan's commit and its lookahead
entry is skipped, so the id used for it (clamped to 0) only has to be a valid embedding index.
Stages after the first get the filled ids with the residual rows (StageResult.token_ids): layers
with hash-routed experts read them.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
import time
import uuid

import torch

from dsv4ray.engine.plan import StageResult, StepPlan
from dsv4ray.worker.graphs.ipc import export_tensor, open_tensor
from dsv4ray.worker.sampling.sampler import to_device

log = logging.getLogger("dsv4ray.worker")


# how long a first stage waits for the last stage to post the executions before its own: past
# the driver's step timeout (it rebuilds a pipeline whose stage died), so only a bug trips it
POSTED_TIMEOUT_S = 600.0
POSTED_SPIN_S = 0.002  # yields before sleeping between looks: a post is usually this close


class PostedCount:
    """How many graph executions the last stage has posted (its sampled ids written and the
    interprocess event recorded, or nothing to write): an int64 in 8 bytes of host memory that
    the first stage of the same GPU maps too. The peer removes the file's name as soon as it
    mapped it (``unlink``); the mappings stay."""

    def __init__(self, path: str, create: bool) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, 8)
            self._map = mmap.mmap(fd, 8)
        finally:
            os.close(fd)
        self.path = path
        self._count = memoryview(self._map).cast("q")  # one aligned 8-byte store per write

    @classmethod
    def create(cls) -> PostedCount:
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        return cls(os.path.join(folder, f"dsv4ray-posted-{os.getpid()}-{uuid.uuid4().hex}"), True)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def write(self, count: int) -> None:
        self._count[0] = count

    def read(self) -> int:
        return self._count[0]

    def wait_until(self, count: int, timeout_s: float | None = None) -> None:
        """Returns once at least `count` executions were posted; RuntimeError after timeout_s
        (POSTED_TIMEOUT_S when None)."""
        if self._count[0] >= count:
            return
        timeout_s = POSTED_TIMEOUT_S if timeout_s is None else timeout_s
        start = time.monotonic()
        while self._count[0] < count:
            waited = time.monotonic() - start
            if waited > timeout_s:
                raise RuntimeError(
                    f"the last stage posted {self._count[0]} graph executions in {timeout_s:.0f} "
                    f"s; this stage waits for {count}"
                )
            time.sleep(0 if waited < POSTED_SPIN_S else 5e-5)


class SampledTokens:
    """The latest sampled id of each state slot (int64 [num_slots], on the first stage; or the
    last stage's mapping of it over CUDA IPC, with the interprocess event it records). Shared
    between two processes, both sides keep a PostedCount: before its stream waits for the
    event, the first stage waits until the last has posted the ``awaited`` executions (all
    before the one it runs, which the stage worker sets)."""

    def __init__(self, ids: torch.Tensor, event=None, posted: PostedCount | None = None) -> None:
        self.ids, self.event, self.posted = ids, event, posted
        self.awaited = 0

    @classmethod
    def allocate(cls, num_slots: int, device) -> SampledTokens:
        return cls(torch.zeros(num_slots, dtype=torch.int64, device=device))

    def export(self) -> dict:
        """What another process on this GPU maps the table with (``open_peer``); creates the
        shared count."""
        self.posted = PostedCount.create()
        return {"ids": export_tensor(self.ids), "posted": self.posted.path}

    @classmethod
    def open_peer(cls, exported: dict) -> tuple[SampledTokens, bytes]:
        """The first stage's table and count mapped here, with a new interprocess event;
        returns it and the event's handle for the first stage (``wait_for``)."""
        event = torch.cuda.Event(interprocess=True)
        event.record()  # an interprocess event exists on the device once recorded
        posted = PostedCount(exported["posted"], create=False)
        posted.unlink()  # both sides mapped it: no name left behind
        return cls(open_tensor(exported["ids"]), event, posted), event.ipc_handle()

    def wait_for(self, event_handle: bytes) -> None:
        self.event = torch.cuda.Event.from_ipc_handle(self.ids.device, event_handle)

    def record(self, slots: list[int], token_ids: torch.Tensor) -> None:
        """token_ids [R] (any device; -1 where sampling failed) into their slots."""
        if slots:
            idx = to_device(slots, torch.long, self.ids.device)
            self.ids.index_copy_(0, idx, token_ids.to(self.ids.device).clamp(min=0))

    def post(self) -> None:
        """The writer (last stage, another process), after ``record``: marks the write."""
        if self.event is not None:
            self.event.record()

    def wait(self) -> None:
        """Orders this stream after the writes of a writer in another process for every
        execution before this one (``awaited``)."""
        if self.posted is not None:
            self.posted.wait_until(self.awaited)
        if self.event is not None:
            torch.cuda.current_stream(self.ids.device).wait_event(self.event)

    def fill(self, plan: StepPlan, token_ids: torch.Tensor, tables) -> None:
        """Writes each lookahead entry's token into the step's token ids [T] on the device
        (after the last stage's latest write, when it writes from another process)."""
        if not plan.lookahead:
            return
        self.wait()
        wanted = set(plan.lookahead)
        idx, slots, offset = [], [], 0
        for entry in plan.batch:
            if entry.req_id in wanted:
                idx.append(offset)
                slots.append(tables[entry.req_id].state_slot)
            offset += entry.num_tokens
        index = to_device(idx + slots, torch.long, token_ids.device).view(2, -1)
        token_ids.index_copy_(0, index[0], self.ids.to(token_ids.device).index_select(0, index[1]))


def take_samples(sampled: SampledTokens, plan: StepPlan, result: StageResult, tables):
    """The first stage, after the last stage of a lagged plan: the plan's sampled ids into
    its table (or, over CUDA IPC, this stream ordered after their write)."""
    if result.samples is not None:
        req_ids = [e.req_id for e in plan.batch if e.sample]
        sampled.record([tables[r].state_slot for r in req_ids], result.samples)
        result.samples = None
    sampled.wait()
    return result


def fill_tokens(sampled: SampledTokens | None, plan: StepPlan, token_ids, inputs, tables):
    """Lookahead entries' ids [T] on the device: from the table on the first stage (sampled),
    from the ids the first stage filled on a later one."""
    if sampled is not None:
        sampled.fill(plan, token_ids, tables)
    else:
        token_ids[: plan.num_tokens].copy_(inputs.token_ids)


def record_samples(result: StageResult, req_ids: list[str], rows: list, pending) -> None:
    """Waits for a sampling pass's host copy and files each request's token, logprobs or error
    (rows: the requests' SamplingRow, or the reason their parameters were refused)."""
    for req_id, row, outcome in zip(req_ids, rows, pending.result()):
        error = row if isinstance(row, str) else outcome.error
        if error is not None:  # one request's sampling fails alone
            log.warning("request %s could not sample: %s", req_id, error)
            result.errors[req_id] = error
            continue
        result.sampled[req_id] = outcome.token_id
        if outcome.logprobs is not None:
            result.logprobs[req_id] = outcome.logprobs
