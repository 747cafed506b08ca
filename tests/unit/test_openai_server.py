"""The FastAPI app over a fake engine, without Ray: who may call, and OpenAI's error body with
the right status for every failure (bad fields, limits, routes, methods, engine errors, bugs)."""

import asyncio
import gzip
import inspect
import json
import logging
import time

import httpx
import pytest
import ray.exceptions
from starlette.testclient import TestClient

from dsv4ray.engine.checks import RequestError
from dsv4ray.entrypoints.async_engine import AsyncEngine
from dsv4ray.entrypoints.openai.metrics import ServeMetrics
from dsv4ray.entrypoints.openai.server import EngineClient, OpenAIServer, ServerOptions
from tests.unit.openai_fake import FakeEngine

MODEL = "tiny-test"
KEY = "k-123"
LOCAL = "http://127.0.0.1:8000"
GOOD = {"model": MODEL, "prompt": "hi", "max_tokens": 3}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
ROUTES = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("GET", f"/v1/models/{MODEL}"),
    ("GET", "/v1/dsv4ray/stats"),
    ("GET", "/nothing"),
]


def make_server(engine, **options) -> OpenAIServer:
    return OpenAIServer(engine, ServerOptions(MODEL, **options), ServeMetrics(MODEL))


@pytest.fixture
def client(engine) -> TestClient:
    """A keyless server, called from a loopback host."""
    return TestClient(make_server(engine).app, base_url=LOCAL)


def assert_error(response, status: int, param=None, code=None, type_="invalid_request_error"):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["type"], error["param"], error["code"]) == (type_, param, code)
    return error


def call(client, method: str, path: str, **kwargs):
    body = GOOD if path == "/v1/completions" else CHAT
    return client.request(method, path, json=body if method == "POST" else None, **kwargs)


def test_the_fake_engine_speaks_the_protocol_async_engine_implements(engine):
    assert isinstance(engine, EngineClient)
    for name in ("generate", "stats"):
        ours = inspect.signature(getattr(FakeEngine, name)).parameters
        real = inspect.signature(getattr(AsyncEngine, name)).parameters
        assert list(ours) == list(real)
        assert inspect.isasyncgenfunction(getattr(FakeEngine, name)) == (
            inspect.isasyncgenfunction(getattr(AsyncEngine, name))
        )
    assert {"tokenizer", "max_model_len"} <= set(vars(AsyncEngine))  # properties of the class


def test_a_keyless_server_answers_loopback_callers_only_on_every_route(client):
    for method, path in ROUTES:
        assert call(client, method, path).status_code in (200, 404)
        foreign = call(client, method, path, headers={"host": "evil.example"})
        assert_error(foreign, 403, code="forbidden")
        origin = call(client, method, path, headers={"origin": "http://evil.example"})
        assert_error(origin, 403, code="forbidden")
    assert_error(client.get("/health", headers={"host": "rebind.example:8000"}), 403,
                 code="forbidden")  # fmt: skip


def test_with_a_key_every_route_but_health_needs_it(engine):
    app = make_server(engine, api_key=KEY).app
    client = TestClient(app, base_url="http://serve.example")
    for method, path in ROUTES:  # unknown routes too: no key, nothing learnt about routes
        assert_error(call(client, method, path), 401, code="invalid_api_key")
        wrong = call(client, method, path, headers={"authorization": "Bearer nope"})
        assert_error(wrong, 401, code="invalid_api_key")
    assert client.get("/health").json() == {"status": "ok"}
    auth = {"authorization": f"Bearer {KEY}", "origin": "https://app.example"}
    assert call(client, "POST", "/v1/completions", headers=auth).status_code == 200


def test_unknown_routes_are_404_and_wrong_methods_405(client):
    assert_error(client.get("/v1/nothing"), 404, code="not_found")
    assert_error(client.get("/docs"), 404, code="not_found")  # no routes beyond the API's
    assert_error(client.get("/openapi.json"), 404, code="not_found")
    for method in ("GET", "PUT", "DELETE", "OPTIONS"):
        response = client.request(method, "/v1/completions")
        assert_error(response, 405, code="bad_method")
        assert response.headers["allow"] == "POST"
    assert_error(client.post("/v1/models", json={}), 405, code="bad_method")
    unknown = client.get("/v1/models/gpt-4")
    assert_error(unknown, 404, param="model", code="model_not_found")
    huge = client.post("/v1/completions", json={**GOOD, "model": "m" * 5000})
    assert_error(huge, 404, param="model", code="model_not_found")
    assert len(huge.json()["error"]["message"]) < 400  # a client's long name is not echoed whole
    assert client.get("/v1/models/").json()["data"][0]["id"] == MODEL  # one spelling per route
    assert client.post("/v1/completions/", json=GOOD).status_code == 200


