"""OpenAIServer: the OpenAI-compatible HTTP API over an engine, as a plain class.

``OpenAIServer(engine, options, metrics).app`` is a FastAPI application (built by ``api.py``): the
Serve deployment (entrypoints/serve.py) hands it to ``@serve.ingress``; tests and other hosts
drive it with any ASGI client. The engine is reached through ``EngineClient``, the small protocol
that ``AsyncEngine`` implements. Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``
(JSON or server-sent events), ``GET /v1/models[/{id}]``, ``GET /health`` (no key needed),
``GET /v1/dsv4ray/stats`` (engine counters: running and waiting requests, free pages),
``GET /metrics`` (vLLM's series, Prometheus text; no key needed), ``POST /tokenize`` and
``POST /detokenize`` (vLLM's; a prompt or messages become exactly the ids generation would feed
the engine). Who may call is ``edge.py``'s rule (the key, else local clients only). Every
failure is answered with OpenAI's error body and the server keeps serving; a 5xx names what
failed, never internals. A client that disconnects aborts its request, whose pages go back: a
stream learns it from its sends, an answer sent whole from the ASGI server's disconnect message.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from dsv4ray.config import ModelConfig
from dsv4ray.engine.config import EngineConfig
from dsv4ray.engine.core import RequestUpdate
from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.entrypoints.openai.api import build_api
from dsv4ray.entrypoints.openai.edge import aborted, read_body, unless_client_gone
from dsv4ray.entrypoints.openai.errors import APIError, bad_request, refusal
from dsv4ray.entrypoints.openai.format import (
    ChatFormat,
    CompletionFormat,
    TextOffsets,
    TokenBytes,
)
from dsv4ray.entrypoints.openai.format import usage as format_usage
from dsv4ray.entrypoints.openai.metrics import STATUS_CLIENT_CLOSED, ServeMetrics
from dsv4ray.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
)
from dsv4ray.entrypoints.openai.streaming import (
    Answer,
    Run,
    SSEResponse,
    StreamUsage,
    Tracked,
    last_output,
    stream,
)
from dsv4ray.entrypoints.openai.tokenize import DetokenizeRequest, TokenizeRequest
from dsv4ray.entrypoints.openai.vllm_metrics import CONTENT_TYPE as PROMETHEUS_CONTENT_TYPE
from dsv4ray.entrypoints.tool_calls import constrained
from dsv4ray.text.chat_encoding import prefix_state

log = logging.getLogger("dsv4ray.serve")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
STATS_POLL_S = 1.0
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
ROUTE_PATHS = (*GENERATION_PATHS, "/v1/models", "/v1/dsv4ray/stats", "/health")
ROUTE_PATHS += ("/metrics", "/tokenize", "/detokenize")


@runtime_checkable
class EngineClient(Protocol):
    """What the server needs from an engine (AsyncEngine provides it). ``tokenizer`` is a
    ``dsv4ray.text.tokenizer.Tokenizer`` (``encode``, ``encode_chat``, ``decode``);
    ``config.model`` the checkpoint folder (its ``tokenizer.json`` gives logprobs their token
    bytes, its ``config.json`` the vocabulary size)."""

    config: EngineConfig
    tokenizer: object
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
    # False: no stats poll while nothing is pending and the engine was idle at the last one
    # (an engine deployment that autoscales to zero is not kept up by the poll)
    poll_idle_engine: bool = True


class OpenAIServer:
    def __init__(self, engine: EngineClient, options: ServerOptions, metrics: ServeMetrics):
        self.engine, self.options, self.metrics = engine, options, metrics
        self.num_pending = 0  # engine requests of the responses in flight
        self.num_admitted = 0  # engine requests of admitted responses not yet submitted
        self.num_started = 0  # generation requests so far (the stats poll's activity)
        self.token_bytes = TokenBytes(engine.config.model)
        self.vocab_size = ModelConfig.from_hf(engine.config.model).vocab_size
        self.created = int(time.time())
        metrics.bind_engine(engine.max_model_len, engine.config.speculative_num_steps > 0)
        self._poller: asyncio.Task | None = None
        self.app = build_api(self)

    # ------------------------------------------------------------------ lifetime and metrics
    @contextlib.asynccontextmanager
    async def lifespan(self, app) -> AsyncIterator[None]:
        """While the app runs, engine counters go to the metrics every ``STATS_POLL_S``."""
        self._poller = asyncio.create_task(self._poll_stats())
        try:
            yield
        finally:
            self.close()

    def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()

    async def _poll_stats(self) -> None:
        idle, seen = False, -1
        while True:
            # without poll_idle_engine, skipped while the engine was idle at the last poll
            # and no generation has started since
            if self.options.poll_idle_engine or not idle or self.num_started != seen:
                seen = self.num_started
                try:
                    stats = await self.engine.stats()
                    self.metrics.engine_stats(stats, self.num_pending)
                    busy = stats.get("num_running", 0) or stats.get("num_waiting", 0)
                    idle = not (busy or self.num_pending)
                except APIError as exc:  # the engine replica is down or being replaced
                    log.warning("engine stats poll: %s", exc.message)
                except Exception:
                    log.exception("engine stats poll failed")
            await asyncio.sleep(STATS_POLL_S)

    def response_started(self, path: str, status: int) -> None:
        """Counts an answer; a generation's 200 counts itself when it ends (``Tracked``)."""
        if not (path in GENERATION_PATHS and status == 200):
            self.metrics.request_done(self.endpoint(path), status)

    def endpoint(self, path: str) -> str:
        """The metrics tag: a known route, never a client-chosen path (bounded cardinality)."""
        if path.startswith("/v1/models/"):
            return "/v1/models/{id}"
        return path if path in ROUTE_PATHS else "other"

    # ------------------------------------------------------------------ small routes
    def _check_model(self, model: str) -> None:
        if model != self.options.served_model_name:
            named = model if len(model) <= 200 else model[:200] + "..."  # a bounded echo
            raise APIError(
                404,
                f"the model {named!r} does not exist; this server serves "
                f"{self.options.served_model_name!r}",
                param="model",
                code="model_not_found",
            )

    async def models(self) -> Response:
        card = self.model_card(self.options.served_model_name)
        return JSONResponse({"object": "list", "data": [card]})

    async def model(self, model_id: str) -> Response:
        return JSONResponse(self.model_card(model_id))

    def model_card(self, model: str) -> dict:
        self._check_model(model)
        return {
            "id": model,
            "object": "model",
            "created": self.created,
            "owned_by": "dsv4ray",
            "max_model_len": self.engine.max_model_len,
        }

    async def health(self) -> Response:
        try:
            await asyncio.wait_for(self.engine.stats(), timeout=30)
        except Exception:
            log.exception("health check: the engine does not answer")
            raise APIError(503, "the engine does not answer", "server_error") from None
        return JSONResponse({"status": "ok"})

    async def stats(self) -> Response:
        stats = await self.engine.stats()
        return JSONResponse({**stats, "num_pending_http_requests": self.num_pending})

    async def scrape(self) -> Response:
        """``GET /metrics``: the vLLM-named series (counts and times only, no request content)."""
        return Response(self.metrics.vllm.exposition(), media_type=PROMETHEUS_CONTENT_TYPE)

    # ------------------------------------------------------------------ prompts
    def prompt_ids(self, prompt: str | list[int], add_bos: bool | None = None) -> list[int]:
        """A completion prompt as the engine gets it: a string tokenized (``add_bos`` None: as
        the checkpoint asks), token ids as they are (the engine checks them)."""
        if isinstance(prompt, str):
            return _tokenize(self.engine.tokenizer.encode, "prompt", prompt, add_bos)
        return list(prompt)

    def chat_prompt_ids(self, req: ChatCompletionRequest, tools=None) -> list[int]:
        """The chat messages (and tools: a ChatTools) rendered with the checkpoint's chat
        encoding, tokenized."""
        messages, kwargs = req.template_messages(), req.template_kwargs()
        functions = tools.prompt_functions() if tools is not None else None
        encode = self.engine.tokenizer.encode_chat
        return _tokenize(encode, "messages", messages, kwargs, functions)

    async def tokenize(self, request: Request) -> Response:
        body = await read_body(request, self.options.max_body_bytes)
        req = parse_request(TokenizeRequest, body)
        self._check_model(req.model or self.options.served_model_name)
        if req.messages is None:
            ids = self.prompt_ids(req.prompt, None if req.add_special_tokens else False)
        else:
            chat = req.as_chat()
            ids = self.chat_prompt_ids(chat, chat.chat_tools())
        count, context = len(ids), self.engine.max_model_len
        return JSONResponse({"count": count, "max_model_len": context, "tokens": ids})

    async def detokenize(self, request: Request) -> Response:
        body = await read_body(request, self.options.max_body_bytes)
        req = parse_request(DetokenizeRequest, body)
        self._check_model(req.model or self.options.served_model_name)
        bad = [t for t in req.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(
                f"token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}", "tokens"
            )
        text = self.engine.tokenizer.decode(req.tokens, skip_special_tokens=False)
        return JSONResponse({"prompt": text})

    # ------------------------------------------------------------------ generation
    async def completions(self, request: Request) -> Response:
        body = await read_body(request, self.options.max_body_bytes)
        req = parse_request(CompletionRequest, body)
        self._check_model(req.model)
        first = CompletionFormat(
            self.options.served_model_name, self.token_bytes, req.logprobs, req.return_token_ids
        )
        runs = []
        for i, prompt in enumerate(req.prompts):
            prompt_ids = self.prompt_ids(prompt)
            field = "prompt" if len(req.prompts) == 1 else f"prompt.{i}"
            max_tokens = self._max_tokens(
                req.max_tokens, len(prompt_ids), field, COMPLETIONS_DEFAULT_MAX_TOKENS
            )
            params = req.sampling_params(
                max_tokens, req.engine_logprobs, req.engine_prompt_logprobs
            )
            fmt = first.sibling(len(runs))
            tokenizer = self.engine.tokenizer  # answers are decoded after the prompt's text
            fmt.set_answer_opens_text(not tokenizer.decode(tokenizer.answer_context(prompt_ids)))
            if req.echo:
                fmt.set_echo(*self._echo(prompt, prompt_ids))
            runs += self._runs(fmt, prompt_ids, params, req)
        return await self._generate("/v1/completions", runs, req, request)

    def _echo(self, prompt: str | list[int], prompt_ids: list[int]):
        """(text, prompt_ids, where each prompt token starts in text) of an echoed prompt: a
        string as it was sent (special tokens' text included), token ids decoded."""
        tokenizer = self.engine.tokenizer
        if isinstance(prompt, str):
            starts = tokenizer.char_starts(prompt, prompt_ids)
            if starts is not None:
                return prompt, prompt_ids, starts
        text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids)
        at = TextOffsets(self.token_bytes, opens_text=True)  # each token's bytes in the text
        return text, prompt_ids, [at.next(token_id) for token_id in prompt_ids]

    async def chat(self, request: Request) -> Response:
        body = await read_body(request, self.options.max_body_bytes)
        req = parse_request(ChatCompletionRequest, body)
        self._check_model(req.model)
        tools = req.chat_tools()
        prompt_ids = self.chat_prompt_ids(req, tools)
        asked, name = req.requested_max_tokens
        max_tokens = self._max_tokens(asked, len(prompt_ids), "messages", None, name)
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        params = req.sampling_params(max_tokens, num_top, req.prompt_logprobs)
        start = prefix_state(req.template_messages(), req.thinking)
        params = self._constrained(params, tools, req.thinking and start != "content")
        fmt = ChatFormat(
            self.options.served_model_name,
            self.token_bytes,
            num_top,
            req.return_token_ids,
            thinking=req.thinking,
            start=start,
            tools=tools,
        )
        runs = self._runs(fmt, prompt_ids, params, req)
        return await self._generate("/v1/chat/completions", runs, req, request)

    def _runs(self, fmt, prompt_ids: list[int], params: SamplingParams, req) -> list[Run]:
        """A prompt's engine requests: its leader, then the other choices (or best_of
        candidates); a seed gives choice j seed + j. Only the leader computes prompt
        logprobs (the others read the prompt from the prefix cache)."""
        fmt.show_prompt_logprobs = req.prompt_logprobs
        runs = [Run(fmt, prompt_ids, params)]
        for j in range(1, req.num_runs):
            seed = None if params.seed is None else (params.seed + j + 2**63) % 2**64 - 2**63
            if seed == -1:  # a seed of -1 asks for none: this choice takes the other end
                seed = -(2**63)
            follower = dataclasses.replace(params, seed=seed, prompt_logprobs=None)
            runs.append(Run(fmt.sibling(fmt.index + j), prompt_ids, follower, leader=False))
        return runs

    def _constrained(self, params: SamplingParams, tools, reasons: bool) -> SamplingParams:
        try:
            return constrained(params, tools, reasons, self.engine.tokenizer.think_end_id)
        except ValueError as exc:
            raise bad_request(str(exc), str(exc).split(":", 1)[0]) from None

    def _max_tokens(self, asked: int | None, prompt_len: int, field: str, default: int | None,
                    name: str = "max_tokens"):  # fmt: skip
        """The request's max_tokens (asked by the field ``name``), checked against the context;
        None = up to the context."""
        context = self.engine.max_model_len
        if asked is not None and asked <= 0:
            raise bad_request(f"{name} must be at least 1, got {asked}", name)
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
                name,
            )
        return min(asked or default or room, room)

    async def _generate(self, endpoint: str, runs: list[Run], req, http: Request) -> Response:
        # every engine request of an admitted response counts from admission on: responses
        # admitted together must not pass the limit before their runs are submitted
        if len(runs) > self.options.max_pending_requests:  # a retry would never be admitted
            raise bad_request(
                f"this request needs {len(runs)} generations at once (its prompts times n or "
                f"best_of), and this server admits {self.options.max_pending_requests} at "
                "most (max_pending_requests)",
                "best_of" if getattr(req, "best_of", None) else "n",
            )
        if self.num_pending + self.num_admitted + len(runs) > self.options.max_pending_requests:
            raise APIError(
                503, "the server is overloaded; retry later", "server_error", code="overloaded"
            )
        self.num_started += 1
        self.num_admitted += len(runs)
        answer = Answer(self.metrics, endpoint)
        try:  # a client gone before the first tokens: its runs are aborted
            await unless_client_gone(http.receive, self._start_all(answer, runs, req.stream))
        except BaseException as exc:  # _start answers (and releases for) its own failures
            if not isinstance(exc, Exception):  # the client went away before a first token
                await _give_up([r for r in runs if r.tracked and not r.tracked.closed], exc)
            raise
        finally:  # runs that never started leave the admitted count here
            self.num_admitted -= sum(run.tracked is None for run in runs)
        if req.stream:
            num_prompt = sum(len(r.prompt_ids) for r in runs if r.leader)
            usage = StreamUsage(req.include_usage, req.continuous_usage, num_prompt)
            return SSEResponse(stream(runs, usage), cleanup=lambda: _cancel_all(runs),
                               media_type="text/event-stream")  # fmt: skip
        try:  # a client gone before the answer is whole: its runs are aborted
            outputs = await unless_client_gone(
                http.receive,
                asyncio.gather(*(last_output(r.tracked, r.first, r.updates) for r in runs)),
            )
        except BaseException as exc:
            await _give_up(runs, exc)
            raise
        failed = next((o for o in outputs if o.finish_reason == "abort"), None)
        if failed is not None:
            await _give_up(runs, Exception(failed.error))  # the others end with it
            log.warning("request %s aborted: %s", runs[0].fmt.request_id, failed.error)
            raise aborted(failed.error)
        for run, output in zip(runs, outputs):
            run.tracked.close(200, output)
        leaders = [o for r, o in zip(runs, outputs) if r.leader]
        chosen = _best(runs, outputs, req.n)
        choices = [run.fmt.choice(output) for run, output in chosen]
        return JSONResponse(runs[0].fmt.response(choices, format_usage(outputs, leaders)))

    async def _start_all(self, answer: Answer, runs: list[Run], stream: bool) -> None:
        """Submits every run and waits for the leaders' first updates (and, for an answer sent
        whole, the others')."""
        await self._start(answer, [r for r in runs if r.leader], runs)
        leader = None
        for run in runs:  # the others of a prompt share its leader's prompt logprobs
            leader = run if run.leader else leader
            run.fmt.prompt_logprobs = leader.first.prompt_logprobs
        # a stream goes out once the leaders have their first tokens; the other choices'
        # first updates arrive in it (their prompts passed the engine's checks as the
        # leaders': only the seed and prompt logprobs differ)
        await self._start(answer, [r for r in runs if not r.leader], runs, not stream)

    async def _start(
        self, answer: Answer, runs: list[Run], every: list[Run], wait: bool = True
    ) -> None:
        """Submits runs and (wait) waits for each one's first update (engine-side ValueErrors
        come before any token: a 400 naming the prompt, after every started run is aborted)."""
        for run in runs:
            index, request_id = run.fmt.index, run.fmt.request_id
            request_id = f"{request_id}-{index}" if index else request_id  # a choice's own
            run.updates = self.engine.generate(run.prompt_ids, run.params, request_id=request_id)
            run.tracked = Tracked(self, answer, run.updates)
            self.num_admitted -= 1  # pending from here on
        if not wait:
            return
        firsts = await asyncio.gather(
            *(run.updates.__anext__() for run in runs), return_exceptions=True
        )
        for run, first in zip(runs, firsts):
            if not isinstance(first, BaseException):
                run.first = first
        problem = next((f for f in firsts if isinstance(f, BaseException)), None)
        if problem is None:
            return
        started = [r for r in every if r.tracked is not None]
        if isinstance(problem, ValueError):
            for run in started:
                await run.updates.aclose()
                run.tracked.release(None)  # never ran; answered as a 400
            raise refusal(problem, answer.endpoint) from None
        await _give_up(started, problem)
        raise problem


