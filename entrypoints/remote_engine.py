"""RemoteEngine: the ``EngineClient`` of the Serve ingress, over the engine deployment's handle.

The ingress (entrypoints/serve.py) holds the client connections; the engine runs in another
process, the engine deployment's replica. ``generate`` streams the replica's ``RequestUpdate``s
(``handle.options(stream=True)``); closing the stream early (a client gone) cancels the call,
and the replica's AsyncEngine aborts the request. Ray's failures become the API's errors: an
engine replica that died (or none to take the request) is a 503 ``engine_unavailable``, which
a stream already under way ends with as an error event and ``[DONE]``; an engine-side
ValueError (a bad prompt) comes back as the RequestError it was (the replica sends it as an item
of the stream, so Serve does not log a client's mistake as a failed call).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import NoReturn

import ray.exceptions
from ray.serve import exceptions as serve_exceptions

from dsv4ray.engine.checks import RequestError
from dsv4ray.engine.config import EngineConfig
from dsv4ray.engine.core import RequestUpdate
from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.entrypoints.openai.errors import APIError
from dsv4ray.text.tokenizer import Tokenizer

# the engine's process is gone or cannot be reached: retrying later reaches a replacement
UNAVAILABLE_ERRORS = (
    ray.exceptions.RayActorError,  # ActorDiedError, ActorUnavailableError
    ray.exceptions.WorkerCrashedError,
    ray.exceptions.NodeDiedError,
    ray.exceptions.ObjectLostError,
    ray.exceptions.LocalRayletDiedError,
    serve_exceptions.DeploymentUnavailableError,
    serve_exceptions.ReplicaUnavailableError,
)


def engine_unavailable() -> APIError:
    return APIError(
        503,
        "the engine replica is unavailable (it stopped or is being replaced); retry later",
        "server_error",
        code="engine_unavailable",
    )


def api_error(exc: BaseException) -> BaseException:
    """What a failed call to the engine deployment becomes on the ingress."""
    if isinstance(exc, ray.exceptions.RayTaskError):  # raised by the engine's own code
        cause = exc.cause
        if isinstance(cause, ValueError):  # a bad request: the API's 400, naming its field
            return RequestError(str(cause), getattr(cause, "field", None))
        if isinstance(cause, UNAVAILABLE_ERRORS):
            return engine_unavailable()
        return exc
    if isinstance(exc, UNAVAILABLE_ERRORS):
        return engine_unavailable()
    if isinstance(exc, serve_exceptions.BackPressureError):
        return APIError(
            503, "the server is overloaded; retry later", "server_error", code="overloaded"
        )
    return exc


def raise_for_api(exc: BaseException) -> NoReturn:
    """Raises what a failed call to the engine deployment is on the ingress (``api_error``):
    the call's own exception when it maps to nothing else."""
    error = api_error(exc)
    if error is exc:
        raise exc
    raise error from None


class RemoteEngine:
    """An EngineClient whose engine is the engine deployment. ``info`` is the engine's
    ``info()``; ``model`` the checkpoint folder on this node (tokenizer, logprob bytes)."""

    def __init__(self, handle, info: dict, model: str) -> None:
        self.handle = handle
        self._stream = handle.options(stream=True)
        config: EngineConfig = info["config"]
        self.config = dataclasses.replace(config, model=model)
        self.max_model_len: int = info["max_model_len"]
        self.tokenizer = Tokenizer(model)

    async def generate(
        self, prompt, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestUpdate]:
        response = self._stream.generate.remote(prompt, params, request_id)
        finished = False
        try:
            async for update in response:
                if isinstance(update, RequestError):  # refused before it ran (a 400)
                    finished = True
                    raise update
                yield update
                if update.output is not None:
                    finished = True
                    return
        except Exception as exc:
            raise_for_api(exc)
        finally:
            if not finished:
                response.cancel()  # the engine replica aborts the request

    async def stats(self) -> dict:
        try:
            return await self.handle.stats.remote()
        except Exception as exc:
            raise_for_api(exc)
