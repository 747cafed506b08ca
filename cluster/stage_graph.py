"""StageGraph: one Ray compiled graph over a chain of stage actors, and its /dev/shm files.

The graph sends each input to every actor and passes each actor's result to the next:
``actors[0].first(x)``, then ``actors[i].prepare(x)``, ``actors[i].receive(prev)`` and
``actors[i].next(ready, rows)`` (a stage readies its step while the one before computes), then
(speculative decoding) the draft actor's ``next(ready, prev)`` (``ready`` from its ``prepare(x)``,
run while the stages compute), whose held proposals (``proposals(x)``, read first) every stage's
first call also takes, and the last stage's ``settle(drafted)`` (its read-back, once the draft
actor launched) gives the output; else the last result is the output. On
CPU every channel is shared memory with two semaphore files in /dev/shm that Ray removes only
when a process that used the channel exits cleanly (see channel_files.py). The graph therefore
records, once it has run one warm-up input, every channel file that the driver or any of its
actors maps, and ``teardown`` removes them: no process opens a torn-down graph's channels again,
whether its actors live on, exited, or were killed. The record is also written to a ledger (and
rewritten while the graph runs when its channels grew), so that the next build on the machine
removes the files of a graph whose driver was killed.
"""

from __future__ import annotations

import logging
import threading
import time

import ray
from ray.dag import InputNode

from dsv4ray.actors.channel_wait import poll
from dsv4ray.cluster.channel_files import (
    BUILD_LOCK,
    actor_channel_files,
    drop_ledger,
    mapped_channel_files,
    remove_channel_files,
    sweep_dead_graphs,
    write_ledger,
)

log = logging.getLogger("dsv4ray.pipeline")

TEARDOWN_TIMEOUT_S = 20.0
# how often a running graph adds the channel files its actors grew to its ledger (a driver
# killed outright leaves at most this long's growth unrecorded)
LEDGER_REFRESH_S = 10.0


