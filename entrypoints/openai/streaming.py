"""Generations in flight over HTTP: their bookkeeping, and a response as one body or as SSE.

A response runs one engine request (``Run``) per choice (or best_of candidate) and prompt.
``Tracked`` keeps the server's pending count, time to first token, the gaps between tokens, token
counts and each engine request's metrics, and closes exactly once whatever ends the request (its
end, an abort, a client gone), counting how it ended; the response's ``Answer`` counts the HTTP
request once, whatever number of engine requests it ran.
``stream`` renders server-sent events: per run the chat role chunk and one chunk per engine
update (runs interleave, each chunk naming its choice), the usage chunk when asked for,
``[DONE]``; ``SSEResponse`` aborts the requests when the client goes away mid-stream, so their
pages go back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.responses import StreamingResponse

from dsv4ray.engine.core import RequestUpdate
from dsv4ray.engine.outputs import RequestOutput
from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.entrypoints.openai.edge import aborted, internal_error
from dsv4ray.entrypoints.openai.errors import APIError, refusal
from dsv4ray.entrypoints.openai.format import SSE_DONE, sse
from dsv4ray.entrypoints.openai.format import usage as format_usage
from dsv4ray.entrypoints.openai.metrics import STATUS_CLIENT_CLOSED

log = logging.getLogger("dsv4ray.serve")


class Answer:
    """The HTTP request a response's engine requests answer together: counted once in the
    requests metric, by the first of them to close (a stream's status is its first run's end:
    its headers went out with 200 before any run ended)."""

    def __init__(self, metrics, endpoint: str) -> None:
        self.metrics, self.endpoint = metrics, endpoint
        self.counted = False

    def done(self, status: int | str) -> None:
        if not self.counted:
            self.counted = True
            self.metrics.request_done(self.endpoint, status)


class Tracked:
    """One generation in flight: the pending count, timings and metrics, closed exactly once."""

    def __init__(self, server, answer: Answer, updates: AsyncIterator) -> None:
        """server: the OpenAIServer (its pending count and metrics); answer: the HTTP request
        this generation answers with the response's others."""
        self.server, self.answer, self.updates = server, answer, updates
        self.start = time.perf_counter()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.text = ""  # text sent so far (streams)
        self.closed = False
        server.num_pending += 1

    def on_update(self, update: RequestUpdate) -> None:
        if not update.token_ids:
            return
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
            self.server.metrics.first_token(now - self.start)
        else:
            self.server.metrics.inter_token(now - self.last_token_at)
        self.last_token_at = now

    def release(self, finished_reason: str | None = "error") -> bool:
        """Leaves the pending count and counts how the request ended (None: the engine refused
        it before it ran); True the first time."""
        if self.closed:
            return False
        self.closed = True
        self.server.num_pending -= 1
        if finished_reason is not None:
            self.server.metrics.finished(finished_reason)
        return True

    def close(self, status: int | str, output: RequestOutput | None = None) -> None:
        if output is not None:
            reason = output.finish_reason
        else:  # the client went away (abort, as vLLM counts it), else the server failed
            reason = "abort" if status == STATUS_CLIENT_CLOSED else "error"
        if not self.release(reason):
            return
        self.answer.done(status)
        if output is not None:
            num_generated = len(output.token_ids)
            tpot = None
            if num_generated > 1 and self.first_token_at is not None:
                tpot = (time.perf_counter() - self.first_token_at) / (num_generated - 1)
            self.server.metrics.tokens(
                len(output.prompt_token_ids), num_generated, output.metrics.num_cached_tokens, tpot
            )
            self.server.metrics.drafts(
                output.metrics.num_draft_tokens, output.metrics.num_accepted_draft_tokens
            )
            self.server.metrics.request_times(output.metrics)

    async def cancel(self) -> None:
        """The response ended before the request did (client gone): closing the engine stream
        aborts the request (synchronously: a second cancellation cannot interrupt it)."""
        if not self.closed:
            self.close(STATUS_CLIENT_CLOSED)
        await self.updates.aclose()


@dataclass
class Run:
    """One engine request of a response: a choice, or a best_of candidate. The leader of a
    prompt runs first; the others of that prompt start once it has its first token, so its
    prompt pages are in the prefix cache for them."""

    fmt: object  # its choice's format (entrypoints/openai/format.py)
    prompt_ids: list[int]
    params: SamplingParams
    leader: bool = True
    tracked: Tracked | None = None
    updates: AsyncIterator | None = None
    first: RequestUpdate | None = None


