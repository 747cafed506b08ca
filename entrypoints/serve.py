"""The Ray Serve application: an OpenAI-compatible API in front of engine replicas.

``build_app(config)`` is the Serve entry point (``serve run dsv4ray.entrypoints.serve:build_app`` or
``import_path`` in deploy/serve.yaml); ``run_server`` backs ``dsv4ray serve``. Config keys:

    model                checkpoint folder (default: $DSV4RAY_MODEL, else ./.tiny, else the .tiny
                         beside the package; without either, the demo checkpoint, said loudly);
                         resolved to an absolute path, read by each replica where it runs
    served_model_name    the name clients send as "model" (default: the folder's name)
    accelerator          auto | cpu | gpu: the stages' bundles (auto: gpu when the cluster has
                         GPUs or its config declares GPU node types); each replica takes its
                         device from the bundles it was given
    stage_resources      custom resources every stage's bundle also asks for (pins stages to a
                         node type, e.g. {"accelerator_type:H100": 0.001})
    api_key              when set, every route but /health and /metrics requires
                         "Authorization: Bearer <key>"; without one,
                         only loopback Host and Origin headers are answered (default:
                         $DSV4RAY_API_KEY as the process building the app sees it, else none)
    api_key_file         a file holding the key (stripped), instead of api_key (default:
                         $DSV4RAY_API_KEY_FILE); a key given both ways is an error
    max_body_bytes       larger request bodies get 413 (default 1 MiB)
    max_pending_requests generation requests per ingress replica before 503s (default 256)
    num_replicas | autoscaling_config   passed to the engine deployment as they are
    pp_size, kv_cache_dtype, max_total_tokens, ... any other EngineConfig option (use_ray is
                         always True: the stages are Ray actors in the replica's placement group)
    prefill_pp_size      > 0: the replica owns a prefill engine too (a prefill actor with its own
                         placement group of that many stages); its pipeline decodes
                         (cluster/pd.py)

Two deployments, so that the process holding the client connections is not the one running the
engine (as Ray Serve LLM splits them):

- ``OpenAIDeployment`` (the engine; its name and options are the ones the single deployment had,
  so ``deployments`` entries of Serve config files apply to it): AsyncEngine over stage actors in
  the replica's placement group; ``generate`` streams a request's ``RequestUpdate``s (a caller
  that cancels aborts the request), ``stats``, ``info``, ``check_health``.
- ``OpenAIIngress`` (``@serve.ingress``, ``INGRESS_CPUS``, no placement group): the FastAPI app
  that ``OpenAIServer`` builds (entrypoints/openai/api.py: routes, caller check, OpenAI error
  bodies) over a ``RemoteEngine`` (entrypoints/remote_engine.py) calling the engine's handle. It
  loads the tokenizer from the model path itself and takes ``max_model_len`` and the engine's
  config from the engine's ``info()``; metrics live here (engine gauges from the ``stats`` poll,
  which pauses while the engine is idle and nothing is pending, so an engine that autoscales to
  zero is not kept up). Replicas: the engine's ``num_replicas`` when it is fixed, else the
  engine's ``autoscaling_config`` with min/initial/max replicas at least 1 (serve_config.py
  ``ingress_options``). When an engine replica dies, the ingress ends each open stream with an
  error event (503 ``engine_unavailable``) and ``[DONE]``; other requests get that 503.

Placement: the engine deployment declares ``placement_group_bundles`` = [bundle 0: stage 0 + the
replica's CPU, then one bundle per further stage] with strategy PACK, and the replica hands
``get_current_placement_group()`` to AsyncEngine, so stage i lands in bundle i.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from dsv4ray.cluster.placement import (
    bundle_device,
    ensure_ray,
    started_local_ray,
    stop_local_ray,
)
from dsv4ray.engine.checks import RequestError
from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.engine.spec import describe
from dsv4ray.entrypoints.async_engine import AsyncEngine
from dsv4ray.entrypoints.model_path import default_model, usage_exit
from dsv4ray.entrypoints.openai.edge import is_loopback
from dsv4ray.entrypoints.openai.metrics import ServeMetrics
from dsv4ray.entrypoints.openai.server import OpenAIServer
from dsv4ray.entrypoints.remote_engine import RemoteEngine
from dsv4ray.entrypoints.serve_config import (
    DEPLOYMENT_NAME,
    ServeSettings,
    demo_warning,
    ingress_options,
    resolve_api_key,
)
from dsv4ray.entrypoints.serve_file import APP_NAME
from dsv4ray.entrypoints.stop_signals import signals_held, stop_asked
from dsv4ray.sources import fetch_model, is_remote

log = logging.getLogger("dsv4ray.serve")

__all__ = [
    "APP_NAME",
    "OpenAIDeployment",
    "OpenAIIngress",
    "ServeSettings",
    "build_app",
    "run_server",
]


@serve.deployment
class OpenAIDeployment:
    """The engine: AsyncEngine over stage actors in this replica's placement group."""

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        if settings.demo_model:
            log.warning("%s", demo_warning(settings.model))
        placement = ray.util.get_current_placement_group()
        self.engine = AsyncEngine(
            settings.model,
            placement=placement,
            device=bundle_device(placement.bundle_specs),
            **settings.engine_options,
        )

    async def generate(self, prompt, params: SamplingParams, request_id: str):
        """The request's RequestUpdates as the engine makes them (a streaming call); a caller
        that cancels (its client went away) aborts the request. A request the engine refuses
        (ValueError, before any update) comes back as one RequestError item, not as a raised
        error: Serve would log each client's mistake with a traceback."""
        try:
            async for update in self.engine.generate(prompt, params, request_id=request_id):
                yield update
        except ValueError as exc:
            yield RequestError(str(exc), getattr(exc, "field", None))

    async def info(self) -> dict:
        """What the startup log prints, where the stages run, and the engine's config."""
        config = self.engine.config
        return {
            "placement_group_id": ray.util.get_current_placement_group().id.hex(),
            **self.engine.describe(),
            "model": config.model,
            "served_model_name": self.settings.served_model_name,
            "pp_size": config.pp_size,
            "prefill_pp_size": config.prefill_pp_size,
            "kv_cache_dtype": config.kv_cache_dtype,
            "speculative_num_steps": config.speculative_num_steps,
            "device": config.device,
            "max_model_len": self.engine.max_model_len,
            "demo_model": self.settings.demo_model,
            "config": config,
            "engine_pid": os.getpid(),
        }

    async def stats(self) -> dict:
        """The engine's counters, with ``engine_id`` (this replica: the ingress's metrics keep
        the totals of each engine replica apart)."""
        stats = await self.engine.stats()
        return {**stats, "engine_id": serve.get_replica_context().replica_id.unique_id}

    async def check_health(self) -> None:
        await asyncio.wait_for(self.engine.stats(), timeout=30)

    def __del__(self) -> None:
        if hasattr(self, "engine"):  # absent when the constructor failed
            self.engine.shutdown()


