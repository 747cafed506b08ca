"""`ray job submit` against a local `ray start --head` runs `dsv4ray job` end to end."""

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys

import pytest

BIN = os.path.dirname(sys.executable)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head(tmp_path):
    """A separate Ray head with token authentication on (RAY_AUTH_MODE=token for every CLI)."""
    token = tmp_path / "auth_token"
    token.write_text(secrets.token_hex(32))
    env = dict(
        os.environ,
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(token),
        PATH=f"{BIN}:{os.environ.get('PATH', '')}",
    )
    env.pop("RAY_ADDRESS", None)
    dash = _free_port()
    temp_dir = f"/tmp/rj{secrets.token_hex(3)}"
    cmd = [
        f"{BIN}/ray",
        "start",
        "--head",
        f"--port={_free_port()}",
        "--num-cpus=2",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dash}",
        f"--temp-dir={temp_dir}",
        "--include-dashboard=true",
        "--disable-usage-stats",
    ]
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=120)
    try:
        yield env, f"http://127.0.0.1:{dash}"
    finally:
        subprocess.run([f"{BIN}/ray", "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp_dir, ignore_errors=True)


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
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert "line 3" in log  # the broken line is reported with its number
    rows = {r["id"]: r for r in map(json.loads, dst.read_text().splitlines())}
    assert set(rows) == {"a", "b"}
    assert len(rows["a"]["token_ids"]) == 4 and len(rows["b"]["token_ids"]) == 3
    assert rows["a"]["finish_reason"] == "length"
    assert "2 requests" in log and "TTFT p50" in log
    assert proc.returncode != 0  # a bad line makes the job fail after the good ones ran
