"""One generation in flight over HTTP: its bookkeeping, and its answer as one body or as SSE.

``Tracked`` keeps the server's pending count, time to first token, the gaps between tokens, token
counts and the request's metrics, and closes exactly once whatever ends the request (its end, an
abort, a client gone), counting how it ended.
``stream`` renders server-sent events: the chat role chunk, one chunk per engine update, the
usage chunk when asked for, ``[DONE]``; ``SSEResponse`` aborts the request when the client goes
away mid-stream, so its pages go back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse

from dsv4ray.engine.core import RequestUpdate
from dsv4ray.engine.outputs import RequestOutput
from dsv4ray.entrypoints.openai.edge import aborted, internal_error
from dsv4ray.entrypoints.openai.format import SSE_DONE, sse
from dsv4ray.entrypoints.openai.metrics import STATUS_CLIENT_CLOSED

log = logging.getLogger("dsv4ray.serve")


class Tracked:
    """One generation in flight: the pending count, timings and metrics, closed exactly once."""

    def __init__(self, server, endpoint: str, updates: AsyncIterator) -> None:
        """server: the OpenAIServer (its pending count and metrics)."""
        self.server, self.endpoint, self.updates = server, endpoint, updates
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
        self.server.metrics.request_done(self.endpoint, status)
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


async def last_output(tracked: Tracked, update: RequestUpdate, updates) -> RequestOutput:
    while True:
        tracked.on_update(update)
        if update.output is not None:
            return update.output
        update = await updates.__anext__()


async def stream(tracked: Tracked, fmt, update: RequestUpdate, updates, usage: tuple):
    """SSE chunks: the chat role chunk, one chunk per engine update, usage, ``[DONE]``.
    usage: (a usage chunk at the end, the usage so far in every chunk, the prompt's tokens). A
    failure after the headers went out becomes an error chunk (without internals), then
    ``[DONE]``."""
    try:
        async for chunk in _stream_chunks(tracked, fmt, update, updates, usage):
            yield chunk
    except Exception:
        log.exception("stream %s failed", fmt.request_id)
        tracked.close(500)
        yield sse(internal_error(fmt.request_id).body())
    finally:
        await updates.aclose()  # an unfinished engine stream aborts its request
    yield SSE_DONE


async def _stream_chunks(tracked: Tracked, fmt, update: RequestUpdate, updates, usage: tuple):
    include_usage, continuous, num_prompt = usage
    num_generated = 0
    for chunk in fmt.start_chunks():
        yield sse(_with_usage(chunk, continuous, num_prompt, 0))
    while True:
        tracked.on_update(update)
        output = update.output
        if output is not None and output.finish_reason == "abort":
            tracked.close(500)
            log.warning("stream %s aborted: %s", fmt.request_id, output.error)
            yield sse(aborted(output.error).body())
            return
        text = update.text
        if output is not None and output.text.startswith(tracked.text + text):
            text = output.text[len(tracked.text) :]  # what the decoder held back, if any
        tracked.text += text
        num_generated += len(update.token_ids)
        carries = fmt.return_token_ids or fmt.num_top is not None
        if text or output is not None or (carries and update.token_ids):
            chunk = fmt.chunk(text, update.token_ids, output, update.logprobs)
            yield sse(_with_usage(chunk, continuous, num_prompt, num_generated))
        if output is not None:
            if include_usage:
                yield sse(fmt.usage_chunk(output))
            tracked.close(200, output)
            return
        update = await updates.__anext__()


def _with_usage(chunk: dict, continuous: bool, num_prompt: int, num_generated: int) -> dict:
    """A chunk with the usage so far (``stream_options.continuous_usage_stats``)."""
    if not continuous:
        return chunk
    total = num_prompt + num_generated
    usage = {"prompt_tokens": num_prompt, "completion_tokens": num_generated, "total_tokens": total}
    return {**chunk, "usage": usage}


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
            await self.body_iterator.aclose()
            await self._cleanup()
