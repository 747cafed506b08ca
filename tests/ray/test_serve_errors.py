"""Bad requests, keys, body limits, overload and disconnects against a live server.

Each failure must come back with its status and OpenAI's error body, and the server must keep
serving; a client that disconnects mid-stream must give its pages back to the pool.
"""

import json
import time

import httpx
import openai
import pytest
from ray import serve

MODEL = "tiny-test"
API_KEY = "test-key-2"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CONTEXT = 2048  # max_total_tokens below: the tiny model's context is its KV capacity
MAX_BODY = 64 * 1024
MAX_PENDING = 3
LONG = {"max_tokens": 1500, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def base_url(start_server, tiny_ckpt):
    url = start_server(
        tiny_ckpt,
        served_model_name=MODEL,
        kv_cache_dtype="fp8",
        max_total_tokens=CONTEXT,
        api_key=API_KEY,
        max_body_bytes=MAX_BODY,
        max_pending_requests=MAX_PENDING,
    )
    yield url
    serve.shutdown()


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def post(base_url: str, path: str, body, headers=None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = AUTH if headers is None else headers
    return httpx.post(f"{base_url}{path}", content=content, headers=headers, timeout=60)


def assert_error(response: httpx.Response, status: int, type_: str, param=None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == type_ and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


def assert_still_serving(client) -> None:
    got = client.completions.create(model=MODEL, prompt="still here", max_tokens=2)
    assert got.usage.completion_tokens >= 1


def stats(base_url: str) -> dict:
    return httpx.get(f"{base_url}/v1/dsv4ray/stats", headers=AUTH, timeout=30).json()


def wait_for_idle(base_url: str, timeout_s: float = 30) -> dict:
    """Until no request runs or waits and every page is free or held only by the cache."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = stats(base_url)
        idle = s["num_running"] == 0 and s["num_waiting"] == 0
        if idle and s["num_free_pages"] + s["num_cached_pages"] == s["num_pages"]:
            return s
        assert time.monotonic() < deadline, s
        time.sleep(0.2)


GOOD = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
BAD_COMPLETIONS = [
    ("malformed JSON", b'{"model": "x", "prompt": ', None),
    ("not an object", b"[1, 2]", None),
    ("invalid UTF-8", b'{"model": "\xff\xfe", "prompt": "a"}', None),
    ("missing prompt", {"model": MODEL, "max_tokens": 2}, "prompt"),
    ("missing model", {"prompt": "a"}, "model"),
    ("max_tokens as a string", {**GOOD, "max_tokens": "5"}, "max_tokens"),
    ("temperature as a bool", {**GOOD, "temperature": True}, "temperature"),
    ("prompt as a number", {**GOOD, "prompt": 5}, "prompt"),
    ("max_tokens 0", {**GOOD, "max_tokens": 0}, "max_tokens"),
    ("max_tokens -1", {**GOOD, "max_tokens": -1}, "max_tokens"),
    ("max_tokens beyond the context", {**GOOD, "max_tokens": CONTEXT}, "max_tokens"),
    ("temperature < 0", {**GOOD, "temperature": -0.5}, "temperature"),
    ("top_p 0", {**GOOD, "top_p": 0}, "top_p"),
    ("top_p > 1", {**GOOD, "top_p": 1.5}, "top_p"),
    ("prompt too long", {**GOOD, "prompt": [5] * (CONTEXT + 10)}, "prompt"),
    ("token id outside the vocabulary", {**GOOD, "prompt": [5, 10**6]}, "prompt"),
    ("logit_bias outside the vocabulary", {**GOOD, "logit_bias": {"1000000": 5}}, "logit_bias"),
    ("stop id outside the vocabulary", {**GOOD, "stop_token_ids": [10**6]}, "stop_token_ids"),
    ("lone surrogate escape", {**GOOD, "prompt": "a\ud800b"}, "prompt"),
    ("n out of range", {**GOOD, "n": 65}, "n"),
    ("seed beyond 64 bits", {**GOOD, "seed": 2**64}, "seed"),
]


@pytest.mark.parametrize("case, body, param", BAD_COMPLETIONS, ids=[c[0] for c in BAD_COMPLETIONS])
def test_bad_completion_requests_get_400(base_url, client, case, body, param):
    assert_error(post(base_url, "/v1/completions", body), 400, "invalid_request_error", param)
    assert_still_serving(client)


def test_bad_chat_requests_get_400(base_url, client):
    good = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [
        ({**good, "messages": []}, "messages"),
        ({**good, "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({**good, "messages": [{"role": "user", "content": 7}]}, "messages.0.content"),
        ({**good, "top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({**good, "stream": "yes"}, "stream"),
        ({**good, "messages": [{"role": "user", "content": "x" * (CONTEXT + 5)}]}, "messages"),
        (
            {**good, "tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools.0.function.name",
        ),  # fmt: skip
        ({**good, "tool_choice": "required"}, "tool_choice"),  # without tools
        ({**good, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({**good, "typical_p": 0.9}, "typical_p"),
        ({**good, "chat_template_kwargs": {"thinking": 1}}, "chat_template_kwargs.thinking"),
    ]
    for body, param in cases:
        assert_error(
            post(base_url, "/v1/chat/completions", body), 400, "invalid_request_error", param
        )
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    assert_still_serving(client)


def test_unknown_model_is_404_model_not_found(base_url, client):
    error = assert_error(
        post(base_url, "/v1/completions", {**GOOD, "model": "gpt-4"}), 404, "invalid_request_error"
    )
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="gpt-4", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert httpx.get(f"{base_url}/v1/models/gpt-4", headers=AUTH).status_code == 404
    assert httpx.get(f"{base_url}/v1/models/{MODEL}", headers=AUTH).json()["id"] == MODEL
    assert_error(httpx.get(f"{base_url}/v1/nothing", headers=AUTH), 404, "invalid_request_error")
    assert_error(
        httpx.get(f"{base_url}/v1/completions", headers=AUTH), 405, "invalid_request_error"
    )
    assert_still_serving(client)


def test_requests_without_the_key_get_401(base_url, client):
    assert_error(post(base_url, "/v1/completions", GOOD, headers={}), 401, "invalid_request_error")
    wrong = {"Authorization": "Bearer nope"}
    assert_error(httpx.get(f"{base_url}/v1/models", headers=wrong), 401, "invalid_request_error")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base_url}/v1", api_key="nope", max_retries=0).models.list()
    assert httpx.get(f"{base_url}/health").status_code == 200
    assert_still_serving(client)


def test_with_a_key_any_host_and_origin_may_call(base_url, client):
    """The key protects the server: the loopback Host/Origin rule is for keyless servers."""
    foreign = {"host": "serve.example:443", "origin": "https://app.example"}
    models = httpx.get(f"{base_url}/v1/models", headers={**AUTH, **foreign})
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
    assert httpx.get(f"{base_url}/health", headers=foreign).status_code == 200
    response = post(base_url, "/v1/completions", GOOD, headers=foreign)
    assert_error(response, 401, "invalid_request_error")
    assert_still_serving(client)


def test_oversized_bodies_get_413(base_url, client):
    body = json.dumps({**GOOD, "prompt": "a" * MAX_BODY}).encode()
    assert_error(post(base_url, "/v1/completions", body), 413, "invalid_request_error")
    assert_still_serving(client)


def _serve_logs() -> dict:
    """Each Serve log file of this session -> its size now."""
    import glob
    import os

    from ray._private.worker import global_worker

    pattern = os.path.join(global_worker.node.get_session_dir_path(), "logs", "serve", "*.log")
    return {path: os.path.getsize(path) for path in glob.glob(pattern)}


def _written_since(sizes: dict) -> str:
    text = ""
    for path in _serve_logs():
        with open(path, errors="replace") as f:
            f.seek(sizes.get(path, 0))
            text += f.read()
    return text


def test_disconnecting_mid_stream_aborts_the_request_and_frees_its_pages(base_url, client):
    wait_for_idle(base_url)
    logs = _serve_logs()
    stream = client.completions.create(model=MODEL, prompt="go on", stream=True, **LONG)
    received = [next(stream) for _ in range(3)]
    assert all(c.choices[0].finish_reason is None for c in received)
    busy = stats(base_url)
    assert busy["num_running"] == 1
    assert busy["num_free_pages"] + busy["num_cached_pages"] < busy["num_pages"]
    stream.close()  # the client goes away long before 1500 tokens
    idle = wait_for_idle(base_url, timeout_s=15)
    assert idle["num_free_window_pages"] == idle["num_window_pages"]
    assert idle["num_pending_http_requests"] == 0
    assert_still_serving(client)
    # the disconnect is a line in the log, not a failure with a traceback
    written = _written_since(logs)
    assert "disconnected" in written
    assert "Traceback" not in written and "CancelledError" not in written


def test_overload_gets_503_and_the_server_recovers(base_url, client):
    wait_for_idle(base_url)
    streams = [
        client.completions.create(model=MODEL, prompt=f"fill {i}", stream=True, **LONG)
        for i in range(MAX_PENDING)
    ]
    try:
        for s in streams:
            next(s)
        response = post(base_url, "/v1/completions", GOOD)
        error = assert_error(response, 503, "server_error")
        assert error["code"] == "overloaded" and response.headers["retry-after"] == "1"
    finally:
        for s in streams:
            s.close()
    wait_for_idle(base_url, timeout_s=15)
    assert_still_serving(client)
