"""`ray job submit` against a local `ray start --head` runs `dsv4ray job` end to end."""

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time

import pytest

BIN = os.path.dirname(sys.executable)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head(tmp_path):
    """A separate Ray head with token authentication on (RAY_AUTH_MODE=token for every CLI).

    Started with --block and stopped by terminating that process, which stops exactly this
    head (``ray stop`` would stop every Ray on the machine).
    """
    token = tmp_path / "auth_token"
    token.write_text(secrets.token_hex(32))
    env = dict(
        os.environ,
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(token),
        PATH=f"{BIN}:{os.environ.get('PATH', '')}",
    )
    env.pop("RAY_ADDRESS", None)
    temp_dir = f"/tmp/rj{secrets.token_hex(3)}"
    head, address = _start_head(env, temp_dir)
    try:
        yield env, address
    finally:
        head.terminate()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _start_head(env: dict, temp_dir: str, attempts: int = 2):
    """Starts the head; one retry, as a loaded machine can make its GCS start time out."""
    for attempt in range(attempts):
        dash = _free_port()
        cmd = [
            f"{BIN}/ray",
            "start",
            "--head",
            "--block",
            f"--port={_free_port()}",
            "--num-cpus=2",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash}",
            # every port of its own: a Ray already running here holds the defaults
            *(
                f"--{name}={_free_port()}"
                for name in (
                    "dashboard-agent-listen-port",
                    "dashboard-agent-grpc-port",
                    "metrics-export-port",
                    "runtime-env-agent-port",
                    "ray-client-server-port",
                )
            ),
            f"--temp-dir={temp_dir}",
            "--include-dashboard=true",
            "--disable-usage-stats",
        ]
        head = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        address = f"http://127.0.0.1:{dash}"
        try:
            _wait_for_dashboard(address, env, head)
            return head, address
        except (RuntimeError, TimeoutError):
            head.kill()
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _wait_for_dashboard(address: str, env: dict, head: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if head.poll() is not None:
            raise RuntimeError(f"ray start --head exited with {head.returncode}")
        probe = subprocess.run(
            [f"{BIN}/ray", "job", "list", "--address", address],
            env=env,
            capture_output=True,
            timeout=60,
        )
        if probe.returncode == 0:
            return
        time.sleep(1)
    raise TimeoutError("the Ray head's job server did not come up")


def test_ray_job_submit_runs_the_batch_job(ray_head, tiny_ckpt, tmp_path):
    env, address = ray_head
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [
        {"id": "a", "prompt": "Hello", "max_tokens": 4},
        {"id": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    ]
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n{broken\n")
    cmd = [
        f"{BIN}/ray",
        "job",
        "submit",
        "--address",
        address,
        "--",
        f"{BIN}/dsv4ray",
        "job",
        "--model",
        tiny_ckpt,
        "--input",
        str(src),
        "--output",
        str(dst),
        "--max-tokens",
        "8",
    ]
    for _ in range(30):  # the head's job agent registers a little after its dashboard
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        log = proc.stdout + proc.stderr
        if "No available agent to submit job" not in log:
            break
        time.sleep(2)
    assert "line 3" in log  # the broken line is reported with its number
    rows = {r["id"]: r for r in map(json.loads, dst.read_text().splitlines())}
    assert set(rows) == {"a", "b"}
    assert len(rows["a"]["token_ids"]) == 4 and len(rows["b"]["token_ids"]) == 3
    assert rows["a"]["finish_reason"] == "length"
    assert "2 requests" in log and "TTFT p50" in log
    assert proc.returncode != 0  # a bad line makes the job fail after the good ones ran