class StageGraph:
    def __init__(
        self,
        actors: list,
        depth: int,
        timeout_s: float,
        warmup,
        devices: list[str | None] | None = None,
        draft=None,
        local_pids: list[int] = (),
        buffer_bytes: int | None = None,
        take: bool = False,
        poll: bool = False,
    ) -> None:
        """depth: inputs in flight at most; timeout_s: bound on a submit and on the warm-up;
        warmup: an input every actor accepts; devices: each stage's GPU (None on CPU): tensors
        go over NCCL between different GPUs, through host memory between stages that share
        one; draft: an actor after the last stage, or None; local_pids: the processes of the
        actors on this machine (their channel files are recorded again at teardown);
        buffer_bytes: the channels' first buffer size (a larger message grows a channel into
        new files); take: the last result goes back to the first stage's ``take`` (overlap
        scheduling over several stages); poll: ``get`` sleeps between looks at an output
        instead of letting Ray spin on a core until it arrives. Raises whatever compiling or the
        warm-up raised (a dead actor), after removing the channel files made so far."""
        self.actors, self.timeout_s = actors + ([draft] if draft is not None else []), timeout_s
        self.dag, self.channel_files, self.local_pids = None, [], list(local_pids)
        self.poll, self.ledger = poll, None
        sweep_dead_graphs()  # the files of graphs whose driver was killed
        with BUILD_LOCK:  # no other graph of this process maps channel files meanwhile
            before = mapped_channel_files()
            try:
                devices = devices or [None] * len(actors)
                self.dag = self._compile(actors, depth, devices, draft, buffer_bytes, take)
                ray.get(self.dag.execute(warmup), timeout=timeout_s)  # channels map on first use
            except BaseException:
                self.channel_files = self._channel_files(before)
                self.teardown()
                raise
            self.channel_files = self._channel_files(before)
        self.ledger = write_ledger(self.channel_files)
        self.next_refresh = time.monotonic() + LEDGER_REFRESH_S
        log.debug("compiled graph: %d channel files", len(self.channel_files))

    def _compile(self, stages: list, depth: int, devices: list, draft, buffer_bytes: int | None,
                 take: bool):  # fmt: skip
        with InputNode() as data:
            # Every later stage readies its step (``prepare``) before it receives the stage
            # before's rows: a receive over NCCL blocks until the sender's kernels finished.
            # Ray places an NCCL receive in its actor's schedule as soon as the send can run
            # and takes the rest by task order, so the prepares are bound first, and the
            # receive is a node of its own (an NCCL read may have no other input).
            # the draft actor's proposals of the steps before: every stage writes them into
            # the plan's pending drafts (the driver committed those steps while they drafted);
            # then the draft actor readies its pass while the stages compute
            args = (data,) if draft is None else (data, draft.proposals.bind(data))
            draft_ready = draft.prepare.bind(data) if draft is not None else None
            ready = [actor.prepare.bind(*args) for actor in stages[1:]]
            out = stages[0].first.bind(*args)
            for i, actor in enumerate(stages[1:], 1):
                rows = actor.receive.bind(_transport(out, devices[i - 1], devices[i]))
                out = actor.next.bind(ready[i - 1], rows)
            if draft is not None:  # on the last stage's GPU; then the stage reads back
                drafted = draft.next.bind(draft_ready, _transport(out, devices[-1], devices[-1]))
                out = stages[-1].settle.bind(drafted)
            if take:
                out = stages[0].take.bind(data, _transport(out, devices[-1], devices[0]))
        return out.experimental_compile(
            _max_inflight_executions=depth,
            _submit_timeout=self.timeout_s,
            _buffer_size_bytes=buffer_bytes,
        )

    def _channel_files(self, before: set[str]) -> list[str]:
        """The driver's new channel files and those every live actor maps (a dead actor's
        channels are mapped by its neighbours or the driver as well)."""
        files = (mapped_channel_files() - before) | actor_channel_files(self.actors)
        return sorted(files)

    def execute(self, data):
        return self.dag.execute(data)

    def get(self, ref, timeout_s: float):
        """The output of an ``execute``. With ``poll`` (CPU pipelines) the output is looked at
        without waiting and the thread sleeps between looks (actors/channel_wait.py: Ray's own
        read spins a core that the stages computing the output need), then Ray's read returns
        it, or raises its error or timeout."""
        deadline = time.monotonic() + timeout_s
        if self.poll:
            _wait_polling(ref, deadline)
        out = ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0))
        if time.monotonic() >= self.next_refresh:
            self.refresh_ledger()
        return out

    def refresh_ledger(self) -> None:
        """Adds the channel files the graph's actors grew since the last look to its ledger."""
        self.next_refresh = time.monotonic() + LEDGER_REFRESH_S
        before = len(self.channel_files)
        self.record_grown_channels()
        if len(self.channel_files) > before:
            self.ledger = write_ledger(self.channel_files, path=self.ledger) or self.ledger

    def record_grown_channels(self) -> None:
        """Adds the channel files the graph's actors on this machine map now (channels that
        grew after the build), while their processes still exist."""
        grown = set().union(*(mapped_channel_files(pid) for pid in self.local_pids))
        self.channel_files = sorted(set(self.channel_files) | grown)

    def teardown(self) -> None:
        """Stops the graph and removes its channel files. Ray's teardown can wait without end
        for a live actor's loop once another actor of the graph died (the live one never
        sees the dead one's channels close); after TEARDOWN_TIMEOUT_S the actors are killed,
        which ends that wait."""
        self.record_grown_channels()
        if self.dag is not None:
            waiter = threading.Thread(target=self._teardown_dag, daemon=True)
            waiter.start()
            waiter.join(TEARDOWN_TIMEOUT_S)
            if waiter.is_alive():
                log.warning("graph teardown stuck %.0f s: killing its actors", TEARDOWN_TIMEOUT_S)
                kill_actors(self.actors)
                waiter.join(TEARDOWN_TIMEOUT_S)
            self.dag = None
        remove_channel_files(self.channel_files)
        self.channel_files = []
        drop_ledger(self.ledger)
        self.ledger = None

    def _teardown_dag(self) -> None:
        try:
            self.dag.teardown()
        except Exception as exc:  # a graph with a dead actor may not tear down cleanly
            log.warning("compiled graph teardown: %s", describe(exc))


def _wait_polling(ref, deadline: float) -> None:
    """Returns once ref's output is read into the graph's buffer, the deadline passed, or the
    read failed otherwise (``ray.get`` then raises that failure as it would have)."""
    try:  # timeout 0: one look at the channel; a later ray.get finds the buffered output
        poll(lambda: ref._dag._execute_until(ref._execution_index, ref._channel_index, 0),
             deadline)  # fmt: skip
    except Exception:  # the deadline, a closed channel or a dead actor: ray.get reports it
        return


def _transport(node, src: str | None, dst: str | None):
    """NCCL between two GPUs; shared memory between actors that share one (two NCCL ranks cannot
    live on one device: their rows go through a device link and the channel carries its ticket,
    worker/graphs/device_link.py); plain shared memory on CPUs."""
    if src is None or dst is None:
        return node
    return node.with_tensor_transport(transport="nccl" if src != dst else "shm")


def kill_actors(actors: list) -> None:
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception as exc:  # already gone
            log.debug("kill: %s", describe(exc))


def describe(exc: BaseException) -> str:
    """The exception's type and first line, short enough for a log line or an error reply."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
