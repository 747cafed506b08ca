"""`dsv4ray job` on Ray Data: two replicas share the work, a rerun retries the ids whose last
output line aborted, SIGINT and SIGTERM (`ray job stop`) end the job with a summary and exit
codes 130 and 143, and usage errors exit with 2 before Ray starts."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import tracemalloc

import pytest
import ray

from dsv4ray.__main__ import main
from dsv4ray.entrypoints.job import JobOptions, run_job
from tests.ray.shm_files import ShmFiles

REPEATS = 2  # per signal: a stop that works only most of the time fails in production


def _row(req_id: str, finish_reason: str, **extra) -> str:
    row = {"id": req_id, "text": "x", "token_ids": [7], "finish_reason": finish_reason}
    return json.dumps({**row, "metrics": {}, **extra}) + "\n"


def test_two_replicas_share_the_work_and_a_rerun_retries_ids_whose_last_line_aborted(
    ray_session, tiny_ckpt, tmp_path, capsys
):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = [*"abcd", *(f"e{i}" for i in range(12))]
    src.write_text(
        "".join(
            json.dumps({"id": i, "prompt": f"Hello {i}", "max_tokens": 16, "ignore_eos": True})
            + "\n"
            for i in ids
        )
    )
    # a killed earlier run's output: the last line of an id wins, d's line was cut short
    prior = [
        _row("a", "length"),
        _row("b", "length"),
        _row("b", "abort", error="pipeline stage failed"),
        _row("c", "abort", error="pipeline stage failed"),
        _row("c", "stop"),
        '{"id": "d", "text": "cut sho',
    ]
    dst.write_text("".join(prior))
    job = JobOptions(replicas=2)
    # Ray Data hands the pool about a chunk (here 2 lines) per 0.1 s: 16 tokens make a chunk
    # outlast that, so the second replica gets work however fast the first is
    assert run_job(tiny_ckpt, str(src), str(dst), job, kv_cache_dtype="fp32") == 0
    err = capsys.readouterr().err
    assert "14 requests (0 failed, 0 bad lines, 2 already done, 1 retried)" in err, err
    per_replica = [int(n) for n in re.findall(r"replica \S+: (\d+) requests", err)]
    assert len(per_replica) == 2 and min(per_replica) > 0 and sum(per_replica) == 14, err
    lines = dst.read_text().splitlines()
    assert lines[: len(prior)] == [line.rstrip("\n") for line in prior]  # append-only
    new = [json.loads(line) for line in lines[len(prior) :]]
    assert sorted(r["id"] for r in new) == sorted(["b", "d", *ids[4:]])
    assert all(r["finish_reason"] == "length" and len(r["token_ids"]) == 16 for r in new), new


def test_the_driver_holds_no_input_line_its_memory_stays_flat(
    ray_session, tiny_ckpt, tmp_path, monkeypatch
):
    """Lines go from the read task to the replicas, never through the driver: a 128 MiB input
    (each line carries a 2 MiB stop string) moves the driver's peak Python memory by a small
    fraction of it (the first job of a process also imports Ray Data's executor). The input is
    given relative to the driver's folder, as a user types it; the read task runs elsewhere."""
    monkeypatch.chdir(tmp_path)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    stop = "\u00e9" * (2**20 // 3)  # 2 MiB in the file, where JSON escapes each in 6 bytes
    line = {"prompt": "Hi", "max_tokens": 1, "ignore_eos": True, "stop": [stop]}
    src.write_text("".join(json.dumps({"id": i, **line}) + "\n" for i in range(64)))
    size = src.stat().st_size
    assert size > 120 * 2**20
    tracemalloc.start()
    try:
        assert run_job(tiny_ckpt, "in.jsonl", "out.jsonl", kv_cache_dtype="fp32") == 0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < size / 4, (peak, size)
    assert len(dst.read_text().splitlines()) == 64


class _Stderr:
    """Collects a child's stderr as it comes (tqdm redraws with \\r, not whole lines)."""

    def __init__(self, stream) -> None:
        self.chunks: list[bytes] = []
        self.thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self.thread.start()

    def _pump(self, stream) -> None:
        for chunk in iter(lambda: stream.read1(4096), b""):
            self.chunks.append(chunk)

    def text(self) -> str:
        return b"".join(self.chunks).decode(errors="replace")

    def wait_for(self, needle: str, proc: subprocess.Popen, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while needle not in self.text():
            assert proc.poll() is None, f"the job ended early:\n{self.text()}"
            assert time.monotonic() < deadline, f"no {needle!r} yet:\n{self.text()}"
            time.sleep(0.2)


@pytest.mark.parametrize(
    ("sig", "code", "how"),
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "stopped by SIGTERM")],
)
def test_a_signal_ends_the_job_with_a_summary_and_its_exit_code(
    ray_session, tiny_ckpt, tmp_path, sig, code, how
):
    """REPEATS jobs on the running Ray, each stopped by the signal while it decodes: each
    exits with the code and its summary, writes no line for what it did not finish, and
    leaves no file of the node behind."""
    shm = ShmFiles()
    baseline = shm.now()
    for attempt in range(REPEATS):
        _stop_a_decoding_job(tiny_ckpt, tmp_path / str(attempt), sig, code, how)
        assert shm.settle(0, baseline) == set(), attempt  # its replicas end a moment after it


def _stop_a_decoding_job(tiny_ckpt, folder, sig, code: int, how: str) -> None:
    folder.mkdir()
    src, dst = folder / "in.jsonl", folder / "out.jsonl"
    long = {"max_tokens": 1000, "ignore_eos": True}  # minutes of decoding on CPU
    src.write_text("".join(json.dumps({"id": i, "prompt": "Hi", **long}) + "\n" for i in range(3)))
    # the child joins this session's Ray instead of starting one (seconds saved)
    env = dict(os.environ, RAY_ADDRESS=ray._private.worker._global_node.address)
    cmd = [sys.executable, "-m", "dsv4ray", "job", "--model", tiny_ckpt, "--input", str(src)]
    proc = subprocess.Popen(
        [*cmd, "--output", str(dst), "--kv-cache-dtype", "fp32"], env=env, stderr=subprocess.PIPE
    )
    err = _Stderr(proc.stderr)
    try:
        err.wait_for("lines:", proc, timeout_s=240)  # the progress bar: decoding started
        time.sleep(1)
        proc.send_signal(sig)
        assert proc.wait(timeout=10) == code, err.text()  # stopped within 10 s
    finally:
        proc.kill()
    err.thread.join(timeout=10)
    text = err.text()
    said = f"dsv4ray job: {how}, 3 input lines not reached (a rerun does the unfinished)"
    assert said in text, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert dst.read_text() == ""  # interrupted requests get no line, so a rerun does them


def test_usage_errors_exit_2_before_ray_starts(tiny_ckpt, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": 1, "prompt": "Hi"}) + "\n")
    out = str(tmp_path / "out.jsonl")
    cases = {
        "no input file": ["--model", tiny_ckpt, "--input", str(tmp_path / "nope"), "--output", out],
        "no checkpoint": ["--model", str(tmp_path), "--input", str(src), "--output", out],
        "cannot write the output": [
            *("--model", tiny_ckpt, "--input", str(src)),
            *("--output", str(tmp_path / "missing" / "out.jsonl")),
        ],
        f"--output {str(src)!r} is the input file": [
            *("--model", tiny_ckpt, "--input", str(src), "--output", str(src)),
        ],
    }
    for message, args in cases.items():
        assert main(["job", *args]) == 2, message
        assert f"dsv4ray job: error: {message}" in capsys.readouterr().err
    assert src.read_text() == json.dumps({"id": 1, "prompt": "Hi"}) + "\n"  # left as it was
    no_output = ["--input", str(src)]
    for args in (no_output, [*no_output, "--output", out, "--max-tokens", "0"]):
        with pytest.raises(SystemExit) as exc:  # argparse's own usage errors
            main(["job", *args])
        assert exc.value.code == 2
    assert not os.path.exists(out)


def test_a_replica_runs_two_chunks_at_once_so_a_slow_line_holds_back_no_other_chunk(
    ray_session, tiny_ckpt, tmp_path, capsys
):
    """One replica, chunks of two lines, the first chunk holding a long request: the chunks
    after it finish (and are written) while it still decodes."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"id": "slow", "prompt": "Hi", "max_tokens": 120, "ignore_eos": True}]
    lines += [{"id": f"fast{i}", "prompt": "Hi", "max_tokens": 2, "ignore_eos": True}
              for i in range(7)]  # fmt: skip
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert run_job(tiny_ckpt, str(src), str(dst), JobOptions(replicas=1),
                   kv_cache_dtype="fp32") == 0  # fmt: skip
    order = [json.loads(line)["id"] for line in dst.read_text().splitlines()]
    assert sorted(order) == sorted(line["id"] for line in lines)
    assert order.index("fast1") < order.index("slow"), order  # the second chunk's first line
