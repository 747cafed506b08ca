"""What the Serve app is built from: ``ServeSettings.from_config(config)`` over the keys of
``build_app``'s config (the ``args`` of deploy/serve.yaml), and the API key's sources.

Nothing here reads the checkpoint: the app may be built on a head node that does not have it,
and each replica reads config.json where it runs. The bundle shapes are fixed here, from
``accelerator`` (cluster/placement.py says how ``auto`` decides).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from dsv4ray.cluster.placement import DEVICES, check_accelerator, resolve_accelerator, stage_bundle
from dsv4ray.engine.config import INTERNAL_OPTIONS, EngineConfig
from dsv4ray.entrypoints.model_path import DEFAULT_MODEL_ENV, default_model
from dsv4ray.entrypoints.openai.server import ServerOptions

log = logging.getLogger("dsv4ray.serve")

API_KEY_ENV = "DSV4RAY_API_KEY"
API_KEY_FILE_ENV = "DSV4RAY_API_KEY_FILE"
DEPLOYMENT_NAME = "OpenAIDeployment"  # the engine deployment
INGRESS_NAME = "OpenAIIngress"  # the HTTP deployment in front of it
INGRESS_CPUS = 0.25  # HTTP, tokenizing and SSE rendering; no placement group
REPLICA_CPUS = {True: 1.0, False: 0.5}  # by use_gpu; a GPU bundle already has room for it
ONGOING_HEADROOM = 16  # health, models and stats calls beside max_pending_requests generations
# An idle replica stops after one look for ongoing requests this long after it is told to (Serve
# waits 2 s by default): stopping `dsv4ray serve`, deleting the app and scaling down take that
# much less; replicas with requests still wait for them up to Serve's graceful timeout.
SHUTDOWN_POLL_S = 0.2
_SERVE_KEYS = ("served_model_name", "max_body_bytes", "max_pending_requests", "routing")
ROUTERS = {  # routing -> the engine deployment's request router (None: Serve's default)
    "prefix": "dsv4ray.entrypoints.prefix_routing.PrefixRouter",
    "pow2": None,
}
_KEY_KEYS = ("model", "api_key", "api_key_file")  # resolved by from_config
_PLACEMENT_KEYS = ("accelerator", "stage_resources")
_DEPLOYMENT_KEYS = ("num_replicas", "autoscaling_config")
ENGINE_KEYS = tuple(f.name for f in dataclasses.fields(EngineConfig)
                    if f.name not in ("model", *INTERNAL_OPTIONS))  # fmt: skip
CONFIG_KEYS = (*_KEY_KEYS, *_SERVE_KEYS, *_PLACEMENT_KEYS, *_DEPLOYMENT_KEYS, *ENGINE_KEYS)


def demo_warning(model: str) -> str:
    return (
        f"no model given: serving the DEMO checkpoint {model} (random weights: its text is "
        "gibberish). Name a checkpoint: `dsv4ray serve /path/to/model`, or `model:` in the "
        "Serve config."
    )


@dataclass(frozen=True)
class ServeSettings:
    """engine_options hold no device: each replica takes it from the bundles it was given."""

    model: str
    served_model_name: str
    engine_options: dict = field(default_factory=dict)
    accelerator: str = "cpu"  # resolved: cpu or gpu
    stage_resources: dict = field(default_factory=dict)
    demo_model: bool = False  # no model was named: the default (demo) checkpoint
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_pending_requests: int = 256
    routing: str = "prefix"  # ROUTERS: by prompt prefix across replicas, or power of two
    deployment_overrides: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_pending_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.routing, str) or self.routing not in ROUTERS:
            raise ValueError(f"routing must be one of {sorted(ROUTERS)}, got {self.routing!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string or None")
        if not isinstance(self.served_model_name, str) or not self.served_model_name:
            raise ValueError(f"served_model_name must be a non-empty string, got "
                             f"{self.served_model_name!r}")  # fmt: skip
        if self.accelerator not in DEVICES:
            raise ValueError(
                f"accelerator must be resolved to cpu or gpu, got {self.accelerator!r}"
            )
        _check_stage_resources(self.stage_resources)
        # a bad option fails here, at build time, by name; the checkpoint is the replica's
        device = DEVICES[self.accelerator]
        EngineConfig.build(self.model, check_model=False, device=device, **self.engine_options)

    @classmethod
    def from_config(cls, config: Mapping) -> ServeSettings:
        unknown = sorted(set(config) - set(CONFIG_KEYS))
        if unknown:
            raise ValueError(f"unknown serve config key {unknown[0]!r}")
        if "use_ray" in config and config["use_ray"] is not True:
            raise ValueError("use_ray: the Serve app always runs its stages as Ray actors")
        if config.get("model") is not None and not isinstance(config["model"], str):
            raise ValueError(f"model must be a checkpoint's path, got {config['model']!r}")
        _check_autoscaling(config.get("autoscaling_config"))
        demo = not config.get("model") and not os.environ.get(DEFAULT_MODEL_ENV)
        model = os.path.abspath(config.get("model") or default_model())
        if demo:
            log.warning("%s", demo_warning(model))
        engine = {k: config[k] for k in ENGINE_KEYS if k in config and k != "device"}
        engine["use_ray"] = True
        serve_opts = {k: config[k] for k in _SERVE_KEYS if k in config}
        serve_opts.setdefault("served_model_name", os.path.basename(model.rstrip("/")))
        serve_opts["api_key"] = resolve_api_key(config.get("api_key"), config.get("api_key_file"))
        return cls(
            model,
            engine_options=engine,
            accelerator=_accelerator(config.get("accelerator", "auto"), config.get("device")),
            stage_resources=config.get("stage_resources") or {},
            demo_model=demo,
            deployment_overrides={k: config[k] for k in _DEPLOYMENT_KEYS if k in config},
            **serve_opts,
        )

    @property
    def use_gpu(self) -> bool:
        return self.accelerator == "gpu"

    def bundles(self) -> list[dict]:
        """Bundle 0 hosts stage 0 and the replica; bundle i > 0 hosts stage i (each stage's GPU
        share: stages below one GPU share a device)."""
        gpus = self.engine_options.get("num_gpus_per_stage", EngineConfig.num_gpus_per_stage)
        stage = stage_bundle(self.use_gpu, self.stage_resources, num_gpus=gpus)
        first = dict(stage)
        if not self.use_gpu:
            first["CPU"] = stage["CPU"] + REPLICA_CPUS[False]
        return [first] + [dict(stage) for _ in range(self.engine_options.get("pp_size", 1) - 1)]

    def deployment_options(self) -> dict:
        options = {
            "name": DEPLOYMENT_NAME,
            "ray_actor_options": {"num_cpus": REPLICA_CPUS[self.use_gpu]},
            "placement_group_bundles": self.bundles(),
            "placement_group_strategy": "PACK",
            "max_ongoing_requests": self.max_pending_requests + ONGOING_HEADROOM,
            "graceful_shutdown_wait_loop_s": SHUTDOWN_POLL_S,
        }
        if ROUTERS[self.routing] is not None:
            from ray.serve.config import RequestRouterConfig

            options["request_router_config"] = RequestRouterConfig(
                request_router_class=ROUTERS[self.routing]
            )
        return {**options, **self.deployment_overrides}

    def server_options(self) -> ServerOptions:
        return ServerOptions(
            served_model_name=self.served_model_name,
            api_key=self.api_key,
            max_body_bytes=self.max_body_bytes,
            max_pending_requests=self.max_pending_requests,
        )


def ingress_options(engine: Mapping) -> dict:
    """The ingress deployment's options, from the engine deployment's (``engine``: its
    options with any overrides applied): as many replicas as a fixed engine count, else
    the engine's autoscaling with at least one replica (clients need something to connect to
    while the engine scales from zero); the same ``max_ongoing_requests``."""
    options = {
        "name": INGRESS_NAME,
        "ray_actor_options": {"num_cpus": INGRESS_CPUS},
        "max_ongoing_requests": engine["max_ongoing_requests"],
        "graceful_shutdown_wait_loop_s": engine.get(
            "graceful_shutdown_wait_loop_s", SHUTDOWN_POLL_S
        ),
    }
    scaling = engine.get("autoscaling_config")
    if scaling is not None:
        scaling = dict(scaling if isinstance(scaling, Mapping) else scaling.dict())
        for key in ("min_replicas", "max_replicas", "initial_replicas"):
            if scaling.get(key) is not None:
                scaling[key] = max(1, scaling[key])
        options["autoscaling_config"] = scaling
    elif engine.get("num_replicas") is not None:
        options["num_replicas"] = engine["num_replicas"]
    return options


def _accelerator(accelerator: object, device: object) -> str:
    """The accelerator, resolved; ``device`` (cpu or cuda), an engine option, may say it too."""
    check_accelerator(accelerator)
    if device is None:
        return resolve_accelerator(accelerator)
    wanted = {v: k for k, v in DEVICES.items()}.get(device)
    if wanted is None:
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if accelerator not in ("auto", wanted):
        raise ValueError(f"device {device!r} contradicts accelerator {accelerator!r}; give one")
    return wanted


def _check_autoscaling(scaling: object) -> None:
    """Serve's AutoscalingConfig drops keys it does not know (``min_replica`` would leave the
    default in place): each one is refused here by name."""
    from ray.serve.config import AutoscalingConfig

    if scaling is None or isinstance(scaling, AutoscalingConfig):  # Serve checked its fields
        return
    if not isinstance(scaling, Mapping):
        raise ValueError(f"autoscaling_config must be a mapping, got {scaling!r}")

    known = AutoscalingConfig.model_fields
    unknown = sorted(set(scaling) - set(known))
    if unknown:
        raise ValueError(f"autoscaling_config.{unknown[0]} is not one of Serve's autoscaling "
                         f"options: {sorted(known)}")  # fmt: skip


def _check_stage_resources(resources: object) -> None:
    if not isinstance(resources, dict):
        raise ValueError(f"stage_resources must be a mapping, got {resources!r}")
    for name, amount in resources.items():
        if name in ("CPU", "GPU"):
            raise ValueError(f"stage_resources: {name} comes from accelerator; name custom ones")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount <= 0:
            raise ValueError(f"stage_resources[{name!r}] must be a number > 0, got {amount!r}")


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