@serve.deployment
@serve.ingress()
class OpenAIIngress:
    """The HTTP side: OpenAIServer's app over a RemoteEngine (the engine deployment's handle).
    Its health is its own: an engine replica that dies is replaced without this one."""

    async def __init__(self, engine: DeploymentHandle, settings: ServeSettings) -> None:
        self.handle = engine
        info = await _engine_info(engine)  # waits for an engine replica, or its failure
        model = await asyncio.to_thread(local_model, settings.model)
        self.engine = await asyncio.to_thread(RemoteEngine, engine, info, model)
        metrics = ServeMetrics(settings.served_model_name)
        options = dataclasses.replace(settings.server_options(), poll_idle_engine=False)
        self.server = OpenAIServer(self.engine, options, metrics)

    def __serve_build_asgi_app__(self):
        return self.server.app

    async def info(self) -> dict:
        """The engine's ``info()`` (one engine replica's)."""
        return await self.handle.info.remote()

    async def stats(self) -> dict:
        return await self.handle.stats.remote()

    def __del__(self) -> None:
        if hasattr(self, "server"):  # absent when the constructor failed
            self.server.close()


ENGINE_POLL_S = 5.0  # how often a waiting ingress asks Serve whether the engine failed


async def _engine_info(engine: DeploymentHandle) -> dict:
    """The engine's info once a replica is up; a RuntimeError with the engine deployment's own
    message once Serve gives up on it (a missing checkpoint, say): the ingress fails with it
    instead of starting forever, so the application fails and says why. A call that fails
    while Serve has not given up (an engine replica that died starting, being replaced) is
    asked again."""
    task = asyncio.ensure_future(_awaited(engine.info.remote()))
    while True:
        try:
            return await asyncio.wait_for(asyncio.shield(task), ENGINE_POLL_S)
        except asyncio.TimeoutError:
            failed = await asyncio.to_thread(_engine_failure)
        except Exception as exc:  # the handle gave up on this call
            failed = await asyncio.to_thread(_engine_failure)
            if failed is None:
                log.warning("engine not ready (%s: %s); asking again", type(exc).__name__, exc)
                await asyncio.sleep(ENGINE_POLL_S)
                task = asyncio.ensure_future(_awaited(engine.info.remote()))
        if failed is not None:
            task.cancel()
            raise RuntimeError(f"the engine deployment failed: {failed}") from None


