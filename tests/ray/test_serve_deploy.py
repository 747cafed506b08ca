"""Deploying: the app's placement shape, `dsv4ray serve`, and `serve run deploy/serve.yaml`."""

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import ray
import yaml
from ray import serve

from dsv4ray.entrypoints.serve import APP_NAME, ServeSettings, build_app
from tests.ray.shm_files import ShmFiles

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
    shared = ServeSettings.from_config(
        {"model": tiny_ckpt, "pp_size": 2, "device": "cuda", "num_gpus_per_stage": 0.5}
    )  # both stages on one GPU, as the pipeline's own actors ask
    bundles = shared.deployment_options()["placement_group_bundles"]
    assert bundles == [{"GPU": 0.5, "CPU": 2}, {"GPU": 0.5, "CPU": 2}]


def test_bad_serve_config_names_the_key(tiny_ckpt):
    cases = {
        "max_body_byte": {"max_body_byte": 10},
        "kv_cache_dtype": {"kv_cache_dtype": "int3"},
        "accelerator": {"accelerator": "tpu"},
        "contradicts accelerator": {"accelerator": "gpu", "device": "cpu"},
        "stage_resources": {"stage_resources": {"GPU": 1}},
    }
    for message, config in cases.items():
        with pytest.raises(ValueError, match=message):
            ServeSettings.from_config({"model": tiny_ckpt, **config})


def test_the_app_builds_without_the_checkpoint_on_this_node():
    """The head may lack the checkpoint: each replica reads config.json where it runs."""
    settings = ServeSettings.from_config(
        {
            "model": "/models/only-on-workers",
            "accelerator": "gpu",
            "pp_size": 2,
            "stage_resources": {"accelerator_type:H100": 0.001},
        }
    )
    assert settings.served_model_name == "only-on-workers"
    stage = {"GPU": 1, "CPU": 2, "accelerator_type:H100": 0.001}
    assert settings.deployment_options()["placement_group_bundles"] == [stage, stage]


def test_auto_asks_for_gpus_when_the_cluster_config_declares_them(ray_session, tmp_path):
    from dsv4ray.cluster.placement import resolve_accelerator

    assert ray_session.cluster_resources().get("GPU", 0) == 0
    config = tmp_path / "ray_bootstrap_config.yaml"
    assert resolve_accelerator("auto", str(config)) == "cpu"  # no GPUs, no config
    types = {"head": {"resources": {}}, "cpu_worker": {"resources": {"CPU": 16}}}
    config.write_text(yaml.safe_dump({"available_node_types": types}))
    assert resolve_accelerator("auto", str(config)) == "cpu"
    types["gpu_worker"] = {"min_workers": 0, "resources": {"CPU": 192, "GPU": 8}}
    config.write_text(yaml.safe_dump({"available_node_types": types}))
    assert resolve_accelerator("auto", str(config)) == "gpu"  # scaled to zero, still declared
    assert resolve_accelerator("cpu", str(config)) == "cpu"


@pytest.mark.parametrize("name", ["serve.yaml", "serve-pd.yaml", "kuberay-rayservice.yaml"])
def test_shipped_configs_autoscale_both_deployments_that_build_app_makes(name, tiny_ckpt):
    """Serve applies a `deployments:` entry after build_app ran, to that deployment alone: the
    manifests give autoscaling_config to build_app, which scales the engine and the ingress."""
    from dsv4ray.entrypoints.serve_config import ServeSettings, ingress_options

    config = yaml.safe_load((ROOT / "deploy" / name).read_text())
    if "spec" in config:  # KubeRay: the Serve config is a string inside the RayService
        config = yaml.safe_load(config["spec"]["serveConfigV2"])
    (app,) = config["applications"]
    assert app["import_path"] == "dsv4ray.entrypoints.serve:build_app"
    assert "deployments" not in app
    args = {**app["args"], "model": tiny_ckpt, "accelerator": "cpu"}
    engine = ServeSettings.from_config(args).deployment_options()
    scaling = engine["autoscaling_config"]
    assert 1 <= scaling["min_replicas"] <= scaling["max_replicas"]
    assert scaling["target_ongoing_requests"] > 0
    front = ingress_options(engine)["autoscaling_config"]
    assert front["max_replicas"] == scaling["max_replicas"] and front["min_replicas"] >= 1
    assert config.get("http_options", {}).get("host", "127.0.0.1") == "127.0.0.1"


