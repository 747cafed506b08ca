"""The HTTP edge's rules without Ray: loopback Host/Origin for keyless servers, safe 5xx text,
and where `dsv4ray serve` takes its API key from."""

import pytest
from starlette.datastructures import Headers

from dsv4ray.__main__ import main
from dsv4ray.entrypoints.openai.edge import (
    MAX_REASON_LEN,
    APIError,
    check_caller,
    internal_error,
    is_loopback_authority,
    is_loopback_origin,
    safe_reason,
)
from dsv4ray.entrypoints.serve_config import API_KEY_ENV, API_KEY_FILE_ENV, resolve_api_key

LOOPBACK_HOSTS = ["localhost", "LocalHost:8000", "127.0.0.1", "127.0.0.1:80", "127.9.8.7:65535",
                  "[::1]", "[::1]:8000"]  # fmt: skip
FOREIGN_HOSTS = ["evil.example", "evil.example:8000", "localhost.evil.example", "10.0.0.1:8000",
                 "0.0.0.0:8000", "[::2]:80", "::1", "127.0.0.1:8000:1", "localhost:", "localhost:x",
                 "[::1", "", "127.0.0.1.nip.io", "localhost:8000@evil.example"]  # fmt: skip
LOOPBACK_ORIGINS = ["http://localhost", "http://localhost:3000", "https://localhost:8443",
                    "http://127.0.0.1:8000", "http://[::1]:8000", "HTTP://127.0.0.2"]  # fmt: skip
FOREIGN_ORIGINS = ["null", "http://evil.example", "http://localhost.evil.example",
                   "file://", "ftp://localhost", "http://10.0.0.1:8000", "localhost:8000",
                   "http://localhost:8000/path"]  # fmt: skip


@pytest.mark.parametrize("host", LOOPBACK_HOSTS)
def test_loopback_hosts(host):
    assert is_loopback_authority(host)


@pytest.mark.parametrize("host", FOREIGN_HOSTS)
def test_foreign_hosts(host):
    assert not is_loopback_authority(host)


@pytest.mark.parametrize("origin", LOOPBACK_ORIGINS)
def test_loopback_origins(origin):
    assert is_loopback_origin(origin)


@pytest.mark.parametrize("origin", FOREIGN_ORIGINS)
def test_foreign_origins(origin):
    assert not is_loopback_origin(origin)


def headers(*pairs: tuple[str, str]) -> Headers:
    return Headers(raw=[(k.encode(), v.encode()) for k, v in pairs])


def forbidden(hdrs: Headers, path: str = "/v1/completions") -> APIError:
    with pytest.raises(APIError) as info:
        check_caller(hdrs, None, path)
    assert (info.value.status, info.value.code) == (403, "forbidden")
    assert info.value.type == "invalid_request_error"
    return info.value


def test_keyless_servers_answer_only_loopback_host_and_origin_on_every_route():
    for path in ("/v1/completions", "/health", "/v1/models", "/nothing"):
        check_caller(headers(("host", "127.0.0.1:8000")), None, path)
        check_caller(
            headers(("host", "localhost"), ("origin", "http://localhost:3000")), None, path
        )
        assert "Host" in forbidden(headers(("host", "evil.example:8000")), path).message
        origin = headers(("host", "127.0.0.1:8000"), ("origin", "http://evil.example"))
        assert "Origin" in forbidden(origin, path).message
    forbidden(headers())  # no Host at all
    forbidden(headers(("host", "127.0.0.1"), ("host", "evil.example")))  # every copy counts
    forbidden(headers(("host", "127.0.0.1"), ("origin", "null")))


def test_keyless_servers_answer_no_peer_but_a_loopback_one_whatever_its_headers_say():
    local = headers(("host", "localhost:8000"))
    # None: a Unix socket, or a test client without an address
    for peer in ("127.0.0.1", "::1", "127.8.9.10", "::ffff:127.0.0.1", None, "testclient"):
        check_caller(local, None, "/v1/completions", peer)
    for peer in ("192.0.2.2", "10.0.0.7", "2001:db8::1", "::ffff:192.0.2.2"):
        with pytest.raises(APIError) as info:
            check_caller(local, None, "/v1/completions", peer)
        assert (info.value.status, info.value.code) == (403, "forbidden")
        assert peer in info.value.message
    check_caller(local, "k", "/health", "192.0.2.2")  # with a key the peer does not matter


