"""Deploying: the app's placement shape, `dsv4ray serve`, and `serve run deploy/serve.yaml`."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from ray import serve

from dsv4ray.entrypoints.serve import ServeSettings

ROOT = Path(__file__).resolve().parents[2]
BIN = os.path.dirname(sys.executable)


def test_placement_bundles_give_each_stage_a_bundle_and_the_replica_bundle_0(tiny_ckpt):
    cpu = ServeSettings.from_config({"model": tiny_ckpt, "pp_size": 3, "device": "cpu"})
    options = cpu.deployment_options()
    assert options["placement_group_bundles"] == [{"CPU": 1.0}, {"CPU": 0.5}, {"CPU": 0.5}]
    assert options["placement_group_strategy"] == "PACK"
    assert options["ray_actor_options"] == {"num_cpus": 0.5}
    gpu = ServeSettings.from_config({"model": tiny_ckpt, "pp_size": 2, "device": "cuda"})
    bundles = gpu.deployment_options()["placement_group_bundles"]
    assert bundles == [{"GPU": 1, "CPU": 2}, {"GPU": 1, "CPU": 2}]  # the stage takes 1 CPU
    assert gpu.deployment_options()["ray_actor_options"] == {"num_cpus": 1.0}
    assert cpu.served_model_name == os.path.basename(tiny_ckpt)
    assert cpu.engine_options["use_ray"] is True


def test_bad_serve_config_names_the_key(tiny_ckpt):
    with pytest.raises(ValueError, match="max_body_byte"):
        ServeSettings.from_config({"model": tiny_ckpt, "max_body_byte": 10})
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        ServeSettings.from_config({"model": tiny_ckpt, "kv_cache_dtype": "int3"})
    with pytest.raises(ValueError, match="model"):
        ServeSettings.from_config({"model": "/nonexistent/checkpoint"})


def test_serve_yaml_autoscales_the_deployment_that_build_app_makes():
    config = yaml.safe_load((ROOT / "deploy" / "serve.yaml").read_text())
    (app,) = config["applications"]
    assert app["import_path"] == "dsv4ray.entrypoints.serve:build_app"
    (deployment,) = app["deployments"]
    assert deployment["name"] == "OpenAIDeployment"
    scaling = deployment["autoscaling_config"]
    assert 1 <= scaling["min_replicas"] <= scaling["max_replicas"]
    assert scaling["target_ongoing_requests"] > 0
    assert config["http_options"]["host"] == "127.0.0.1"


def test_cli_refuses_a_public_address_without_a_key(tiny_ckpt):
    env = {k: v for k, v in os.environ.items() if k != "DSV4RAY_API_KEY"}
    cmd = [sys.executable, "-m", "dsv4ray", "serve", "--model", tiny_ckpt, "--host", "0.0.0.0"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "without an API key" in done.stderr and "--api-key" in done.stderr


def test_cli_serves_on_the_running_ray_until_ctrl_c(ray_session, tiny_ckpt, free_port):
    port = free_port()
    env = dict(os.environ, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address)
    cmd = [
        sys.executable,
        "-m",
        "dsv4ray",
        "serve",
        "--model",
        tiny_ckpt,
        "--port",
        str(port),
        "--api-key",
        "cli-key",
        "--max-total-tokens",
        "2048",
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        line = proc.stdout.readline()  # the startup line comes once the app answers
        assert f"model {tiny_ckpt}" in line and "pp 1" in line
        assert "capacity 2048 tokens" in line and f"http://127.0.0.1:{port}/v1" in line
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = {"model": os.path.basename(tiny_ckpt), "prompt": "cli", "max_tokens": 3}
        assert httpx.post(url, json=body, timeout=60).status_code == 401
        got = httpx.post(url, json=body, headers={"Authorization": "Bearer cli-key"}, timeout=60)
        assert got.json()["usage"]["completion_tokens"] >= 1
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert "stopping" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        serve.shutdown()  # it joined this session's Ray: leave no Serve instance behind


def test_serve_run_deploy_yaml_smoke_script(tiny_ckpt, free_port):
    env = dict(os.environ, DSV4RAY_MODEL=tiny_ckpt, PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "serve_smoke.sh"), str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "serve smoke: OK" in done.stdout
    assert f"serving model {os.path.basename(tiny_ckpt)}" in done.stdout
