"""The Ray Serve application: an OpenAI-compatible API where each replica owns one pipeline.

``build_app(config)`` is the Serve entry point (``serve run dsv4ray.entrypoints.serve:build_app`` or
``import_path`` in deploy/serve.yaml); ``run_server`` backs ``dsv4ray serve``. Config keys:

    model                checkpoint folder (default: $DSV4RAY_MODEL, else ./.tiny, else the .tiny
                         beside the package); resolved to an absolute path
    served_model_name    the name clients send as "model" (default: the folder's name)
    api_key              when set, /v1/* requires "Authorization: Bearer <key>"; without one,
                         only loopback Host and Origin headers are answered (default:
                         $DSV4RAY_API_KEY as the process building the app sees it, else none)
    api_key_file         a file holding the key (stripped), instead of api_key (default:
                         $DSV4RAY_API_KEY_FILE); a key given both ways is an error
    max_body_bytes       larger request bodies get 413 (default 1 MiB)
    max_pending_requests generation requests per replica before 503s (default 256)
    num_replicas | autoscaling_config   passed to the deployment as they are
    pp_size, kv_cache_dtype, max_total_tokens, ... any other EngineConfig option (use_ray is
                         always True: the stages are Ray actors in the replica's placement group)
    prefill_pp_size      > 0: the replica owns a prefill engine too (a prefill actor with its own
                         placement group of that many stages); its pipeline decodes
                         (cluster/pd.py)

Each replica is a FastAPI ingress (``@serve.ingress``): the app that ``OpenAIServer`` builds over
the replica's engine (entrypoints/openai/api.py: routes, caller check, OpenAI error bodies) is
handed to Serve once the engine is up (``__serve_build_asgi_app__``).

Placement: the deployment declares ``placement_group_bundles`` = [bundle 0: stage 0 + the
replica's CPU, then one bundle per further stage] with strategy PACK, and the replica hands
``get_current_placement_group()`` to AsyncEngine, so stage i lands in bundle i.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import ray
from ray import serve

from dsv4ray.cluster.placement import CPU_BUNDLE, GPU_BUNDLE, ensure_ray
from dsv4ray.engine.config import EngineConfig
from dsv4ray.engine.spec import describe
from dsv4ray.entrypoints.async_engine import AsyncEngine
from dsv4ray.entrypoints.model_path import default_model
from dsv4ray.entrypoints.openai.edge import is_loopback
from dsv4ray.entrypoints.openai.metrics import ServeMetrics
from dsv4ray.entrypoints.openai.server import OpenAIServer, ServerOptions

log = logging.getLogger("dsv4ray.serve")

APP_NAME = "dsv4ray"
API_KEY_ENV = "DSV4RAY_API_KEY"
API_KEY_FILE_ENV = "DSV4RAY_API_KEY_FILE"
DEPLOYMENT_NAME = "OpenAIDeployment"
REPLICA_CPUS = {True: 1.0, False: 0.5}  # by use_gpu; a GPU bundle already has room for it
ONGOING_HEADROOM = 16  # health, models and stats calls beside max_pending_requests generations
_SERVE_KEYS = ("served_model_name", "max_body_bytes", "max_pending_requests")
_KEY_KEYS = ("model", "api_key", "api_key_file")  # resolved by from_config
_DEPLOYMENT_KEYS = ("num_replicas", "autoscaling_config")
_ENGINE_KEYS = tuple(f.name for f in dataclasses.fields(EngineConfig) if f.name != "model")


@dataclass(frozen=True)
class ServeSettings:
    model: str
    served_model_name: str
    engine_options: dict = field(default_factory=dict)
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_pending_requests: int = 256
    deployment_overrides: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_pending_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string or None")
        if not self.served_model_name:
            raise ValueError("served_model_name must be a non-empty string")
        # fails here, at build time, on a bad option or a missing checkpoint (named)
        EngineConfig.build(self.model, **self.engine_options)

    @classmethod
    def from_config(cls, config: Mapping) -> ServeSettings:
        unknown = sorted(set(config) - {*_KEY_KEYS, *_SERVE_KEYS, *_DEPLOYMENT_KEYS, *_ENGINE_KEYS})
        if unknown:
            raise ValueError(f"unknown serve config key {unknown[0]!r}")
        if "use_ray" in config and config["use_ray"] is not True:
            raise ValueError("use_ray: the Serve app always runs its stages as Ray actors")
        model = os.path.abspath(config.get("model") or default_model())
        engine = {k: config[k] for k in _ENGINE_KEYS if k in config}
        engine["use_ray"] = True
        engine.setdefault("device", _default_device())
        serve_opts = {k: config[k] for k in _SERVE_KEYS if k in config}
        serve_opts.setdefault("served_model_name", os.path.basename(model.rstrip("/")))
        serve_opts["api_key"] = resolve_api_key(config.get("api_key"), config.get("api_key_file"))
        overrides = {k: config[k] for k in _DEPLOYMENT_KEYS if k in config}
        return cls(model, engine_options=engine, deployment_overrides=overrides, **serve_opts)

    @property
    def use_gpu(self) -> bool:
        return self.engine_options["device"] == "cuda"

    def bundles(self) -> list[dict]:
        """Bundle 0 hosts stage 0 and the replica; bundle i > 0 hosts stage i."""
        stage = dict(GPU_BUNDLE if self.use_gpu else CPU_BUNDLE)
        first = dict(stage)
        if not self.use_gpu:
            first["CPU"] = stage["CPU"] + REPLICA_CPUS[False]
        return [first] + [dict(stage) for _ in range(self.engine_options.get("pp_size", 1) - 1)]

    def deployment_options(self) -> dict:
        return {
            "name": DEPLOYMENT_NAME,
            "ray_actor_options": {"num_cpus": REPLICA_CPUS[self.use_gpu]},
            "placement_group_bundles": self.bundles(),
            "placement_group_strategy": "PACK",
            "max_ongoing_requests": self.max_pending_requests + ONGOING_HEADROOM,
            **self.deployment_overrides,
        }

    def server_options(self) -> ServerOptions:
        return ServerOptions(
            served_model_name=self.served_model_name,
            api_key=self.api_key,
            max_body_bytes=self.max_body_bytes,
            max_pending_requests=self.max_pending_requests,
        )


@serve.deployment
@serve.ingress()
class OpenAIDeployment:
    """A thin shell: the engine in this replica's placement group, HTTP to OpenAIServer's app."""

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.engine = AsyncEngine(
            settings.model,
            placement=ray.util.get_current_placement_group(),
            **settings.engine_options,
        )
        metrics = ServeMetrics(settings.served_model_name)
        self.server = OpenAIServer(self.engine, settings.server_options(), metrics)

    def __serve_build_asgi_app__(self):
        return self.server.app

    async def info(self) -> dict:
        """What the startup log prints, and where the stages run."""
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
        }

    async def stats(self) -> dict:
        return await self.engine.stats()

    async def check_health(self) -> None:
        await asyncio.wait_for(self.engine.stats(), timeout=30)

    def __del__(self) -> None:
        if hasattr(self, "server"):  # absent when the constructor failed
            self.server.close()
        if hasattr(self, "engine"):
            self.engine.shutdown()


def resolve_api_key(api_key: str | None, api_key_file: str | None) -> str | None:
    """The key given, else the one in ``api_key_file``, else $DSV4RAY_API_KEY, else the one in
    the file at $DSV4RAY_API_KEY_FILE, else None. Both a key and a file, from the arguments or
    from the environment, is an error: which one was meant is unclear."""
    if api_key is not None and api_key_file is not None:
        raise ValueError("api_key and api_key_file are both set; give one")
    if api_key_file is not None:
        return read_api_key_file(api_key_file)
    if api_key is not None:
        return api_key
    env_key, env_file = os.environ.get(API_KEY_ENV), os.environ.get(API_KEY_FILE_ENV)
    if env_key and env_file:
        raise ValueError(f"${API_KEY_ENV} and ${API_KEY_FILE_ENV} are both set; set one")
    return read_api_key_file(env_file) if env_file else env_key or None


def read_api_key_file(path: str) -> str:
    """The file's text without surrounding whitespace; a missing or empty file is an error
    naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise ValueError(f"cannot read the API key file {path!r}: {reason}") from None
    if not key:
        raise ValueError(f"the API key file {path!r} is empty")
    return key


def build_app(config: Mapping | None = None):
    """The Serve application for ``config`` (see the module docstring for its keys)."""
    settings = ServeSettings.from_config(dict(config or {}))
    return OpenAIDeployment.options(**settings.deployment_options()).bind(settings)


def run_server(config: Mapping, host: str = "127.0.0.1", port: int = 8000) -> int:
    """``dsv4ray serve``: starts (or joins, with RAY_ADDRESS) Ray, runs the app, blocks until
    Ctrl-C. Any address but loopback needs an API key."""
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
    ensure_ray()
    app = build_app(config)
    serve.start(http_options={"host": host, "port": port})
    handle = serve.run(app, name=APP_NAME, route_prefix="/")
    info = handle.info.remote().result()
    print(startup_line(info, host, port), flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("dsv4ray serve: stopping", flush=True)
    finally:
        if joined:  # other applications on the cluster keep running
            serve.delete(APP_NAME)
        else:
            serve.shutdown()
    return 0


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


def _default_device() -> str:
    """cuda when the cluster has GPUs (the replica itself holds none, so it cannot look)."""
    if ray.is_initialized():
        return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
