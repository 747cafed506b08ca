"""AsyncEngine: per-request token streams for asyncio callers (the Serve app, the CLI).

The EngineCore runs on one background thread: it takes commands (add, abort) from a queue, steps
while requests are unfinished, and hands each update to the asyncio loop of the caller that owns
the request. A caller that stops iterating (a client that disconnected) aborts its request, so
its pages return to the pool. While idle it pings the pipeline's actors every ``LIVENESS_S``
seconds and rebuilds a pipeline whose stage died, before the next request needs it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator

from dsv4ray.engine.config import EngineConfig
from dsv4ray.engine.core import RequestUpdate
from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.entrypoints.engines import build_engine_core, engine_config

LIVENESS_S = 5.0  # idle engines check their actors this often
SHUT_DOWN = "the engine is shut down; start a new one to generate"

log = logging.getLogger("dsv4ray.async")


class AsyncEngine:
    def __init__(
        self,
        model: str | None = None,
        config: EngineConfig | None = None,
        placement=None,
        **options,
    ) -> None:
        """placement: a Ray placement group for the stage actors (bundle i = stage i)."""
        self.core = build_engine_core(config or engine_config(model, **options), placement)
        self.config = self.core.config
        self._commands: queue.Queue = queue.Queue()
        # per request id: its caller's loop and stream, or, once the caller left, the event
        # that the engine thread sets when it has aborted the request
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue | asyncio.Event]]
        self._streams = {}
        self._ids = itertools.count()
        self._closed = False  # shutdown began: calls are refused
        self._stopped = threading.Event()
        self._next_liveness = time.monotonic() + LIVENESS_S
        self._thread = threading.Thread(target=self._loop, name="dsv4ray-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def describe(self) -> dict:
        """Where the stages run and how many tokens their pools hold (fixed once built)."""
        return self.core.describe()

    # ------------------------------------------------------------------ caller side
    async def generate(
        self, prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestUpdate]:
        """Yields one RequestUpdate per step that produced tokens; the last has ``output``.

        ValueError (bad prompt, too long, ...) is raised before the first update.
        """
        req_id = request_id or self._new_id()
        ids = self.core.prompt_ids(prompt)
        if self._closed:
            raise RuntimeError(SHUT_DOWN)
        await self._released(req_id)
        if req_id in self._streams:  # the running request's stream stays its own
            raise ValueError(f"request id {req_id!r} is already in use")
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[req_id] = (loop, stream)
        try:
            await self._call("add", req_id, ids, params or SamplingParams())
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):  # the add may have run all the same
                self._close(req_id, loop)
            else:
                self._streams.pop(req_id, None)
            raise
        finished = False
        try:
            while True:
                update: RequestUpdate = await stream.get()
                if update.output is not None:  # the id is free once the end is handed out
                    finished = True
                    self._streams.pop(req_id, None)
                yield update
                if finished:
                    return
        finally:  # a finished stream's id may already serve a new request: not touched
            if not finished:
                self._close(req_id, loop)

    def _new_id(self) -> str:
        """An id for a caller that gave none: never one a caller's request holds."""
        while (req_id := f"req-{next(self._ids)}") in self._streams:
            pass
        return req_id

    def _close(self, req_id: str, loop: asyncio.AbstractEventLoop) -> None:
        """A stream its caller left: the id stays taken, and updates the engine still makes for
        it go nowhere, until the engine thread has aborted the request (``_apply``); a request
        that reuses the id meanwhile waits for that instead of receiving them."""
        if self._closed:  # every request was aborted at shutdown: nothing runs under the id
            self._streams.pop(req_id, None)
            return
        self._streams[req_id] = (loop, asyncio.Event())
        self._commands.put(("abort", req_id, None))

    async def _released(self, req_id: str) -> None:
        """Returns once req_id is not held by a stream its caller left (``_close``)."""
        while (entry := self._streams.get(req_id)) is not None and isinstance(
            entry[1], asyncio.Event
        ):
            if self._closed:  # the engine thread that would release it is gone
                raise RuntimeError(SHUT_DOWN)
            if entry[0] is asyncio.get_running_loop():
                await entry[1].wait()
            else:  # an event of another caller's loop cannot be awaited here
                await asyncio.sleep(0.01)

    async def abort(self, request_id: str) -> None:
        await self._call("abort", request_id)

    async def stats(self) -> dict:
        return await self._call("stats")

    def _call(self, kind: str, *args):
        if self._closed:
            raise RuntimeError(SHUT_DOWN)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((kind, *args, future))
        return asyncio.wrap_future(future)

    def shutdown(self) -> None:
        """Ends every open stream with an aborted output (the engine thread aborts what still
        runs), stops the thread and the pipeline; later calls raise RuntimeError. Calls again
        do nothing."""
        if self._closed:
            return
        self._closed = True
        self._commands.put(("stop", None))  # after every command already queued
        self._thread.join(timeout=30)
        self._stopped.set()  # a thread stuck in a step stops at its end
        if not self._thread.is_alive():  # it ended every stream, unless it had died before
            for update in self.core.abort_all(SHUT_DOWN):
                self._deliver(update)
        self.core.shutdown()
        self._refuse_queued()
        self._release_closed()

    def _release_closed(self) -> None:
        """Ids of streams their callers left, which no engine thread will release now."""
        for req_id, (loop, target) in list(self._streams.items()):
            if isinstance(target, asyncio.Event):
                del self._streams[req_id]
                _post(loop, target.set)

    def _refuse_queued(self) -> None:
        """Calls the stopped engine thread never took answer RuntimeError."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            future = command[-1]
            if isinstance(future, concurrent.futures.Future) and not future.done():
                future.set_exception(RuntimeError(SHUT_DOWN))

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        while not self._stopped.is_set():
            self._drain(block=not self.core.has_unfinished())
            if self._stopped.is_set():
                break
            if not self.core.has_unfinished():
                self._check_liveness()
            if self.core.has_unfinished():
                try:
                    updates = self.core.step()
                except Exception:  # keep serving: end what cannot go on (details in the log)
                    log.exception("engine step failed")
                    updates = self.core.abort_all("the engine failed while the request ran")
                for update in updates:
                    self._deliver(update)

    def _check_liveness(self) -> None:
        now = time.monotonic()
        if now < self._next_liveness:
            return
        try:
            updates = self.core.check_liveness()
        except Exception:  # the next check (or the next request's step) tries again
            log.exception("pipeline liveness check failed")
            updates = []
        self._next_liveness = time.monotonic() + LIVENESS_S
        for update in updates:
            self._deliver(update)

    def _drain(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._run(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run(self, command: tuple) -> None:
        kind, *args = command
        future = args.pop() if args and isinstance(args[-1], concurrent.futures.Future) else None
        if future is not None and not future.set_running_or_notify_cancel():
            return  # the caller was cancelled before the engine got here: nobody waits
        try:
            result = self._apply(kind, args)
        except Exception as exc:
            if future is not None:
                future.set_exception(exc)
            return
        if future is not None:
            future.set_result(result)

    def _apply(self, kind: str, args: list):
        if kind == "add":
            req_id, ids, params = args
            self.core.add_request(req_id, ids, params)
        elif kind == "abort":
            out = self.core.abort(args[0], "aborted by the caller")
            if out is not None:
                self._deliver(RequestUpdate(args[0], output=out))
            target = self._streams.get(args[0])
            if target is not None and isinstance(target[1], asyncio.Event):  # a closed stream
                del self._streams[args[0]]
                _post(target[0], target[1].set)
        elif kind == "stats":
            return self.core.stats()
        elif kind == "stop":
            try:
                for update in self.core.abort_all(SHUT_DOWN):
                    self._deliver(update)
            finally:  # the thread ends whatever delivering did
                self._stopped.set()
        return None

    def _deliver(self, update: RequestUpdate) -> None:
        target = self._streams.get(update.request_id)
        if update.output is not None:
            self.core.pop_output(update.request_id)
        if target is not None and isinstance(target[1], asyncio.Queue):  # else its caller left
            loop, stream = target
            if not _post(loop, stream.put_nowait, update):  # the caller's loop is closed
                if update.output is None:  # still running: left, as ``_close`` leaves one
                    self._streams[update.request_id] = (loop, asyncio.Event())
                    self._commands.put(("abort", update.request_id, None))
                else:
                    self._streams.pop(update.request_id, None)


def _post(loop: asyncio.AbstractEventLoop, callback, *args) -> bool:
    """callback(*args) on loop's thread; False when that loop is closed (its caller is gone:
    the engine thread must not die of it)."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        return False
    return True
