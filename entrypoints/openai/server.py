"""OpenAIServer: the OpenAI-compatible HTTP API over an engine, as a plain class.

The Serve deployment (entrypoints/serve.py) only forwards Starlette requests to ``handle``; tests
and other hosts can drive the same class. The engine is reached through ``EngineClient``, the small
protocol that ``AsyncEngine`` implements. Routes: ``POST /v1/completions``,
``POST /v1/chat/completions`` (JSON or server-sent events), ``GET /v1/models[/{id}]``,
``GET /health`` (no key needed) and ``GET /v1/dsv4ray/stats`` (engine counters: running and
waiting requests, free pages). Who may call is cluster/openai_edge.py's rule (the key, else local
clients only). Every failure is answered with OpenAI's error body and the server keeps serving;
a 5xx names what failed, never internals. A client that disconnects mid-stream aborts its
request, whose pages go back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from dsv4ray.engine.config import EngineConfig
from dsv4ray.engine.core import RequestUpdate
from dsv4ray.engine.outputs import RequestOutput
from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.entrypoints.openai.edge import (
    aborted,
    check_caller,
    internal_error,
    new_error_id,
    read_body,
)
from dsv4ray.entrypoints.openai.format import (
    SSE_DONE,
    ChatFormat,
    CompletionFormat,
    TokenBytes,
    sse,
)
from dsv4ray.entrypoints.openai.metrics import STATUS_CLIENT_CLOSED, ServeMetrics
from dsv4ray.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    parse_request,
)

log = logging.getLogger("dsv4ray.serve")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
STATS_POLL_S = 1.0
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


class EngineClient(Protocol):
    """What the server needs from an engine (AsyncEngine provides it)."""

    config: EngineConfig
    tokenizer: object  # dsv4ray.model.tokenizer.Tokenizer
    max_model_len: int

    def generate(
        self, prompt, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestUpdate]: ...

    async def stats(self) -> dict: ...


@dataclass(frozen=True)
class ServerOptions:
    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_pending_requests: int = 256  # generation requests in the replica before 503s


class OpenAIServer:
    def __init__(self, engine: EngineClient, options: ServerOptions, metrics: ServeMetrics):
        self.engine, self.options, self.metrics = engine, options, metrics
        self.num_pending = 0
        self.token_bytes = TokenBytes(engine.config.model)
        self.created = int(time.time())
        self._poller: asyncio.Task | None = None
        self._routes = {
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/chat/completions"): self._chat,
            ("GET", "/v1/models"): self._models,
            ("GET", "/v1/dsv4ray/stats"): self._stats,
            ("GET", "/health"): self._health,
        }

    # ------------------------------------------------------------------ routing
    async def handle(self, request: Request) -> Response:
        path = _route_path(request)
        if self._poller is None:
            self._poller = asyncio.create_task(self._poll_stats())
        try:
            check_caller(request.headers, self.options.api_key, path)
            response = await self._dispatch(request.method, path, request)
        except APIError as err:
            return self._error_response(path, err)
        except Exception:  # a bug: answer it like the API would (no internals) and keep serving
            error_id = new_error_id()
            log.exception("%s %s failed (request %s)", request.method, path, error_id)
            return self._error_response(path, internal_error(error_id))
        if path not in GENERATION_PATHS:  # generations count themselves when they end
            self.metrics.request_done(self._endpoint(path), response.status_code)
        return response

    def _endpoint(self, path: str) -> str:
        """The metrics tag: a known route, never a client-chosen path (bounded cardinality)."""
        if path.startswith("/v1/models/"):
            return "/v1/models/{id}"
        return path if any(p == path for _, p in self._routes) else "other"

    def _error_response(self, path: str, err: APIError) -> Response:
        if err.status >= 500:
            log.warning("%s: %s", path, err.message)
        self.metrics.request_done(self._endpoint(path), err.status)
        headers = {"Retry-After": "1"} if err.status == 503 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    async def _dispatch(self, method: str, path: str, request: Request) -> Response:
        route = self._routes.get((method, path))
        if route is not None:
            return await route(request)
        if path.startswith("/v1/models/") and method == "GET":
            return JSONResponse(self._model_card(path.removeprefix("/v1/models/")))
        if any(p == path for _, p in self._routes):
            raise APIError(405, f"method {method} is not allowed on {path}", code="bad_method")
        raise APIError(404, f"no such route: {method} {path}", code="not_found")

    def _check_model(self, model: str) -> None:
        if model != self.options.served_model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves "
                f"{self.options.served_model_name!r}",
                param="model",
                code="model_not_found",
            )

    # ------------------------------------------------------------------ small routes
    async def _models(self, request: Request) -> Response:
        card = self._model_card(self.options.served_model_name)
        return JSONResponse({"object": "list", "data": [card]})

    def _model_card(self, model: str) -> dict:
        self._check_model(model)
        return {
            "id": model,
            "object": "model",
            "created": self.created,
            "owned_by": "dsv4ray",
            "max_model_len": self.engine.max_model_len,
        }

    async def _health(self, request: Request) -> Response:
        try:
            await asyncio.wait_for(self.engine.stats(), timeout=30)
        except Exception:
            log.exception("health check: the engine does not answer")
            raise APIError(503, "the engine does not answer", "server_error") from None
        return JSONResponse({"status": "ok"})

    async def _stats(self, request: Request) -> Response:
        stats = await self.engine.stats()
        return JSONResponse({**stats, "num_pending_http_requests": self.num_pending})

    def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()

    async def _poll_stats(self) -> None:
        while True:
            try:
                self.metrics.engine_stats(await self.engine.stats(), self.num_pending)
            except Exception:
                log.exception("engine stats poll failed")
            await asyncio.sleep(STATS_POLL_S)

    # ------------------------------------------------------------------ generation
    async def _completions(self, request: Request) -> Response:
        body = await read_body(request, self.options.max_body_bytes)
        req = parse_request(CompletionRequest, body)
        self._check_model(req.model)
        if isinstance(req.prompt, str):
            prompt_ids = _tokenize(self.engine.tokenizer.encode, req.prompt, "prompt")
        else:
            prompt_ids = list(req.prompt)
        max_tokens = self._max_tokens(
            req.max_tokens, len(prompt_ids), "prompt", COMPLETIONS_DEFAULT_MAX_TOKENS
        )
        params = req.sampling_params(max_tokens, req.logprobs)
        fmt = CompletionFormat(
            self.options.served_model_name, self.token_bytes, req.logprobs, req.return_token_ids
        )
        return await self._generate("/v1/completions", prompt_ids, params, req, fmt)

    async def _chat(self, request: Request) -> Response:
        body = await read_body(request, self.options.max_body_bytes)
        req = parse_request(ChatCompletionRequest, body)
        self._check_model(req.model)
        encode_chat = self.engine.tokenizer.encode_chat
        prompt_ids = _tokenize(encode_chat, req.template_messages(), "messages")
        max_tokens = self._max_tokens(req.requested_max_tokens, len(prompt_ids), "messages", None)
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        params = req.sampling_params(max_tokens, num_top)
        fmt = ChatFormat(
            self.options.served_model_name, self.token_bytes, num_top, req.return_token_ids
        )
        return await self._generate("/v1/chat/completions", prompt_ids, params, req, fmt)

    def _max_tokens(self, asked: int | None, prompt_len: int, field: str, default: int | None):
        """The request's max_tokens, checked against the context; None = up to the context."""
        context = self.engine.max_model_len
        if asked is not None and asked <= 0:
            raise bad_request(f"max_tokens must be at least 1, got {asked}", "max_tokens")
        if prompt_len >= context:
            raise bad_request(
                f"the prompt has {prompt_len} tokens; this model's context is {context} tokens "
                "and must leave room for at least one new token",
                field,
            )
        room = context - prompt_len
        if asked is not None and asked > room:
            raise bad_request(
                f"this model's context is {context} tokens; the request asks for {prompt_len} "
                f"prompt + {asked} completion tokens",
                "max_tokens",
            )
        return min(asked or default or room, room)

    async def _generate(self, endpoint, prompt_ids, params, req, fmt) -> Response:
        if self.num_pending >= self.options.max_pending_requests:
            raise APIError(
                503, "the server is overloaded; retry later", "server_error", code="overloaded"
            )
        updates = self.engine.generate(prompt_ids, params, request_id=fmt.request_id)
        tracked = _Tracked(self, endpoint, updates)
        try:
            first = await updates.__anext__()  # engine-side ValueErrors come before any token
        except ValueError as exc:
            tracked.release()  # answered as a 400 by handle
            field = "prompt" if endpoint == "/v1/completions" else "messages"
            raise bad_request(str(exc), field) from None
        except BaseException:
            await updates.aclose()
            tracked.close(STATUS_CLIENT_CLOSED)
            raise
        if req.stream:
            body = _stream(tracked, fmt, first, updates, req.include_usage)
            return SSEResponse(body, cleanup=tracked.cancel, media_type="text/event-stream")
        try:
            output = await _last_output(tracked, first, updates)
        except BaseException:
            await updates.aclose()
            tracked.close(STATUS_CLIENT_CLOSED)
            raise
        if output.finish_reason == "abort":
            tracked.release()
            log.warning("request %s aborted: %s", fmt.request_id, output.error)
            raise aborted(output.error)
        tracked.close(200, output)
        return JSONResponse(fmt.response(output))


