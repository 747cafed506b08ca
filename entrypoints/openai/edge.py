"""Who may call the HTTP API, how much they may send, and what a server error may tell them.

With an API key, every route but ``/health`` and ``/metrics`` needs ``Authorization: Bearer
<key>`` (probes and Prometheus scrape without it, as vLLM allows; neither answers anything of a
request's content). Without one, the server trusts only the machine it runs on, and a web page
the user visits runs there too: a ``text/plain`` POST needs no CORS preflight, and DNS rebinding
lets a page read the replies. So a keyless server answers only requests from a loopback
address (the connection's peer, which the HTTP server knows and no header can change: a server
bound to 0.0.0.0 answers nobody else) whose ``Host`` is a loopback name (``localhost``,
127.x.y.z, ``[::1]``, with or without a port) and whose ``Origin``, when sent, is a loopback
origin; anything else gets 403 ``forbidden`` on every route. A 5xx says what failed without
internals: no reprs, tracebacks, actor names, pids or addresses (those go to the server log
only).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import re
import uuid

from dsv4ray.entrypoints.openai.errors import APIError

MAX_REASON_LEN = 200
KEYLESS_PATHS = ("/health", "/metrics")  # answered without the key (never with request content)
ORIGIN_SCHEMES = ("http", "https")
# ANSI CSI sequences (colours, cursor moves) and two-byte escapes
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
# where internals start in an engine error: Ray's exception names, process and node facts,
# hex ids, addresses; the reason is cut there
_INTERNALS = re.compile(
    r"Ray\w*Error|\w*DiedError|Traceback|\bray::|\b(?:pid|ip|node|actor|worker)(?:_id)?\s*[=:]"
    r"|\b[0-9a-f]{16,}\b|\b\d{1,3}(?:\.\d{1,3}){3}\b|(?:[0-9a-f]{0,4}:){2,7}[0-9a-f]{1,4}",
    re.IGNORECASE,
)


class ClientGone(BaseException):
    """The client disconnected while its answer was computed: the request is given up and
    nothing is answered (a BaseException, as a cancellation, so that no handler answers it as a
    server failure)."""


async def unless_client_gone(receive, work):
    """work's result, unless the ASGI server says the client disconnected first (an
    ``http.disconnect`` message): then work is cancelled and ClientGone raised. Call once the
    request body has been read: the next message is then the disconnect. A streamed answer
    learns it from its sends; this is for answers sent whole, which send nothing until the
    end."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and not gone.result():  # another message: nothing more to learn
            await asyncio.wait((task,))
    except BaseException:  # this handler was cancelled: so is the work
        await _cancel(task)
        raise
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    await _cancel(task)
    raise ClientGone()


async def _cancel(task) -> None:
    """Cancels task and waits until it ended: whatever it was reading is left alone after."""
    task.cancel()
    await asyncio.wait((task,))
    if not task.cancelled():  # a cancelled gather ends with its children's CancelledError
        task.exception()


async def _disconnect(receive) -> bool:
    """Whether the next message says the client left. After the body ASGI servers send nothing
    else, and one that does is not listened to; nor is a receive that fails (under Ray Serve a
    gone client's receive raises, and Serve cancels the handler itself)."""
    try:
        message = await receive()
    except Exception:
        return False
    return message.get("type") == "http.disconnect"


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address (127.0.0.0/8, ::1); no port, no brackets."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_of(authority: str) -> str | None:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port`` -> host; None when malformed."""
    if authority.startswith("["):
        host, closed, rest = authority[1:].partition("]")
        if not closed:
            return None
    else:
        host, colon, port = authority.partition(":")
        rest = colon + port
    if rest and not (rest[0] == ":" and rest[1:].isascii() and rest[1:].isdigit()):
        return None
    return host


def is_loopback_authority(authority: str) -> bool:
    host = host_of(authority)
    return host is not None and is_loopback(host)


def is_loopback_origin(origin: str) -> bool:
    """``http(s)://<loopback host>[:port]``; ``null`` and every other origin are not."""
    scheme, sep, authority = origin.partition("://")
    return bool(sep) and scheme.lower() in ORIGIN_SCHEMES and is_loopback_authority(authority)


def check_caller(headers, api_key: str | None, path: str, client: str | None = None) -> None:
    """The key when there is one (``KEYLESS_PATHS`` excepted), else a loopback peer, Host and
    Origin only. ``headers``: Starlette's (a request may repeat a header; every copy must
    pass); ``client``: the peer's address (the ASGI scope's; None or a name that is no address,
    as over a Unix socket: the headers decide)."""
    if api_key is not None:
        if path not in KEYLESS_PATHS:
            check_key(headers.get("authorization"), api_key)
        return
    if _remote(client):
        raise APIError(
            403,
            f"this server has no API key, so it only answers clients on its own machine over a "
            f"loopback address, not {client}; start it with an API key to serve other hosts",
            code="forbidden",
        )
    hosts = headers.getlist("host")
    if not hosts or not all(is_loopback_authority(h.strip()) for h in hosts):
        raise forbidden("Host", "a loopback host (localhost, 127.0.0.1 or [::1])")
    if not all(is_loopback_origin(o.strip()) for o in headers.getlist("origin")):
        raise forbidden("Origin", "a loopback origin such as http://localhost:8000")


def _remote(client: str | None) -> bool:
    """An IP address that is not a loopback one (an IPv4 address mapped into IPv6, as a
    dual-stack socket reports it, counts as itself)."""
    try:
        address = ipaddress.ip_address(client) if client is not None else None
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address is not None and not (mapped or address).is_loopback


def forbidden(header: str, allowed: str) -> APIError:
    return APIError(
        403,
        f"this server has no API key, so it only answers local clients: the {header} header must "
        f"be {allowed}; start it with an API key to serve other hosts",
        code="forbidden",
    )


def check_key(header: str | None, key: str) -> None:
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise APIError(
            401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
        )
    if not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise APIError(401, "incorrect API key", code="invalid_api_key")


async def read_body(request, limit: int) -> bytes:
    """The body of a Starlette request; 413 past ``limit`` bytes, declared or streamed."""
    too_large = APIError(
        413, f"the request body is larger than {limit} bytes", code="request_too_large"
    )
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):  # a compressed body would read as bad UTF-8
        raise APIError(415, f"Content-Encoding {encoding!r} is not supported; send the JSON "
                       "body uncompressed", code="unsupported_media_type")  # fmt: skip
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def new_error_id() -> str:
    return uuid.uuid4().hex[:16]


def internal_error(error_id: str) -> APIError:
    """What a client learns about a bug: that it happened, and the id the log has it under."""
    return APIError(
        500,
        f"internal server error (request {error_id}); see the server log",
        "server_error",
    )


def aborted(reason: str | None) -> APIError:
    return APIError(500, f"the request was aborted: {safe_reason(reason)}", "server_error")


def safe_reason(reason: str | None) -> str:
    """An engine's abort reason fit for a client: no ANSI codes, its first line only, cut
    before any internals, printable, at most ``MAX_REASON_LEN`` characters."""
    text = _ANSI.sub("", reason or "").strip()
    text = text.splitlines()[0] if text else ""
    internals = _INTERNALS.search(text)
    if internals is not None:
        text = text[: internals.start()]
    text = "".join(ch for ch in text if ch.isprintable()).strip(" \t:;,.(-")
    if len(text) > MAX_REASON_LEN:
        text = text[: MAX_REASON_LEN - 3].rstrip() + "..."
    return text or "the engine stopped it"
