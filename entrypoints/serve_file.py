"""``dsv4ray serve --config FILE``: the Serve config file that ``serve run`` and ``serve deploy``
read (deploy/serve.yaml), checked with Serve's own schema and turned into ``run_server``'s
arguments. One application of ``dsv4ray.entrypoints.serve:build_app``; what ``dsv4ray serve``
cannot honour (another import path, runtime_env, gRPC, ...) is refused by name, never dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

IMPORT_PATH = "dsv4ray.entrypoints.serve:build_app"
APP_NAME = "dsv4ray"  # the Serve application dsv4ray serve runs
_SERVE_START_KEYS = ("proxy_location", "http_options", "logging_config")
_APP_KEYS = ("name", "route_prefix", "import_path", "args", "deployments")


@dataclass(frozen=True)
class ServeFile:
    args: dict  # build_app's config
    deployment: dict = field(default_factory=dict)  # options of OpenAIDeployment, the engine
    serve_options: dict = field(default_factory=dict)  # serve.start's (http_options included)


def read_serve_file(path: str) -> ServeFile:
    """ValueError naming the file and the key it cannot take."""
    import yaml
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    from dsv4ray.entrypoints.serve_config import DEPLOYMENT_NAME

    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
        given = ServeDeploySchema.model_validate(raw).model_dump(exclude_unset=True)
    except (OSError, yaml.YAMLError, ValidationError) as exc:
        raise ValueError(f"{path}: not a Serve config: {exc}") from None
    _unknown_keys(path, raw)
    _refuse(path, set(given) - {*_SERVE_START_KEYS, "applications"}, "")
    apps = given.get("applications") or []
    if len(apps) != 1:
        raise ValueError(f"{path}: give exactly one application, found {len(apps)}")
    (app,) = apps
    _refuse(path, set(app) - set(_APP_KEYS), "applications.0.")
    if app.get("import_path") != IMPORT_PATH:
        raise ValueError(f"{path}: applications.0.import_path must be {IMPORT_PATH!r}")
    if app.get("name", APP_NAME) != APP_NAME:
        raise ValueError(
            f"{path}: applications.0.name: dsv4ray serve runs its app as {APP_NAME!r}, not "
            f"{app['name']!r}"
        )
    if app.get("route_prefix", "/") != "/":
        raise ValueError(f"{path}: applications.0.route_prefix: dsv4ray serve serves at '/'")
    deployment: dict = {}
    for i, entry in enumerate(app.get("deployments") or []):
        if entry.get("name") != DEPLOYMENT_NAME:
            raise ValueError(
                f"{path}: applications.0.deployments.{i}.name: no deployment named "
                f"{entry.get('name')!r} (the app has {DEPLOYMENT_NAME!r})"
            )
        deployment.update({k: v for k, v in entry.items() if k != "name"})
    serve_options = {k: given[k] for k in _SERVE_START_KEYS if k in given}
    return ServeFile(dict(app.get("args") or {}), deployment, serve_options)


def _unknown_keys(path: str, raw: dict) -> None:
    """Keys that Serve's schema does not define (which its validation drops), at the top, in
    http_options, in the application, in its deployments and in their autoscaling_config: a
    ValueError naming the first."""
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import (
        DeploymentSchema,
        HTTPOptionsSchema,
        ServeApplicationSchema,
        ServeDeploySchema,
    )

    def check(value, schema, where: str) -> None:
        if not isinstance(value, dict):
            return
        known = {f.alias or name for name, f in schema.model_fields.items()}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"{path}: {where}{unknown[0]} is not a key of a Serve config")

    check(raw, ServeDeploySchema, "")
    check(raw.get("http_options"), HTTPOptionsSchema, "http_options.")
    for i, app in enumerate(raw.get("applications") or []):
        check(app, ServeApplicationSchema, f"applications.{i}.")
        for j, entry in enumerate((app.get("deployments") or []) if isinstance(app, dict) else []):
            where = f"applications.{i}.deployments.{j}."
            check(entry, DeploymentSchema, where)
            scaling = entry.get("autoscaling_config") if isinstance(entry, dict) else None
            check(scaling, AutoscalingConfig, where + "autoscaling_config.")


def _refuse(path: str, keys: set, prefix: str) -> None:
    if keys:
        raise ValueError(
            f"{path}: {prefix}{sorted(keys)[0]} is not supported by dsv4ray serve "
            "(use `serve run` or `serve deploy` with this file)"
        )