@dataclass
class StreamUsage:
    include: bool  # a usage chunk at the end
    continuous: bool  # the usage so far in every chunk
    num_prompt: int  # the prompts' tokens, each prompt counted once
    num_generated: int = 0  # every run's tokens so far
    outputs: list = field(default_factory=list)  # the runs' outputs as they finish
    leaders: list = field(default_factory=list)  # the leaders' outputs


class StreamAborted(Exception):
    """A run was aborted by the engine: the stream ends with the reason as an error event."""


async def last_output(tracked: Tracked, update: RequestUpdate, updates) -> RequestOutput:
    while True:
        tracked.on_update(update)
        if update.output is not None:
            return update.output
        update = await updates.__anext__()


async def stream(runs: list[Run], usage: StreamUsage):
    """SSE chunks of every run (interleaved as they come, each with its choice index), the
    usage chunk, ``[DONE]``. A failure after the headers went out, or an aborted run, becomes an
    error chunk (without internals) and ends every run."""
    fmt = runs[0].fmt
    merged = _merged(runs, usage)
    try:
        async for chunk in merged:
            yield chunk
        if usage.include:
            yield sse(fmt.usage_chunk(format_usage(usage.outputs, usage.leaders)))
    except StreamAborted as exc:
        _close_all(runs, 500)
        log.warning("stream %s aborted: %s", fmt.request_id, exc)
        yield sse(aborted(str(exc)).body())
    except APIError as exc:  # the engine became unavailable (entrypoints/remote_engine.py)
        _close_all(runs, exc.status)
        log.warning("stream %s failed: %s", fmt.request_id, exc.message)
        yield sse(exc.body())
    except ValueError as exc:  # a choice started in the stream refused by the engine
        _close_all(runs, 400)
        log.warning("stream %s: a choice was refused: %s", fmt.request_id, exc)
        yield sse(refusal(exc, runs[0].tracked.answer.endpoint).body())
    except Exception:
        log.exception("stream %s failed", fmt.request_id)
        _close_all(runs, 500)
        yield sse(internal_error(fmt.request_id).body())
    finally:
        await merged.aclose()  # its tasks stop reading the runs before their streams close
        for run in runs:
            await run.updates.aclose()  # an unfinished engine stream aborts its request
    yield SSE_DONE


def _close_all(runs: list[Run], status: int) -> None:
    for run in runs:
        run.tracked.close(status)  # no-op for a run that ended


async def _merged(runs: list[Run], usage: StreamUsage):
    if len(runs) == 1:
        async for chunk in _run_chunks(runs[0], usage):
            yield chunk
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(run: Run) -> None:
        try:
            async for chunk in _run_chunks(run, usage):
                await queue.put(chunk)
            await queue.put(None)
        except Exception as exc:  # handed to the consumer, which ends every run
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(run)) for run in runs]
    try:
        num_done = 0
        while num_done < len(runs):
            item = await queue.get()
            if item is None:
                num_done += 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _run_chunks(run: Run, usage: StreamUsage):
    tracked, fmt, update = run.tracked, run.fmt, run.first
    for chunk in fmt.start_chunks():
        yield sse(_with_usage(chunk, usage))
    if update is None:  # a choice the stream started without waiting for its first update
        update = await run.updates.__anext__()
    while True:
        tracked.on_update(update)
        output = update.output
        if output is not None and output.finish_reason == "abort":
            raise StreamAborted(output.error)
        text = update.text
        if output is not None and output.text.startswith(tracked.text + text):
            text = output.text[len(tracked.text) :]  # what the decoder held back, if any
        tracked.text += text
        usage.num_generated += len(update.token_ids)
        carries = fmt.return_token_ids or fmt.num_top is not None
        if text or output is not None or (carries and update.token_ids):
            chunk = fmt.chunk(text, update.token_ids, output, update.logprobs)
            if chunk is not None:  # None: the format holds all of it back for now
                yield sse(_with_usage(chunk, usage))
        if output is not None:
            usage.outputs.append(output)
            if run.leader:
                usage.leaders.append(output)
            tracked.close(200, output)
            return
        update = await run.updates.__anext__()


def _with_usage(chunk: dict, usage: StreamUsage) -> dict:
    """A chunk with the usage so far (``stream_options.continuous_usage_stats``)."""
    if not usage.continuous:
        return chunk
    total = usage.num_prompt + usage.num_generated
    so_far = {"prompt_tokens": usage.num_prompt, "completion_tokens": usage.num_generated,
              "total_tokens": total}  # fmt: skip
    return {**chunk, "usage": so_far}


class SSEResponse(StreamingResponse):
    """A stream that always releases its request: Starlette does not close the body iterator
    when the client goes away while a chunk is being sent, so ``cleanup`` aborts it."""

    def __init__(self, content, cleanup, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                await self._cleanup()