def test_org_slash_model_ids_are_found(engine):
    client = TestClient(OpenAIServer(engine, ServerOptions("org/model"), ServeMetrics("m")).app,
                        base_url=LOCAL)  # fmt: skip
    assert client.get("/v1/models/org/model").json()["id"] == "org/model"


BAD_REQUESTS = [
    ("malformed JSON", b'{"model": "x", "prompt": ', None),
    ("not an object", b"[1, 2]", None),
    ("invalid UTF-8", b'{"model": "\xff", "prompt": "a"}', None),
    ("nested too deep", b'{"model": "m", "prompt": ' + b"[" * 100 + b"]" * 100 + b"}", None),
    ("missing prompt", {"model": MODEL}, "prompt"),
    ("max_tokens as a string", {**GOOD, "max_tokens": "5"}, "max_tokens"),
    ("max_tokens 0", {**GOOD, "max_tokens": 0}, "max_tokens"),
    ("max_tokens past the context", {**GOOD, "max_tokens": 10_000}, "max_tokens"),
    ("prompt past the context", {**GOOD, "prompt": [5] * 10_000}, "prompt"),
    ("token outside the vocabulary", {**GOOD, "prompt": [5, 10**6]}, "prompt"),
    ("NaN temperature", b'{"model": "m", "prompt": "x", "temperature": NaN}', "temperature"),
    ("top_p 0", {**GOOD, "top_p": 0}, "top_p"),
    ("n out of range", {**GOOD, "n": 0}, "n"),
    ("best_of below n", {**GOOD, "n": 3, "best_of": 2}, "best_of"),
    ("best_of streamed", {**GOOD, "best_of": 2, "stream": True}, "best_of"),
    ("too many choices", {**GOOD, "prompt": ["a"] * 9, "n": 8}, "n"),
    ("unknown field", {**GOOD, "typical_p": 0.9}, "typical_p"),
]