def _best(runs: list[Run], outputs: list, n: int) -> list[tuple[Run, object]]:
    """The choices a response shows: every run, or with best_of the n of each prompt whose
    tokens are likeliest (cumulative logprob), numbered in that order."""
    groups, group = [], []
    for run, output in zip(runs, outputs):
        if run.leader and group:
            groups.append(group)
            group = []
        group.append((run, output))
    groups.append(group)
    chosen = []
    for group in groups:
        if len(group) > n:
            group = sorted(group, key=lambda pair: -_cumulative_logprob(pair[1]))[:n]
        for run, output in group:
            run.fmt.index = len(chosen)
            chosen.append((run, output))
    return chosen


def _cumulative_logprob(output) -> float:
    return sum(step[token] for token, step in zip(output.token_ids, output.logprobs or ()))


async def _cancel_all(runs: list[Run]) -> None:
    for run in runs:
        await run.tracked.cancel()


async def _give_up(runs: list[Run], exc: BaseException) -> None:
    """An engine stream failed or the client went away: abort every run. A failure is
    answered (and counted) as a 500; a client gone gets no answer, so it is counted here."""
    for run in runs:
        await run.updates.aclose()
        if isinstance(exc, Exception):
            run.tracked.release()
        else:
            run.tracked.close(STATUS_CLIENT_CLOSED)


def _tokenize(encode, field: str, *args) -> list[int]:
    """A template that cannot render the messages (or refuses a ``chat_template_kwargs`` key),
    or text the tokenizer refuses (a lone surrogate from a JSON escape), is the request's
    fault: 400, naming the field the chat format's message starts with (``messages[2].content``
    as ``messages.2.content``, ``tools``, ``chat_template_kwargs.thinking``)."""
    try:
        return encode(*args)
    except Exception as exc:
        message = str(exc)
        named = _NAMED_FIELD.match(message)
        if named:
            raise bad_request(message, re.sub(r"\[(\d+)\]", r".\1", named.group(0))) from None
        raise bad_request(f"{field} could not be tokenized: {message}", field) from None


# the field a chat format's refusal starts with: messages[i]..., tools, chat_template_kwargs...
_NAMED_FIELD = re.compile(r"(chat_template_kwargs|messages|tools)(\[\d+\]|\.[A-Za-z_]+)*(?=[ :]|$)")