def test_cli_refuses_a_public_address_without_a_key(tiny_ckpt):
    env = {k: v for k, v in os.environ.items() if k != "DSV4RAY_API_KEY"}
    cmd = [sys.executable, "-m", "dsv4ray", "serve", "--model", tiny_ckpt, "--host", "0.0.0.0"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "without an API key" in done.stderr and "--api-key" in done.stderr


def _startup_line(proc: subprocess.Popen) -> str:
    """The command's "listening on" line; lines Ray forwards to a driver's stdout (a raylet's
    warnings, say) may come before it."""
    for line in proc.stdout:
        if "listening on" in line:
            return line
    return ""  # the command ended without starting


def test_cli_serves_on_the_running_ray_until_sigterm(ray_session, tiny_ckpt, free_port):
    """vLLM's spelling (the model positional, -pp) over deploy/serve.yaml: flags override it.
    SIGTERM stops the serving pipeline (stage actors, a compiled graph) within 10 s, exit code
    0, its app gone and no channel file of it left on the node."""
    port, shm = free_port(), ShmFiles()
    baseline = shm.now()
    env = dict(os.environ, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address)
    cmd = [
        sys.executable,
        "-m",
        "dsv4ray",
        "serve",
        tiny_ckpt,
        "--config",
        str(ROOT / "deploy" / "serve.yaml"),
        "-pp",
        "2",
        "--port",
        str(port),
        "--api-key",
        "cli-key",
        "--max-total-tokens",
        "2048",
    ]
    proc, errors = _start(cmd, env)
    try:
        line = _startup_line(proc)  # it comes once the app answers
        assert f"model {tiny_ckpt}" in line and "pp 2" in line
        assert shm.now() - baseline  # the graph's channels exist
        assert "capacity 2048 tokens" in line and f"http://127.0.0.1:{port}/v1" in line
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = {"model": os.path.basename(tiny_ckpt), "prompt": "cli", "max_tokens": 3}
        assert httpx.post(url, json=body, timeout=60).status_code == 401
        got = httpx.post(url, json=body, headers={"Authorization": "Bearer cli-key"}, timeout=60)
        assert got.json()["usage"]["completion_tokens"] >= 1
        _stops_cleanly(proc, errors, signal.SIGTERM, shm, baseline)
    finally:
        _end(proc, errors)
        serve.shutdown()  # it joined this session's Ray: leave no Serve instance behind


def test_sigint_stops_a_serving_pipeline_and_leaves_no_files(ray_session, tiny_ckpt, free_port):
    """`dsv4ray serve -pp 2` on the running Ray, stopped by SIGINT (the handler SIGTERM has,
    tested above) once it serves: it exits 0 within 10 s, its app is gone, and the node keeps no
    channel file of it."""
    shm = ShmFiles()
    baseline = shm.now()
    env = dict(os.environ, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address)
    cmd = [sys.executable, "-m", "dsv4ray", "serve", tiny_ckpt, "-pp", "2",
           "--port", str(free_port()), "--max-total-tokens", "1024"]  # fmt: skip
    proc, errors = _start(cmd, env)
    try:
        assert "listening on" in _startup_line(proc)
        assert shm.now() - baseline  # the graph's channels exist
        _stops_cleanly(proc, errors, signal.SIGINT, shm, baseline)
    finally:
        _end(proc, errors)
        serve.shutdown()  # it joined this session's Ray: leave no Serve instance behind


def _start(cmd: list[str], env: dict):
    """The command, its stdout piped and Ray's logs on stderr into a file (a pipe could fill and
    block it) -> (process, that file)."""
    errors = tempfile.TemporaryFile("w+")
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=errors, text=True), errors