@pytest.mark.parametrize("case, body, param", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_requests_are_400_naming_the_field(client, case, body, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    assert_error(client.post("/v1/completions", content=content), 400, param=param)
    assert call(client, "POST", "/v1/completions").status_code == 200  # still serving


def test_bad_chat_requests_are_400_naming_the_field(client):
    for body, param in [
        ({**CHAT, "messages": []}, "messages"),
        ({**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
        ({**CHAT, "stream": "yes"}, "stream"),
        ({**CHAT, "chat_template_kwargs": {"thinking": "yes"}}, "chat_template_kwargs.thinking"),
        ({**CHAT, "chat_template_kwargs": {"effort": 3}}, "chat_template_kwargs"),
        ({**CHAT, "messages": [{"role": "tool", "content": "42"}]}, "messages.0.tool_call_id"),
    ]:
        assert_error(client.post("/v1/chat/completions", json=body), 400, param=param)


def test_the_model_must_be_the_served_one(client):
    for path, body in [("/v1/completions", GOOD), ("/v1/chat/completions", CHAT)]:
        response = client.post(path, json={**body, "model": "gpt-4"})
        assert_error(response, 404, param="model", code="model_not_found")


def test_bodies_over_the_limit_are_413_declared_or_streamed(engine):
    client = TestClient(make_server(engine, max_body_bytes=1024).app, base_url=LOCAL)
    body = json.dumps({**GOOD, "prompt": "a" * 2000}).encode()
    assert_error(client.post("/v1/completions", content=body), 413, code="request_too_large")
    chunks = iter([body[:600], body[600:]])  # chunked: no content-length to refuse it by
    response = client.post("/v1/completions", content=chunks)
    assert "content-length" not in response.request.headers
    assert_error(response, 413, code="request_too_large")
    small = json.dumps({**GOOD, "prompt": "a" * 40}).encode()
    assert client.post("/v1/completions", content=small).status_code == 200


def test_a_compressed_body_is_415_naming_its_encoding(client):
    body = gzip.compress(json.dumps(GOOD).encode())
    response = client.post("/v1/completions", content=body, headers={"Content-Encoding": "gzip"})
    assert_error(response, 415, code="unsupported_media_type")
    assert "'gzip'" in response.json()["error"]["message"]
    plain = {"Content-Encoding": "identity"}
    assert client.post("/v1/completions", json=GOOD, headers=plain).status_code == 200


def test_engine_failures_are_500_without_internals(client, engine):
    engine.fail = RuntimeError("stage 1 died: ray::StageWorker pid=4242 ip=10.1.2.3")
    for path in ("/v1/completions", "/v1/chat/completions"):
        for stream in (False, True):
            response = client.post(path, json={**(GOOD if "chat" not in path else CHAT),
                                               "stream": stream})  # fmt: skip
            error = assert_error(response, 500, type_="server_error")
            assert error["message"].startswith("internal server error (request ")
            # "pid=4242", not "4242": a request id is random hex and may hold those digits
            assert not any(s in response.text for s in ("ray::", "pid=4242", "10.1.2.3", "died"))
    engine.fail = None
    assert call(client, "POST", "/v1/completions").status_code == 200


def test_an_engine_that_does_not_answer_fails_health_and_stats(client, engine):
    engine.fail = OSError("socket 10.1.2.3:6379 closed")
    assert_error(client.get("/health"), 503, type_="server_error")
    error = assert_error(client.get("/v1/dsv4ray/stats"), 500, type_="server_error")
    assert "10.1.2.3" not in error["message"]


def test_an_engine_abort_is_a_500_with_a_safe_reason(client, engine):
    engine.abort_after = 2
    engine.abort_reason = "stage 1 failed: RayActorError pid=77 ip=10.0.0.9"
    error = assert_error(client.post("/v1/completions", json=GOOD), 500, type_="server_error")
    assert error["message"] == "the request was aborted: stage 1 failed"
    events = client.post("/v1/chat/completions", json={**CHAT, "stream": True}).text
    *chunks, error_chunk, done, tail = events.split("\n\n")
    assert (done, tail) == ("data: [DONE]", "")
    assert json.loads(error_chunk.removeprefix("data: "))["error"]["message"] == error["message"]
    assert "10.0.0.9" not in events


def test_a_full_server_answers_503_with_retry_after(engine):
    engine.gate = asyncio.Event()  # requests wait for their first token until it is set
    app = make_server(engine, max_pending_requests=2).app

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=LOCAL) as http:
            waiting = [asyncio.create_task(http.post("/v1/completions", json=GOOD))
                       for _ in range(2)]  # fmt: skip
            while len(engine.requests) < 2:
                await asyncio.sleep(0.01)
            full = await http.post("/v1/completions", json=GOOD)
            stats = (await http.get("/v1/dsv4ray/stats")).json()
            engine.gate.set()
            done = [await task for task in waiting]
            return full, stats, done, await http.post("/v1/completions", json=GOOD)

    full, stats, done, after = asyncio.run(run())
    assert_error(full, 503, code="overloaded", type_="server_error")
    assert full.headers["retry-after"] == "1" and stats["num_pending_http_requests"] == 2
    assert [r.status_code for r in done] == [200, 200] and after.status_code == 200


def test_a_response_larger_than_the_limit_is_refused_not_told_to_retry(engine):
    """n above max_pending_requests could never be admitted: 400 naming n, not a 503 whose
    retries would all fail."""
    client = TestClient(make_server(engine, max_pending_requests=4).app, base_url=LOCAL)
    got = client.post("/v1/completions", json={**GOOD, "n": 5})
    assert_error(got, 400, param="n")
    assert "needs 5 generations" in got.json()["error"]["message"] and not engine.requests
    assert client.post("/v1/completions", json={**GOOD, "n": 4}).status_code == 200


def test_responses_admitted_together_stay_within_the_limit_with_all_their_choices(engine):
    """The limit counts every choice of an admitted response, before its choices start: three
    responses of n = 4 arriving together against a limit of 8 engine requests are two
    admitted and one 503, never 12 engine requests pending."""
    engine.gate = asyncio.Event()
    server = make_server(engine, max_pending_requests=8)

    async def run():
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url=LOCAL) as http:
            posts = [asyncio.create_task(http.post("/v1/completions", json={**GOOD, "n": 4}))
                     for _ in range(3)]  # fmt: skip
            for _ in range(300):  # the refused one answers at once
                if any(task.done() for task in posts):
                    break
                await asyncio.sleep(0.01)
            pending = server.num_pending
            engine.gate.set()
            return pending, [await task for task in posts]

    pending, responses = asyncio.run(run())
    assert pending <= 8 and sorted(r.status_code for r in responses) == [200, 200, 503]
    assert len(engine.requests) == 8 and server.num_pending == server.num_admitted == 0


class HeldChoices(FakeEngine):
    """Holds every choice but a prompt's first (request ids ending -1, -2, ...) at its start
    until `release` is set: a busy engine that queues them."""

    def __init__(self, model_dir: str) -> None:
        super().__init__(model_dir)
        self.release = asyncio.Event()

    async def generate(self, prompt, params, request_id: str):
        if request_id.rsplit("-", 1)[-1].isdigit():
            await self.release.wait()
        async for update in super().generate(prompt, params, request_id):
            yield update


async def _stream_events(
    app, path: str, body: dict, events: asyncio.Queue, gone_after: int | None = None
) -> None:
    """POSTs body to the ASGI app and puts each SSE event on `events` as the app sends it
    (httpx's ASGI transport hands the body over only once the app is done); with gone_after,
    the client goes away after that many body messages: a send raises OSError, as an ASGI 2.4
    server's does."""
    payload = json.dumps(body).encode()
    scope = {"type": "http", "http_version": "1.1", "method": "POST", "path": path,
             "raw_path": path.encode(), "query_string": b"", "scheme": "http",
             "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000),
             "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(payload)).encode())]}  # fmt: skip
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await asyncio.Event().wait()  # the client stays

    async def send(message):
        if gone_after is not None and message["type"] == "http.response.body":
            if events.qsize() >= gone_after:
                raise OSError("the client went away")
        for event in message.get("body", b"").decode().split("\n\n"):
            if event.startswith("data: {"):
                await events.put(json.loads(event.removeprefix("data: ")))

    await app(scope, receive, send)


def test_a_stream_of_n_choices_starts_with_its_first_choice_tokens(fake_model_dir):
    """The first choice streams while the others still wait in the engine's queue; theirs
    follow once they run, and every choice ends whole."""
    engine = HeldChoices(fake_model_dir)
    server = make_server(engine)
    body = {**GOOD, "n": 3, "stream": True, "max_tokens": 4}

    async def run():
        events: asyncio.Queue = asyncio.Queue()
        call = asyncio.create_task(_stream_events(server.app, "/v1/completions", body, events))
        early = [await asyncio.wait_for(events.get(), timeout=10) for _ in range(4)]
        engine.release.set()
        await asyncio.wait_for(call, timeout=10)
        return early, [events.get_nowait() for _ in range(events.qsize())]

    early, rest = asyncio.run(run())
    assert {c["choices"][0]["index"] for c in early} == {0}  # choice 0's 4 tokens, alone
    texts = {}
    for chunk in early + rest:
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    expected = engine.tokenizer.decode(engine.reply[:4])
    assert texts == {0: expected, 1: expected, 2: expected}
    assert server.num_pending == 0


@pytest.mark.parametrize("fields", [{"n": 3}, {"prompt": ["a", "b"], "n": 2}])
def test_a_client_gone_mid_stream_of_several_choices_leaves_nothing_pending(engine, fields):
    """A send that fails while several choices stream (the client went away) ends every
    choice: nothing stays pending, each aborted request returned its pages, and the server
    keeps answering."""
    server = make_server(engine)
    body = {**GOOD, "stream": True, "max_tokens": 8, **fields}

    async def run():
        events: asyncio.Queue = asyncio.Queue()
        try:
            await _stream_events(server.app, "/v1/completions", body, events, gone_after=3)
        except OSError:
            pass  # the server may let the failed send through
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url=LOCAL) as http:
            return events.qsize(), await http.post("/v1/completions", json=GOOD)

    received, after = asyncio.run(asyncio.wait_for(run(), timeout=10))
    assert received == 3 and after.status_code == 200
    assert server.num_pending == server.num_admitted == 0
    started = {r for _, _, r in engine.requests[:-1]}  # the last one is `after`
    assert started and started <= set(engine.aborted)


class RefusedChoices(FakeEngine):
    """Refuses every choice but a prompt's first when it starts (request ids ending -1, -2)."""

    async def generate(self, prompt, params, request_id: str):
        if request_id.rsplit("-", 1)[-1].isdigit():
            raise RequestError("refused by the engine", "logit_bias")
        async for update in super().generate(prompt, params, request_id):
            yield update


def test_a_choice_refused_inside_a_stream_ends_it_with_a_400_event(fake_model_dir):
    engine = RefusedChoices(fake_model_dir)
    server = make_server(engine)
    client = TestClient(server.app, base_url=LOCAL)
    text = client.post("/v1/completions", json={**GOOD, "n": 2, "stream": True}).text
    *_, error, done, tail = text.split("\n\n")
    assert (done, tail) == ("data: [DONE]", "")
    err = json.loads(error.removeprefix("data: "))["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "logit_bias"
    assert server.num_pending == 0


def test_a_client_gone_before_its_first_token_leaves_nothing_pending(engine):
    """Clients that go away while their requests wait for a first token (a long prompt's
    prefill) abort them: the pending count comes back to 0, each counts as an abort, and the
    server keeps answering (it would fill up with requests nobody waits for)."""
    engine.gate = asyncio.Event()
    server = make_server(engine, max_pending_requests=3)
    bodies = [
        ("/v1/completions", {**GOOD, "n": 2}),
        ("/v1/chat/completions", {**CHAT, "stream": True}),
    ]

    async def run():
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url=LOCAL) as http:
            gone = [asyncio.create_task(http.post(path, json=body)) for path, body in bodies]
            while len(engine.requests) < 2:  # n = 2's second choice starts after the first
                await asyncio.sleep(0.01)
            for task in gone:
                task.cancel()
            await asyncio.gather(*gone, return_exceptions=True)
            pending = server.num_pending
            engine.gate.set()
            after = await http.post("/v1/completions", json=GOOD)
            return pending, after, (await http.get("/metrics")).text

    pending, after, metrics = asyncio.run(run())
    assert pending == 0 and after.status_code == 200
    assert f'finished_reason="abort",model_name="{MODEL}"}} 2.0' in metrics


def test_fastapi_parameter_errors_keep_the_openai_body(engine):
    """Routes with typed parameters (none today take any) get a 400 naming the parameter."""
    app = make_server(engine).app

    @app.get("/v1/dsv4ray/typed/{count}")
    async def typed(count: int) -> dict:
        return {"count": count}

    client = TestClient(app, base_url=LOCAL)
    assert client.get("/v1/dsv4ray/typed/3").json() == {"count": 3}
    assert_error(client.get("/v1/dsv4ray/typed/three"), 400, param="count")


def test_a_bug_in_a_route_is_a_500_and_the_server_keeps_serving(engine):
    server = make_server(engine)
    server.engine = None  # every route that reaches the engine fails with AttributeError
    client = TestClient(server.app, base_url=LOCAL)
    for response in (client.get("/v1/dsv4ray/stats"), call(client, "POST", "/v1/completions")):
        error = assert_error(response, 500, type_="server_error")
        assert "NoneType" not in error["message"] and "request" in error["message"]
    server.engine = engine
    assert call(client, "POST", "/v1/completions").status_code == 200


def _completions_scope(spec_version: str) -> dict:
    """An ASGI scope of POST /v1/completions from a loopback client."""
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version},
            "http_version": "1.1", "method": "POST", "scheme": "http", "path": "/v1/completions",
            "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
            "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json")],
            "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}  # fmt: skip