def test_with_a_key_any_host_or_origin_may_call_but_needs_the_key():
    hostile = [("host", "evil.example"), ("origin", "http://evil.example")]
    check_caller(headers(*hostile, ("authorization", "Bearer k")), "k", "/v1/models")
    check_caller(headers(*hostile), "k", "/health")  # probes need no key
    with pytest.raises(APIError) as info:
        check_caller(headers(*hostile, ("authorization", "Bearer nope")), "k", "/v1/models")
    assert info.value.status == 401


def test_internal_errors_carry_only_an_id():
    body = internal_error("abc123").body()["error"]
    assert body["message"] == "internal server error (request abc123); see the server log"
    assert body["type"] == "server_error"


RAY_ERROR = (
    "pipeline stage failed: \x1b[36mray::StageWorker.run()\x1b[39m (pid=4242, ip=10.1.2.3, "
    'actor_id=8f1c2a9e0d4b4c6f9a7e5d3c, repr=<StageWorker>)\n  File "/x/worker.py", line 9\n'
    "RuntimeError: CUDA error"
)


@pytest.mark.parametrize(
    "reason, expected",
    [
        (RAY_ERROR, "pipeline stage failed"),
        ("pipeline stage failed: RayActorError: The actor died (pid 77)", "pipeline stage failed"),
        ("\x1b[31mstopped by the engine\x1b[0m\ntraceback line", "stopped by the engine"),
        ("node at fe80::1 lost: the request was aborted", "node at"),
        ("worker_id: 9f8e7d6c5b4a39281706f5e4 died", "the engine stopped it"),
        (None, "the engine stopped it"),
        ("", "the engine stopped it"),
        ("the pipeline restarted; retry the request", "the pipeline restarted; retry the request"),
    ],
)
def test_abort_reasons_lose_internals(reason, expected):
    assert safe_reason(reason) == expected


def test_abort_reasons_are_capped():
    reason = safe_reason("x" * 5000)
    assert len(reason) == MAX_REASON_LEN and reason.endswith("...")
    assert safe_reason("ok\x00\x07 done") == "ok done"


def test_api_key_comes_from_the_argument_the_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(API_KEY_FILE_ENV, raising=False)
    key_file = tmp_path / "key"
    key_file.write_text("  file-key\n")
    assert resolve_api_key(None, None) is None
    assert resolve_api_key("arg-key", None) == "arg-key"
    assert resolve_api_key(None, str(key_file)) == "file-key"
    monkeypatch.setenv(API_KEY_ENV, "env-key")
    assert resolve_api_key(None, None) == "env-key"
    assert resolve_api_key(None, str(key_file)) == "file-key"  # an argument beats the environment
    monkeypatch.setenv(API_KEY_FILE_ENV, str(key_file))
    with pytest.raises(ValueError, match=API_KEY_FILE_ENV):
        resolve_api_key(None, None)
    monkeypatch.delenv(API_KEY_ENV)
    assert resolve_api_key(None, None) == "file-key"
    with pytest.raises(ValueError, match="both"):
        resolve_api_key("arg-key", str(key_file))


def test_missing_or_empty_key_files_are_named(tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    with pytest.raises(ValueError, match=f"{empty}.* is empty"):
        resolve_api_key(None, str(empty))
    missing = tmp_path / "missing"
    monkeypatch.setenv(API_KEY_FILE_ENV, str(missing))
    with pytest.raises(ValueError, match=f"{missing}.*No such file"):
        resolve_api_key(None, None)


def test_serve_cli_refuses_a_missing_key_file_before_starting_anything(tiny_ckpt, tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(SystemExit, match=f"dsv4ray serve: cannot read the API key file.*{missing}"):
        main(["serve", "--model", tiny_ckpt, "--api-key-file", missing])


def test_serve_cli_refuses_a_key_and_a_key_file_together(tiny_ckpt, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--model", tiny_ckpt, "--api-key", "k", "--api-key-file", "f"])
    assert "not allowed with argument" in capsys.readouterr().err
