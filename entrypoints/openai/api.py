"""The FastAPI application over an ``OpenAIServer``: routes, the caller check, and OpenAI's error
body for every failure.

Layers, outermost first: ``Edge`` (pure ASGI) gives each route one spelling (``/v1/models/`` is
``/v1/models``), runs ``edge.check_caller`` before any routing (so a caller without the key
learns nothing of the routes), counts every answer for the metrics and turns an unexpected
exception into a 500 that names an error id, never internals (the log has the traceback under
it). Inside it, FastAPI routes the request; its exception handlers answer ``APIError`` (bad
requests, limits, overload), unknown routes (404 ``not_found``), wrong methods (405
``bad_method``) and FastAPI's own validation errors (400 naming the field) with
``{"error": {"message", "type", "param", "code"}}``. Request bodies are parsed by the routes
themselves (``protocol.parse_request``: size, depth and number limits first), not by FastAPI.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from ray.exceptions import TaskCancelledError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from dsv4ray.entrypoints.openai.edge import (
    ClientGone,
    check_caller,
    internal_error,
    new_error_id,
)
from dsv4ray.entrypoints.openai.errors import APIError, bad_request

log = logging.getLogger("dsv4ray.serve")


def build_api(server) -> FastAPI:
    """server: an ``OpenAIServer`` (its route methods, options, lifespan and metrics)."""
    app = FastAPI(
        title="dsv4ray",
        docs_url=None,  # no routes beyond the API's: docs would be one more surface to guard
        redoc_url=None,
        openapi_url=None,
        redirect_slashes=False,  # Edge already gives each route one spelling
        lifespan=server.lifespan,
    )
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat, methods=["POST"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", server.model, methods=["GET"])
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/v1/dsv4ray/stats", server.stats, methods=["GET"])
    app.add_api_route("/metrics", server.scrape, methods=["GET"])
    app.add_api_route("/tokenize", server.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", server.detokenize, methods=["POST"])
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_middleware(Edge, server=server)
    return app


def error_response(err: APIError) -> JSONResponse:
    if err.status >= 500:
        log.warning("%s", err.message)
    headers = {"Retry-After": "1"} if err.status == 503 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


async def _api_error(request: Request, err: APIError) -> JSONResponse:
    return error_response(err)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's routing errors, in the API's words."""
    method, path = request.method, route_path(request.scope)
    if exc.status_code == 404:
        err = APIError(404, f"no such route: {method} {path}", code="not_found")
    elif exc.status_code == 405:
        err = APIError(405, f"method {method} is not allowed on {path}", code="bad_method")
    else:
        kind = "server_error" if exc.status_code >= 500 else "invalid_request_error"
        err = APIError(exc.status_code, str(exc.detail), kind)
    response = error_response(err)
    response.headers.update(exc.headers or {})  # 405's Allow
    return response


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A parameter FastAPI validated (path, query): 400 naming it."""
    error = exc.errors()[0]
    loc = [str(part) for part in error["loc"][1:]]  # without "path", "query" or "body"
    field = ".".join(loc)
    return error_response(bad_request(f"{field}: {error['msg']}", field or None))


def route_path(scope) -> str:
    """The path below the app's root, one spelling per route: surrounding slashes stripped."""
    path, root = scope.get("path", "/"), scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    return "/" + path.strip("/") if path.strip("/") else "/"


class Edge:
    """Pure ASGI (no buffering of streamed answers): see the module docstring."""

    def __init__(self, app, server) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        scope = {**scope, "path": scope.get("root_path", "") + path}
        status: list[int] = []

        async def counted_send(message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
                self.server.response_started(path, message["status"])
            await send(message)

        try:
            peer = (scope.get("client") or (None,))[0]
            check_caller(Headers(scope=scope), self.server.options.api_key, path, peer)
            await self.app(scope, receive, counted_send)
        except APIError as err:  # the caller check; the routes' own go through _api_error
            await error_response(err)(scope, receive, counted_send)
        except (TaskCancelledError, ClientGone):  # Serve cancelled the call, or the client
            log.info("%s %s: the client went away", scope["method"], path)  # disconnected
        except Exception:  # a bug: answer it like the API would (no internals) and keep serving
            error_id = new_error_id()
            log.exception("%s %s failed (request %s)", scope["method"], path, error_id)
            if not status:  # after the headers went out there is nothing left to tell
                await error_response(internal_error(error_id))(scope, receive, counted_send)
