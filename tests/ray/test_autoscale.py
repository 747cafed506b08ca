"""Autoscaling from a cold cluster (bench/autoscale.py on Ray's fake multi-node provider, with a
head of its own): requests make Serve add a replica, its placement group makes the autoscaler
start a node of the type that carries the stage resource, the requests are answered on that
node, and with no traffic the replica and then the node go away."""

import glob
import json
import os
import subprocess
import sys
import tempfile


def test_a_cold_cluster_scales_up_for_requests_and_back_down(tiny_ckpt, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, "-m", "dsv4ray.bench", "autoscale", "--model", tiny_ckpt]
    work_dirs = os.path.join(tempfile.gettempdir(), "dsv4as*")  # the bench's own head's dir
    before = set(glob.glob(work_dirs))
    done = subprocess.run(
        [*cmd, "--timeout", "240", "--out-dir", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("autoscale:")]
    assert done.returncode == 0 and "autoscale: PASSED" in lines, lines + [done.stderr[-3000:]]
    phases = [line.split(" after ")[0] for line in lines if " after " in line]
    assert phases == [
        "autoscale: head up",
        "autoscale: worker node up",
        "autoscale: first request answered",
        "autoscale: worker node removed",
    ]
    assert set(glob.glob(work_dirs)) <= before, "a passed run left its head's temp dir"
    rows = {
        r["name"]: r for r in json.loads((tmp_path / "autoscale-cpu.json").read_text())["results"]
    }
    assert rows["requests answered"]["value"] >= 1
    assert "replica on a stage_worker node" in rows["cold: first request to worker node up"]["note"]