class _Tracked:
    """One generation in flight: the pending count, timings and metrics, closed exactly once."""

    def __init__(self, server: OpenAIServer, endpoint: str, updates: AsyncIterator) -> None:
        self.server, self.endpoint, self.updates = server, endpoint, updates
        self.start = time.perf_counter()
        self.first_token_at: float | None = None
        self.text = ""  # text sent so far (streams)
        self.closed = False
        server.num_pending += 1

    def on_update(self, update: RequestUpdate) -> None:
        if self.first_token_at is None and update.token_ids:
            self.first_token_at = time.perf_counter()
            self.server.metrics.first_token(self.first_token_at - self.start)

    def release(self) -> bool:
        """Leaves the pending count; True the first time."""
        if self.closed:
            return False
        self.closed = True
        self.server.num_pending -= 1
        return True

    def close(self, status: int | str, output: RequestOutput | None = None) -> None:
        if not self.release():
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

    async def cancel(self) -> None:
        """The response ended before the request did (client gone): closing the engine stream
        aborts the request (synchronously: a second cancellation cannot interrupt it)."""
        if not self.closed:
            self.close(STATUS_CLIENT_CLOSED)
        await self.updates.aclose()


async def _last_output(tracked: _Tracked, update: RequestUpdate, updates) -> RequestOutput:
    while True:
        tracked.on_update(update)
        if update.output is not None:
            return update.output
        update = await updates.__anext__()