def test_a_client_gone_mid_stream_aborts_its_request(engine):
    """The ASGI server's send fails once the client is gone: the engine stream is closed
    (the request aborted, its pages freed) and the pending count drops back."""
    engine.reply = engine.reply * 4
    server = make_server(engine)
    body = json.dumps({**GOOD, "max_tokens": 40, "stream": True}).encode()
    scope = _completions_scope("2.4")
    chunks: list[bytes] = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            if len(chunks) == 3:
                raise OSError("the client closed the connection")
            chunks.append(message["body"])

    asyncio.run(server.app(scope, receive, send))
    assert len(chunks) == 3 and all(c.startswith(b"data: {") for c in chunks)
    assert engine.aborted == [engine.requests[0][2]]
    assert server.num_pending == 0


def test_a_call_serve_cancels_mid_stream_is_one_log_line(engine, caplog):
    """Under Ray Serve a client gone makes the ASGI receive raise TaskCancelledError (Starlette
    listens for the disconnect below ASGI spec 2.4): the request is aborted and the log says so
    in one line, with no traceback (not a server bug)."""
    engine.reply = engine.reply * 4
    server = make_server(engine)
    body = json.dumps({**GOOD, "max_tokens": 40, "stream": True}).encode()
    scope = _completions_scope("2.3")
    received = []

    async def receive():
        received.append(1)
        if len(received) == 1:
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(0.05)
        raise ray.exceptions.TaskCancelledError()

    async def send(message):
        await asyncio.sleep(0.02)  # a slow client: the stream outlasts the cancel

    with caplog.at_level(logging.INFO, logger="dsv4ray"):
        asyncio.run(server.app(scope, receive, send))
    assert server.num_pending == 0 and engine.aborted == [engine.requests[0][2]]
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert [r for r in caplog.records if "went away" in r.getMessage()]