async def _awaited(response):
    return await response


def _engine_failure() -> str | None:
    """The engine deployment's message when Serve marked it failed, else None."""
    try:
        app = serve.status().applications.get(serve.get_replica_context().app_name)
    except Exception as exc:  # the controller's view is a hint: keep waiting without it
        log.debug("could not read Serve's status: %s", exc)
        return None
    deployment = app.deployments.get(DEPLOYMENT_NAME) if app is not None else None
    if deployment is None or deployment.status != "DEPLOY_FAILED":
        return None
    return deployment.message or "no message"


def local_model(model: str) -> str:
    """The checkpoint folder on this node, as the engine resolves it (a URI or a Hugging Face
    id is fetched once per machine: sources.py)."""
    if is_remote(model):
        return fetch_model(model)
    return model


def build_app(config: Mapping | None = None):
    """The Serve application for ``config`` (see the module docstring for its keys); Serve's
    builders take exactly this one argument."""
    return application(config)


def application(config: Mapping | None = None, deployment: Mapping | None = None):
    """``build_app`` with further deployment options (a Serve config's ``deployments`` entry,
    as ``serve run`` applies them)."""
    settings = ServeSettings.from_config(dict(config or {}))
    options = {**settings.deployment_options(), **(deployment or {})}
    engine = OpenAIDeployment.options(**options).bind(settings)
    return OpenAIIngress.options(**ingress_options(options)).bind(engine, settings)


