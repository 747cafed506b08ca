"""`ray job submit` against a local `ray start --head` runs `dsv4ray job --replicas 2` end to
end: 100 requests resumed from an earlier run's output, both engines busy, the output complete."""

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time

import pytest

from dsv4ray.bench.autoscale import stop_head
from dsv4ray.entrypoints.job import run_job

BIN = os.path.dirname(sys.executable)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head(tmp_path):
    """A separate Ray head with token authentication on (RAY_AUTH_MODE=token for every CLI).

    Started with --block and stopped by terminating that process and killing what is left of
    this head (``ray stop`` would stop every Ray on the machine).
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
        stop_head(head, temp_dir)
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
            "--num-cpus=4",  # logical: two replicas and their stages on 2 cores
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


def _input_line(i: int) -> dict:
    """Request i: a prompt (4 or 5 tokens) or chat messages (1 token)."""
    if i % 6 == 0:  # with a tool the answer may call (or, every other one, may not)
        choice = {"tool_choice": "none"} if i % 12 == 0 else {}
        return {"id": i, "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 1,
                "tools": [{"type": "function", "function": {"name": "f"}}], **choice}  # fmt: skip
    if i % 3 == 0:
        return {"id": i, "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 1}
    # 4-5 tokens: a chunk outlasts the 0.1 s Ray Data takes to hand out the next one
    return {"id": i, "prompt": f"Hello {i}", "max_tokens": 4 + i % 2, "ignore_eos": True}


def _prior_run(num_done: int) -> list[str]:
    """The output of an earlier run cut short: num_done finished lines, then id num_done
    aborted, then id num_done + 1 cut mid-line."""
    done = [{"id": str(i), "text": "x", "token_ids": [7], "finish_reason": "length"}
            for i in range(num_done)]  # fmt: skip
    aborted = {"id": str(num_done), "finish_reason": "abort", "error": "stage died"}
    return [json.dumps(r) + "\n" for r in [*done, aborted]] + [f'{{"id": "{num_done + 1}", "te']


NUM_LINES, NUM_DONE = 100, 25  # input lines; lines an earlier run finished


def test_ray_job_submit_runs_100_requests_on_two_replicas(ray_head, tiny_ckpt, tmp_path):
    env, address = ray_head
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [json.dumps(_input_line(i)) for i in range(NUM_LINES)]
    src.write_text("\n".join(lines[:50] + ["{broken"] + lines[50:]) + "\n")
    prior = _prior_run(NUM_DONE)
    dst.write_text("".join(prior))
    cmd = [
        *(f"{BIN}/ray", "job", "submit", "--address", address, "--"),
        *(f"{BIN}/dsv4ray", "job", "--model", tiny_ckpt, "--replicas", "2"),
        *("--input", str(src), "--output", str(dst), "--kv-cache-dtype", "fp32"),
    ]
    for _ in range(30):  # the head's job agent registers a little after its dashboard
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        log = proc.stdout + proc.stderr
        if "No available agent to submit job" not in log:
            break
        time.sleep(2)
    assert "line 51: not JSON" in log  # the broken line is reported with its number
    todo = NUM_LINES - NUM_DONE
    summary = f"{todo} requests (0 failed, 1 bad lines, {NUM_DONE} already done, 1 retried)"
    assert summary in log, log[-3000:]
    # the log may show a line twice (streamed, then the job's logs): one count per replica
    per_replica = {name: int(n) for name, n in re.findall(r"replica (\S+): (\d+) requests", log)}
    assert len(per_replica) == 2 and min(per_replica.values()) > 0, log[-3000:]  # both busy
    assert sum(per_replica.values()) == todo
    assert proc.returncode != 0  # a bad line makes the job fail after the good ones ran

    text = dst.read_text()
    assert text.startswith("".join(prior))  # append-only
    last = {}
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # the cut line of the earlier run
        last[row["id"]] = row
    assert set(last) == {str(i) for i in range(NUM_LINES)}  # complete: the last line of each id
    for i in range(NUM_DONE, NUM_LINES):
        row, asked = last[str(i)], _input_line(i)["max_tokens"]
        assert row["finish_reason"] in ("length", "stop") and "error" not in row, row
        assert len(row["token_ids"]) == asked or row["finish_reason"] == "stop", row
        if i % 6 == 0:  # one token is no call: the answer is its text
            assert (row["content"], row["tool_calls"]) == (row["text"], []), row
    assert run_job(tiny_ckpt, str(src), str(dst)) == 1  # the bad line again; nothing to redo