class SlowTokens(FakeEngine):
    """Each token takes 10 ms: an answer sent whole is long in coming."""

    async def _updates(self, ids, params, request_id: str):
        async for update in super()._updates(ids, params, request_id):
            await asyncio.sleep(0.01)
            yield update


def _whole_answer_with_disconnect(server, gone_after_s: float, gone) -> tuple[list, float]:
    """Runs a non-streamed POST /v1/completions whose client disconnects gone_after_s after its
    body was read (``gone``: the message the ASGI server then gives, or an exception its receive
    raises) -> (messages sent, seconds the app took)."""
    body = json.dumps({**GOOD, "max_tokens": 60}).encode()
    sent, received = [], []

    async def receive():
        received.append(1)
        if len(received) == 1:
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(gone_after_s)
        if isinstance(gone, BaseException):
            raise gone
        return gone

    async def send(message):
        sent.append(message)

    async def run() -> float:
        start = time.monotonic()
        await asyncio.wait_for(server.app(_completions_scope("2.4"), receive, send), 10)
        return time.monotonic() - start

    return sent, asyncio.run(run())


def test_a_client_gone_before_a_whole_answer_aborts_its_request(fake_model_dir, caplog):
    """An answer sent whole sends nothing until its last token: the server learns the client
    left from the ASGI server, aborts the request at once (its pages go back) and answers
    nothing; the log says so in one line."""
    engine = SlowTokens(fake_model_dir)
    engine.reply = engine.reply * 6  # 78 tokens at 10 ms: 0.6 s for the 60 asked
    server = make_server(engine)
    with caplog.at_level(logging.INFO, logger="dsv4ray"):
        sent, took = _whole_answer_with_disconnect(server, 0.05, {"type": "http.disconnect"})
    assert engine.aborted == [engine.requests[0][2]]
    assert took < 0.4 and sent == [] and server.num_pending == 0
    assert [r for r in caplog.records if "went away" in r.getMessage()]
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