def run_server(
    config: Mapping,
    host: str = "127.0.0.1",
    port: int = 8000,
    deployment: Mapping | None = None,
    serve_options: Mapping | None = None,
) -> int:
    """``dsv4ray serve``: starts (or joins, with RAY_ADDRESS) Ray, runs the app, blocks until
    Ctrl-C. Any address but loopback needs an API key. deployment: further deployment options;
    serve_options: further ``serve.start`` arguments (both from a Serve config file)."""
    try:
        api_key = resolve_api_key(config.get("api_key"), config.get("api_key_file"))
    except ValueError as exc:
        raise SystemExit(f"dsv4ray serve: {exc}") from None
    config = {k: v for k, v in config.items() if k != "api_key_file"} | {"api_key": api_key}
    if not is_loopback(host) and not api_key:
        raise SystemExit(
            f"dsv4ray serve: refusing to listen on {host!r} without an API key; pass "
            "--api-key-file (or set DSV4RAY_API_KEY_FILE or DSV4RAY_API_KEY), or bind 127.0.0.1"
        )
    joined = bool(os.environ.get("RAY_ADDRESS"))
    stamps = _Stamps()  # the app's deploy stamps: which one under APP_NAME is this command's
    _check_options(config, deployment)  # a bad value is one line, before any Ray starts
    stop = _stop_on_signals()
    try:
        ensure_ray()
        stop = _stop_on_signals(stop)  # again: Ray's init installs handlers of its own
        app = _application(config, deployment)  # accelerator "auto": the cluster's GPUs
        info, (host, port) = _start(app, serve_options, host, port, stamps)
        # the handlers again: starting Serve may have installed its own meanwhile; serving
        # before the line that says so goes out, so a signal right after it only sets ``stop``
        stop = _stop_on_signals(stop)
        stop.serving = True
        print(startup_line(info, host, port), flush=True)
        # short waits: a signal the OS hands to one of Ray's threads runs its Python handler
        # only when this (main) thread next runs, so it must never sleep long
        while not stop.wait(0.2):
            pass
    except KeyboardInterrupt:
        pass
    except SystemExit as exc:  # a SIGTERM while ray.init had its own handler in place
        if not stop_asked(exc):
            raise
    finally:
        with signals_held():  # the shutdown runs to its end (seconds)
            print("dsv4ray serve: stopping", flush=True)
            # ray.init joins a `ray start` on this machine by itself (a signal may have cut
            # the start short anywhere after that)
            joined = joined or (ray.is_initialized() and not started_local_ray())
            if joined and ray.is_initialized():  # other applications keep running
                _delete_app(stamps)
            elif not joined:
                # Serve's shutdown would start a Ray if a signal cut ray.init short
                if ray.is_initialized():
                    _bounded(serve.shutdown, SERVE_SHUTDOWN_S, "Serve's shutdown")
                stop_local_ray()
    return 0


def _check_options(config: Mapping, deployment: Mapping | None) -> None:
    """The app's options checked without Ray. "auto" is resolved only once Ray is up (a Ray
    started with ``ray start`` on this machine, which ray.init joins, may have GPU nodes this
    machine lacks), so here an option counts as bad only when no accelerator takes it."""
    checked = {**config, "model": config.get("model") or default_model()}  # no demo warning
    if checked.get("accelerator", "auto") != "auto" or checked.get("device") is not None:
        candidates = [checked]
    else:
        candidates = [{**checked, "accelerator": accelerator} for accelerator in ("cpu", "gpu")]
    problems = []
    for candidate in candidates:
        try:
            application(candidate, deployment)
            return
        except (ValueError, TypeError) as exc:
            problems.append(exc)
    usage_exit(f"dsv4ray serve: {problems[0]}")


def _application(config: Mapping, deployment: Mapping | None):
    """``application``; a bad option value is a usage error (one line, exit code 2)."""
    try:
        return application(config, deployment)
    except (ValueError, TypeError) as exc:
        usage_exit(f"dsv4ray serve: {exc}")


SERVE_SHUTDOWN_S = 60.0  # Serve drains its replicas first; Ray's shutdown ends them anyway


