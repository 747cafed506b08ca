"""The ingress deployment's options follow the engine deployment's, and Ray's failures of the
engine deployment become the API's errors (entrypoints/remote_engine.py)."""

import json
import pickle

import pytest
import ray.exceptions
from ray.serve import exceptions as serve_exceptions

from dsv4ray.engine.checks import RequestError
from dsv4ray.entrypoints.openai.errors import APIError
from dsv4ray.entrypoints.remote_engine import api_error
from dsv4ray.entrypoints.serve_config import (
    INGRESS_CPUS,
    INGRESS_NAME,
    SHUTDOWN_POLL_S,
    ServeSettings,
    ingress_options,
)

ENGINE = {"name": "OpenAIDeployment", "max_ongoing_requests": 272}


def test_the_ingress_has_a_small_cpu_and_the_engines_ongoing_limit():
    options = ingress_options(ENGINE)
    assert options == {
        "name": INGRESS_NAME,
        "ray_actor_options": {"num_cpus": INGRESS_CPUS},
        "max_ongoing_requests": 272,
        "graceful_shutdown_wait_loop_s": SHUTDOWN_POLL_S,
    }
    assert 0.1 <= INGRESS_CPUS <= 0.5
    assert "placement_group_bundles" not in options


def test_both_deployments_stop_an_idle_replica_after_one_short_poll(tiny_ckpt):
    """Serve's default idle wait (2 s per stop) would make every Ctrl-C, app deletion and
    scale-down that much slower; a poll set in the engine's overrides applies to both."""
    from dsv4ray.entrypoints.serve_config import ServeSettings

    engine = ServeSettings.from_config({"model": tiny_ckpt}).deployment_options()
    assert engine["graceful_shutdown_wait_loop_s"] == SHUTDOWN_POLL_S < 2
    slow = {**ENGINE, "graceful_shutdown_wait_loop_s": 1.5}
    assert ingress_options(slow)["graceful_shutdown_wait_loop_s"] == 1.5


def test_the_ingress_follows_a_fixed_replica_count():
    assert ingress_options({**ENGINE, "num_replicas": 3})["num_replicas"] == 3


def test_the_ingress_autoscales_like_the_engine_but_never_below_one_replica():
    scaling = {"min_replicas": 0, "initial_replicas": 0, "max_replicas": 2,
               "target_ongoing_requests": 1}  # fmt: skip
    options = ingress_options({**ENGINE, "autoscaling_config": scaling})
    assert options["autoscaling_config"] == {**scaling, "min_replicas": 1, "initial_replicas": 1}
    assert "num_replicas" not in options
    assert scaling["min_replicas"] == 0  # the engine's own is untouched


@pytest.mark.parametrize(
    "exc",
    [
        ray.exceptions.ActorDiedError(),
        ray.exceptions.RayActorError(),
        serve_exceptions.DeploymentUnavailableError("OpenAIDeployment"),
    ],
)
def test_a_dead_or_missing_engine_is_a_503(exc):
    error = api_error(exc)
    assert isinstance(error, APIError)
    assert (error.status, error.type, error.code) == (503, "server_error", "engine_unavailable")


def test_an_engine_side_value_error_stays_a_value_error_naming_its_field():
    wrapped = ray.exceptions.RayTaskError("generate", "Traceback ...", ValueError("too long"))
    error = api_error(wrapped)
    assert isinstance(error, ValueError) and str(error) == "too long" and error.field is None
    refused = RequestError("logit_bias token id 9 is outside the vocabulary", "logit_bias")
    cause = pickle.loads(pickle.dumps(refused))  # as it crosses from the engine's process
    error = api_error(ray.exceptions.RayTaskError("generate", "Traceback ...", cause))
    assert (str(error), error.field) == (str(refused), "logit_bias")


def test_other_failures_pass_through():
    exc = RuntimeError("a bug")
    assert api_error(exc) is exc


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"served_model_name": 2024}, "served_model_name must be a non-empty string, got 2024"),
        ({"served_model_name": ""}, "served_model_name must be a non-empty string"),
        ({"model": 5}, "model must be a checkpoint's path, got 5"),
        ({"stage_resources": ["a"]}, r"stage_resources must be a mapping, got \['a'\]"),
        ({"autoscaling_config": {"min_replica": 1}},
         "autoscaling_config.min_replica is not one of Serve's autoscaling options"),
        ({"autoscaling_config": 3}, "autoscaling_config must be a mapping"),
        ({"model_source": "s3://x"}, "unknown serve config key 'model_source'"),
        ({"draft_rings": 2}, "unknown serve config key 'draft_rings'"),
    ],
)  # fmt: skip
def test_a_bad_serve_config_value_is_refused_at_build_naming_its_key(tiny_ckpt, extra, message):
    with pytest.raises(ValueError, match=message):
        ServeSettings.from_config({"model": tiny_ckpt, "accelerator": "cpu", **extra})


def test_autoscaling_given_as_serves_own_object_is_taken(tiny_ckpt):
    from ray.serve.config import AutoscalingConfig

    scaling = AutoscalingConfig(min_replicas=1, max_replicas=3)
    args = {"model": tiny_ckpt, "accelerator": "cpu", "autoscaling_config": scaling}
    engine = ServeSettings.from_config(args).deployment_options()
    assert ingress_options(engine)["autoscaling_config"]["max_replicas"] == 3


def test_a_misspelt_autoscaling_key_in_a_serve_file_is_named(tmp_path):
    from dsv4ray.entrypoints.serve_file import read_serve_file

    path = tmp_path / "serve.yaml"
    scaling = {"min_replicas": 1, "target_ongoing_request": 4}
    entry = {"name": "OpenAIDeployment", "autoscaling_config": scaling}
    app = {"name": "dsv4ray", "import_path": "dsv4ray.entrypoints.serve:build_app",
           "deployments": [entry]}  # fmt: skip
    path.write_text(json.dumps({"applications": [app]}))
    with pytest.raises(ValueError, match=r"deployments\.0\.autoscaling_config\.target_ongoing_req"):
        read_serve_file(str(path))


def test_the_ingress_asks_an_engine_again_until_serve_gives_up_on_it(monkeypatch):
    """An engine call that fails while Serve still starts the engine deployment (a replica that
    died starting is being replaced) is asked again; once Serve marks the deployment failed,
    the ingress fails with the deployment's message."""
    import asyncio

    from dsv4ray.entrypoints import serve as serve_module

    class Handle:
        def __init__(self, answers):
            self.answers, self.info = answers, self

        def remote(self):
            item = self.answers.pop(0)

            async def answer():
                if isinstance(item, Exception):
                    raise item
                return item

            return answer()

    failures = [None, None, "replica constructor failed: no config.json"]
    monkeypatch.setattr(serve_module, "ENGINE_POLL_S", 0.01)
    monkeypatch.setattr(serve_module, "_engine_failure", lambda: None)
    died = ray.exceptions.ActorDiedError()
    assert asyncio.run(serve_module._engine_info(Handle([died, died, {"model": "m"}]))) == {
        "model": "m"
    }
    monkeypatch.setattr(serve_module, "_engine_failure", lambda: failures.pop(0))
    with pytest.raises(RuntimeError, match="engine deployment failed: replica constructor"):
        asyncio.run(serve_module._engine_info(Handle([died] * 3)))