def test_a_client_gone_before_the_first_token_aborts_its_request(engine):
    """A client that leaves while its prompt waits for its first token (here an engine that
    never starts it) is given up as well: nothing stays pending."""
    engine.gate = asyncio.Event()  # never set
    server = make_server(engine)
    sent, _ = _whole_answer_with_disconnect(server, 0.05, {"type": "http.disconnect"})
    assert len(engine.requests) == 1 and sent == [] and server.num_pending == 0


STAYS = {"disconnect after the answer": (30.0, {"type": "http.disconnect"}),
         "receive fails": (0.05, RuntimeError()),
         "another message": (0.05, {"type": "http.request", "body": b""})}  # fmt: skip


@pytest.mark.parametrize("after", list(STAYS.values()), ids=list(STAYS))
def test_a_client_that_stays_gets_its_whole_answer(fake_model_dir, after):
    """Watching for a disconnect changes nothing for a client that waits: a receive that only
    returns once the answer went out (as ASGI servers do), or one that fails or sends anything
    but a disconnect, leaves the answer whole."""
    engine = SlowTokens(fake_model_dir)
    server = make_server(engine)
    sent, _ = _whole_answer_with_disconnect(server, *after)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    body = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    assert body["choices"][0]["text"] == engine.tokenizer.decode(engine.reply[:60])
    assert engine.aborted == [] and server.num_pending == 0