async def _stream(tracked: _Tracked, fmt, update: RequestUpdate, updates, include_usage: bool):
    """SSE chunks: the chat role chunk, one chunk per engine update, usage, ``[DONE]``. A
    failure after the headers went out becomes an error chunk (without internals), then
    ``[DONE]``."""
    try:
        async for chunk in _stream_chunks(tracked, fmt, update, updates, include_usage):
            yield chunk
    except Exception:
        log.exception("stream %s failed", fmt.request_id)
        tracked.close(500)
        yield sse(internal_error(fmt.request_id).body())
    finally:
        await updates.aclose()  # an unfinished engine stream aborts its request
    yield SSE_DONE


async def _stream_chunks(tracked: _Tracked, fmt, update: RequestUpdate, updates, include_usage):
    for chunk in fmt.start_chunks():
        yield sse(chunk)
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
        if text or output is not None or (fmt.return_token_ids and update.token_ids):
            yield sse(fmt.chunk(text, update.token_ids, output))
        if output is not None:
            if include_usage:
                yield sse(fmt.usage_chunk(output))
            tracked.close(200, output)
            return
        update = await updates.__anext__()


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


def _tokenize(encode, text, field: str) -> list[int]:
    """A template that cannot render the messages, or text the tokenizer refuses (a lone
    surrogate from a JSON escape), is the request's fault: 400."""
    try:
        return encode(text)
    except Exception as exc:
        raise bad_request(f"{field} could not be tokenized: {exc}", field) from None


def _route_path(request: Request) -> str:
    path, root = request.scope.get("path", "/"), request.scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    return "/" + path.strip("/") if path.strip("/") else "/"