def _bounded(fn, timeout_s: float, what: str) -> None:
    """fn() on a thread, waited for at most timeout_s: a shutdown that hangs (a handle
    waiting on a router that is gone) must not keep the command from exiting."""
    worker = threading.Thread(target=fn, name=what, daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        log.warning("%s did not finish in %.0f s; stopping without it", what, timeout_s)


@dataclass
class _Stamps:
    """serve.status's last_deployed_time_s of APP_NAME just before this command deployed it,
    and once it had (a later deploy under the name changes it)."""

    before: float | None = None
    ours: float | None = None
    asked: bool = False  # serve.run was called


def _start(app, serve_options, host: str, port: int, stamps: _Stamps):
    """Runs the application -> (its engine's info, the (host, port) it is served at); records
    the app's deploy stamps in ``stamps``."""
    options = dict(serve_options or {})
    http = {**options.pop("http_options", {}), "host": host, "port": port}
    try:
        serve.start(http_options=http, **options)
    except Exception as exc:  # the proxy's bind: a port in use, a host not of this machine
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        raise SystemExit(f"dsv4ray serve: cannot serve HTTP on {host}:{port}: {first}") from None
    running = _running_http(host, port)
    if running is not None:  # as serve run does, the app goes where Serve listens: say where
        print(
            f"dsv4ray serve: WARNING: the cluster's Serve already listens on {running[0]}:"
            f"{running[1]} (a Serve instance keeps the HTTP options it started with), not "
            f"{host}:{port}; serving there (serve shutdown first to move it)",
            file=sys.stderr,
        )
    stamps.before, stamps.asked = _deployed_at(), True
    handle = serve.run(app, name=APP_NAME, route_prefix="/")
    stamps.ours = _deployed_at()
    info = handle.info.remote().result()
    if info["demo_model"]:  # beside the line that says where it listens (the build logged it)
        print(f"dsv4ray serve: WARNING: {demo_warning(info['model'])}", file=sys.stderr)
    return info, running or (host, port)


def _running_http(host: str, port: int) -> tuple[str, int] | None:
    """(host, port) of the Serve instance running on the cluster when they are not the ones
    asked for (serve.start joins a running instance and keeps its options), else None."""
    try:
        from ray.serve.context import _get_global_client

        config = _get_global_client().http_config
        running = (config.host, config.port)
    except Exception as exc:  # the check is best effort: Serve's client is not public API
        log.debug("could not read the running Serve's HTTP options: %s", exc)
        return None
    return None if running == (host, port) else running


def _deployed_at() -> float | None:
    """When the application named APP_NAME was last deployed (None: there is none)."""
    app = serve.status().applications.get(APP_NAME)
    return None if app is None else app.last_deployed_time_s


def _delete_app(stamps: _Stamps) -> None:
    """This command's application on a cluster it joined, as far as it got; not one it never
    deployed (stopped before its deploy, or the deploy never changed the app under the name),
    nor one deployed under its name since (``serve deploy`` of a config that replaced it)."""
    try:
        now = _deployed_at() if stamps.asked else None
        theirs = not stamps.asked or now is None or now == stamps.before
        if stamps.ours is not None:
            theirs = now != stamps.ours
        if theirs:
            if now is not None:
                print(f"dsv4ray serve: the {APP_NAME} application there is not the one this "
                      "command deployed: leaving it running", flush=True)  # fmt: skip
            return
        serve.delete(APP_NAME)
    except Exception as exc:  # interrupted before Serve ran on the cluster
        log.warning("could not delete the %s application: %s", APP_NAME, exc)


class _Stop(threading.Event):
    """Set by SIGINT or SIGTERM once serving; before that (building, deploying: minutes for a
    large checkpoint) a signal interrupts the start with KeyboardInterrupt."""

    serving = False


def _stop_on_signals(stop: _Stop | None = None) -> _Stop:
    """SIGINT and SIGTERM stop the command (installed after Ray, which sets its own: Ray's
    SIGTERM handler aborts the process); stop: the event an earlier install returned."""
    stop = stop if stop is not None else _Stop()

    def handler(signum, frame) -> None:
        stop.set()
        if not stop.serving:
            raise KeyboardInterrupt

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, handler)
    return stop


def startup_line(info: dict, host: str, port: int) -> str:
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"
    steps = info.get("speculative_num_steps", 0)
    drafts = f"{describe(steps)}, " if steps else ""
    pp = f"pp {info['pp_size']}"
    if info.get("prefill_pp_size"):
        pp = f"prefill pp {info['prefill_pp_size']} -> decode {pp}"
    return (
        f"dsv4ray serve: model {info['model']} (as {info['served_model_name']!r}), "
        f"{pp}, kv {info['kv_cache_dtype']} on {info['device']}, capacity "
        f"{info['capacity_tokens']} tokens (max_model_len {info['max_model_len']}), "
        f"{drafts}listening on {url}"
    )