def _stops_cleanly(proc, errors, sig, shm: ShmFiles, baseline: set[str]) -> None:
    """sig ends the serving command within 10 s with exit code 0 and no traceback, its app is
    gone and the node keeps no channel file of it (its stage actors end after the app)."""
    proc.send_signal(sig)
    code = proc.wait(timeout=10)
    out = proc.stdout.read()
    errors.seek(0)
    err = errors.read()
    assert code == 0 and "stopping" in out, (code, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    assert APP_NAME not in _applications()
    assert shm.settle(0, baseline) == set()


def _end(proc, errors) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate()
    errors.close()


def test_sigterm_while_the_app_deploys_stops_the_start_cleanly(ray_session, tiny_ckpt, free_port):
    """A signal before the app is up (a large checkpoint deploys for minutes) interrupts the
    start: exit code 0 and the half-deployed application removed, never Ray's abort."""
    env = dict(os.environ, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address)
    cmd = [sys.executable, "-m", "dsv4ray", "serve", tiny_ckpt, "--port", str(free_port()),
           "--max-total-tokens", "2048"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while APP_NAME not in _applications() and time.monotonic() < deadline:
            assert proc.poll() is None
            time.sleep(0.1)
        assert _applications()[APP_NAME] != "RUNNING"  # still deploying
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        out, err = proc.communicate()
        assert "stopping" in out and "SIGTERM received" not in err
        deadline = time.monotonic() + 30
        while APP_NAME in _applications() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert APP_NAME not in _applications()
    finally:
        if proc.poll() is None:
            proc.kill()
        serve.shutdown()


def _applications() -> dict:
    """Serve application name -> status on this session's Ray ({} without Serve)."""
    try:
        apps = serve.status().applications
        return {name: str(getattr(app.status, "value", app.status)) for name, app in apps.items()}
    except Exception:  # no Serve instance yet
        return {}


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


def test_a_gpu_app_built_without_gpus_asks_for_gpu_bundles(ray_session, free_port):
    """No GPU in this cluster and no checkpoint here: the replica's placement group still asks
    for one GPU bundle per stage (the request that makes an autoscaler start a GPU node)."""
    assert ray_session.cluster_resources().get("GPU", 0) == 0
    app = build_app({"model": "/models/on-gpu-nodes", "accelerator": "gpu", "pp_size": 2})
    try:  # a Serve that fails to start is shut down too: the next tests start their own
        serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
        target = serve.RunTarget(app, name="gpu-bundles", route_prefix="/gpu")
        serve.run_many(
            [target],
            wait_for_ingress_deployment_creation=False,
            wait_for_applications_running=False,
        )
        deadline = time.monotonic() + 60
        while not (pending := _gpu_groups()):
            assert time.monotonic() < deadline, ray.util.placement_group_table()
            time.sleep(0.5)
        (group,) = pending
        stage = {"GPU": 1.0, "CPU": 2.0}
        assert list(group["bundles"].values()) == [stage, stage]
        assert (group["strategy"], group["state"]) == ("PACK", "PENDING")
    finally:
        _kill_replicas("gpu-bundles")
        serve.shutdown()


def test_an_app_whose_engine_cannot_start_fails_saying_why(ray_session, free_port, tmp_path):
    """A checkpoint missing where the replicas run: the engine deployment fails, and the ingress,
    which waits for an engine replica, fails with the engine's message instead of starting
    for good (its HTTP routes would hang)."""
    app = build_app({"model": str(tmp_path / "no-such-model"), "accelerator": "cpu"})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
        with pytest.raises(RuntimeError, match="OpenAIDeployment"):
            serve.run(app, name="no-model", route_prefix="/no-model")
        deadline = time.monotonic() + 90
        while (ingress := _deployment("no-model", "OpenAIIngress")).status != "DEPLOY_FAILED":
            assert time.monotonic() < deadline, ingress  # was: STARTING for good
            time.sleep(1)
        assert "the engine deployment failed" in ingress.message
        assert "no config.json" in ingress.message
    finally:
        serve.shutdown()


def _deployment(app: str, name: str):
    return serve.status().applications[app].deployments[name]


def _kill_replicas(app: str) -> None:
    """Kills an app's replica actors. A replica that never started (no GPU here) would hold
    serve.shutdown() for its whole graceful-shutdown timeout (20 s), waiting on no requests."""
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith(f"SERVE_REPLICA::{app}#"):
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)


def _gpu_groups() -> list[dict]:
    table = ray.util.placement_group_table().values()
    return [g for g in table if g["state"] != "REMOVED" and "GPU" in g["bundles"].get(0, {})]


def test_a_command_knows_whether_it_started_its_ray(ray_session):
    """Only a Ray it started may `dsv4ray serve` / `dsv4ray job` stop and sweep: this session
    started its own; a process that joins it (as ray.init joins a `ray start` by itself) did
    not."""
    from dsv4ray.cluster.placement import started_local_ray

    assert started_local_ray()
    env = dict(os.environ, RAY_ADDRESS=ray._private.worker._global_node.address)
    code = ("from dsv4ray.cluster.placement import ensure_ray, started_local_ray; "
            "ensure_ray(2); print(started_local_ray())")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.stdout.strip().splitlines()[-1] == "False", done.stderr[-2000:]
