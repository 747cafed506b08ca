"""The engine replica dies mid-stream (SIGKILL): the ingress, another process, still holds the
client connections, so every open stream ends with an OpenAI error event and ``[DONE]`` (never a
truncated body), a request right after gets 503 or (once Serve replaced the replica) 200, and
the app serves again."""

import json
import os
import signal
import threading
import time

import httpx
import pytest
from ray import serve

from dsv4ray.entrypoints.serve import APP_NAME

MODEL = "tiny-test"
NUM_STREAMS = 8
MAX_TOKENS = 1000  # in flight when the replica dies: 8 x 1000 fit the pool below


@pytest.fixture(scope="module")
def base_url(start_server, tiny_ckpt):
    url = start_server(
        tiny_ckpt, served_model_name=MODEL, kv_cache_dtype="fp8", max_total_tokens=40960
    )
    yield url
    serve.shutdown()


def _engine_pid() -> int:
    return serve.get_app_handle(APP_NAME).info.remote().result(timeout_s=60)["engine_pid"]


class Stream(threading.Thread):
    """One streaming request; keeps every SSE data line it received."""

    def __init__(self, url: str, i: int) -> None:
        super().__init__(daemon=True)
        chat = i % 2 == 0
        self.path = "/v1/chat/completions" if chat else "/v1/completions"
        prompt = (
            {"messages": [{"role": "user", "content": f"tell {i}"}]}
            if chat
            else {"prompt": f"go on {i}"}
        )
        self.url, self.lines, self.status, self.error = url, [], None, None
        self.body = {"model": MODEL, "stream": True, "max_tokens": MAX_TOKENS,
                     "ignore_eos": True, **prompt}  # fmt: skip

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + self.path, json=self.body, timeout=90) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line[len("data: ") :])
        except Exception as exc:  # a cut connection: the failure this test guards against
            self.error = repr(exc)


def test_streams_end_with_an_error_and_done_when_the_engine_replica_dies(base_url):
    pid = _engine_pid()
    assert pid != os.getpid()
    streams = [Stream(base_url, i) for i in range(NUM_STREAMS)]
    for s in streams:
        s.start()
    deadline = time.monotonic() + 60
    while not all(len(s.lines) >= 3 for s in streams):  # every stream has tokens out
        assert time.monotonic() < deadline, [len(s.lines) for s in streams]
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    for s in streams:
        s.join(timeout=60)
        assert not s.is_alive()
    for s in streams:
        assert (s.status, s.error) == (200, None)
        assert s.lines[-1] == "[DONE]", s.lines[-3:]
        event = json.loads(s.lines[-2])
        assert event["error"]["type"] == "server_error", event
        assert event["error"]["code"] == "engine_unavailable", event
        assert all("error" not in json.loads(line) for line in s.lines[:-2])

    # right after: 503 with OpenAI's error body, or 200 once Serve replaced the replica
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code in (200, 503), response.text
    if response.status_code == 503:
        assert response.json()["error"]["type"] == "server_error"

    deadline = time.monotonic() + 120
    while True:  # Serve starts a new engine replica; the ingress never went away
        response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
        if response.status_code == 200:
            break
        assert response.status_code == 503, response.text
        assert time.monotonic() < deadline, response.text
        time.sleep(1)
    assert response.json()["usage"]["completion_tokens"] == 4
    assert _engine_pid() != pid
    assert httpx.get(f"{base_url}/health", timeout=60).status_code == 200
