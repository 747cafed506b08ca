"""Autoscaling from a cold cluster, with no cloud: Ray's fake multi-node provider.

    python bench/autoscale.py [--model .tiny] [--timeout 600] [--results-dir bench/results]

A Ray head of its own (its own ports, temp dir and auth token; never `ray stop`) runs the
autoscaler with the fake multi-node provider, which starts "nodes" as Ray node processes on this
machine. The config declares the head (1 CPU) and one worker type, ``stage_worker``, with the
custom resource ``stage_slot`` and no node running. The Serve app is deployed with
``stage_resources: {stage_slot: 1}`` (every stage's bundle needs a stage_worker node) and
``autoscaling_config`` with 0 replicas at first. Then:

1. requests arrive: Serve adds a replica, whose placement group cannot be placed, so the
   autoscaler starts a ``stage_worker`` node; the replica starts on it and the requests succeed;
2. traffic stops: Serve scales the deployment back to 0 replicas, the node goes idle and the
   autoscaler removes it.

Each phase has a deadline; the run fails (exit 1) when one passes. Writes
bench/results/autoscale-cpu.json (the times of each phase) and regenerates BENCHMARKS.md;
tests/ray/test_autoscale.py runs it with its results in a temporary folder.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from dsv4ray.bench.report import bench_parser, result, save_results

BIN = os.path.dirname(sys.executable)
ROOT = Path(__file__).resolve().parents[1]
WORKER_TYPE = "stage_worker"
SLOT = "stage_slot"
APP = "autoscale"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_cluster_config(gcs_address: str) -> dict:
    """The autoscaler config: the head, and a worker type that scales from zero."""
    return {
        "cluster_name": "dsv4ray-autoscale",
        "max_workers": 1,
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "gcs_address": gcs_address,  # not the default port, which another Ray may hold
        },
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 1}, "node_config": {}, "max_workers": 0},
            WORKER_TYPE: {
                "resources": {"CPU": 2, SLOT: 2},
                "node_config": {},
                "min_workers": 0,
                "max_workers": 1,
            },
        },
        "head_node_type": "ray.head.default",
        "auth": {},
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 0.05,
        "docker": {},
        **{k: [] for k in ("initialization_commands", "setup_commands", "head_setup_commands")},
        **{k: [] for k in ("worker_setup_commands", "head_start_ray_commands")},
        **{k: [] for k in ("worker_start_ray_commands", "cluster_synced_files")},
        "file_mounts": {},
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
    }


class Head:
    """`ray start --head --block` with the fake autoscaler; stopped by terminating that process
    and then any process left that names this head's temp dir (the fake nodes)."""

    def __init__(self, work: str) -> None:
        self.work, self.port = work, free_port()
        self.address = f"127.0.0.1:{self.port}"
        token = Path(work) / "auth_token"
        token.write_text(secrets.token_hex(32))
        self.env = dict(
            os.environ,
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN_PATH=str(token),
            RAY_FAKE_CLUSTER="1",
            AUTOSCALER_UPDATE_INTERVAL_S="1",
            PATH=f"{BIN}:{os.environ.get('PATH', '')}",
        )
        self.env.pop("RAY_ADDRESS", None)
        config = Path(work) / "autoscaler.yaml"
        config.write_text(json.dumps(fake_cluster_config(self.address)))
        ports = ("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port")
        ports += ("runtime-env-agent-port", "ray-client-server-port")
        cmd = [
            f"{BIN}/ray", "start", "--head", "--block", f"--port={self.port}", "--num-cpus=1",
            f"--autoscaling-config={config}", f"--temp-dir={work}/ray", "--include-dashboard=false",
            "--disable-usage-stats", *(f"--{name}={free_port()}" for name in ports),
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def stop(self) -> None:
        stop_head(self.proc, self.work)


def stop_head(proc: subprocess.Popen, marker: str, grace_s: float = 5.0) -> None:
    """Terminates a `ray start --head --block` process, then kills what is left of that head:
    every process whose command line names `marker` (its temp dir: GCS, raylet, workers, fake
    nodes). A graceful stop of a head that ran work waits ~30 s for its workers; callers need
    nothing of the head by then, so it gets grace_s."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
    for pid in pids_naming(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # it ended after the listing


def pids_naming(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmdline:
                pids.append(int(entry.name))
    return pids


def wait_until(what: str, predicate, deadline: float, times: dict, start: float):
    """Polls ``predicate`` until it returns something true; records when, under ``what``."""
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            times[what] = round(time.monotonic() - start, 1)
            print(f"autoscale: {what} after {times[what]} s", flush=True)
            return value
        time.sleep(0.5)
    raise TimeoutError(f"autoscale: no {what!r} before the deadline")


def worker_nodes(ray) -> list[dict]:
    return [n for n in ray.nodes() if n["Alive"] and SLOT in n["Resources"]]


def deploy(ray, serve, model: str, http_port: int) -> None:
    from dsv4ray.entrypoints.serve import build_app

    scaling = {
        "min_replicas": 0,
        "initial_replicas": 0,
        "max_replicas": 1,
        "target_ongoing_requests": 1,
        "upscale_delay_s": 0,
        "downscale_delay_s": 2,
        "look_back_period_s": 5,
    }
    config = {
        "model": model,
        "served_model_name": "tiny",
        "accelerator": "cpu",
        "stage_resources": {SLOT: 1},
        "kv_cache_dtype": "fp32",
        "max_total_tokens": 2048,
        "autoscaling_config": scaling,
    }
    # the proxy on the head only: a proxy on the worker would keep it busy (not idle)
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": http_port})
    serve.run(build_app(config), name=APP, route_prefix="/")


class Traffic:
    """Clients sending short completions back to back until stopped; counts the answers."""

    def __init__(self, url: str, num_clients: int = 2) -> None:
        self.url, self.ok, self.failed = url, 0, []
        self.stopped = threading.Event()
        self.threads = [
            threading.Thread(target=self._client, daemon=True) for _ in range(num_clients)
        ]
        for t in self.threads:
            t.start()

    def _client(self) -> None:
        import httpx

        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}
        while not self.stopped.is_set():
            try:
                got = httpx.post(f"{self.url}/v1/completions", json=body, timeout=300)
            except httpx.HTTPError as exc:  # a request cut while the replica starts: counted
                self.failed.append(repr(exc))
                continue
            if got.status_code == 200 and got.json()["usage"]["completion_tokens"] == 4:
                self.ok += 1
            else:
                self.failed.append(f"{got.status_code} {got.text[:200]}")

    def stop(self) -> None:
        self.stopped.set()
        for t in self.threads:
            t.join(timeout=300)


def replica_node_type(ray, serve) -> str:
    """The node type that holds the replica's placement group."""
    info = serve.get_app_handle(APP).info.remote().result()
    table = ray.util.placement_group_table()[info["placement_group_id"]]
    nodes = {n["NodeID"]: n for n in ray.nodes()}
    (node_id,) = set(table["bundles_to_node_id"].values())
    return WORKER_TYPE if SLOT in nodes[node_id]["Resources"] else "head"


def scenario(head: Head, model: str, timeout_s: float) -> dict:
    # before Ray is imported: it reads the token's settings once
    os.environ.update({k: head.env[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")})
    import ray
    from ray import serve

    start, times = time.monotonic(), {}
    deadline = start + timeout_s
    wait_until("head up", lambda: _connect(ray, head.address), start + 180, times, start)
    assert not worker_nodes(ray), "a worker node runs before any request"
    http_port = free_port()
    deploy(ray, serve, model, http_port)
    times["app deployed (0 replicas)"] = round(time.monotonic() - start, 1)
    traffic = Traffic(f"http://127.0.0.1:{http_port}")
    wait_until("worker node up", lambda: worker_nodes(ray), deadline, times, start)
    wait_until("first request answered", lambda: traffic.ok, deadline, times, start)
    where = replica_node_type(ray, serve)
    time.sleep(2)  # a few more requests on the new replica
    traffic.stop()
    times["traffic stopped"] = round(time.monotonic() - start, 1)
    wait_until("worker node removed", lambda: not worker_nodes(ray), deadline, times, start)
    serve.shutdown()
    ray.shutdown()
    return {"times": times, "ok": traffic.ok, "failed": traffic.failed, "replica_on": where}


def _connect(ray, address: str) -> bool:
    """Joins the head once its GCS port takes connections (a ray.init issued while the head is
    still starting can wait on the GCS far past the run's deadline)."""
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except OSError:  # not listening yet
        return False
    try:
        ray.init(address=address, logging_level="ERROR")
    except Exception:  # not up yet
        return False
    return True


def report(outcome: dict, timeout_s: float, args) -> None:
    """Each phase against the run's time bound (ratio <= 1: within it)."""
    times, ok, failed = outcome["times"], outcome["ok"], outcome["failed"]
    up = times["worker node up"] - times["app deployed (0 replicas)"]
    answered = times["first request answered"] - times["app deployed (0 replicas)"]
    down = times["worker node removed"] - times["traffic stopped"]
    on = f"replica on a {outcome['replica_on']} node; phases (s from start): {json.dumps(times)}"
    rows = [
        result(
            "requests answered", ok, "requests", ok + len(failed), 1.0, note=f"failed: {failed}"
        ),
        result("cold: first request to worker node up", up, "s", timeout_s, 1.0, "<=", note=on),
        result("cold: first request to its answer", answered, "s", timeout_s, 1.0, "<="),
        result("idle: traffic stopped to worker node removed", down, "s", timeout_s, 1.0, "<="),
    ]
    save_results(args, "autoscale", "cpu", {}, rows)


def main(argv=None) -> int:
    parser = bench_parser(__doc__, model=str(ROOT / ".tiny"))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    args = parser.parse_args(argv)
    work = tempfile.mkdtemp(prefix="dsv4as")
    head = Head(work)
    ok = False
    try:
        outcome = scenario(head, os.path.abspath(args.model), args.timeout)
        ok = outcome["replica_on"] == WORKER_TYPE and outcome["ok"] > 0
    finally:
        head.stop()
        if ok:  # the head's sessions, logs and token: kept only to debug a failed run
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"autoscale: the head's logs are in {work}/ray", flush=True)
    print(f"autoscale: {outcome['ok']} requests answered; replica on {outcome['replica_on']}")
    report(outcome, args.timeout, args)
    print("autoscale: PASSED" if ok else "autoscale: FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
