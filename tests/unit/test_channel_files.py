"""The sweep of channel files left by raylets that no longer run: theirs go, a live raylet's
(this user's or another's) and files that are not channel files stay."""

import os
import subprocess

from dsv4ray.cluster.channel_files import sweep_dead_raylets


def test_only_the_files_of_dead_raylets_are_removed(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid no process has now
    names = {
        f"sem.obj{dead.pid}-17": False,
        f"sem.hdr{dead.pid}-17": False,
        f"sem.obj{os.getpid()}-3": True,  # a running process's
        "sem.obj1-9": True,  # pid 1 runs (another user's, or root's)
        "sem.mp-abc": True,  # not a channel file
        f"dsv4ray-{dead.pid}-s0": True,
    }
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    assert sweep_dead_raylets(str(tmp_path)) == 2
    assert {p.name for p in tmp_path.iterdir()} == {n for n, keep in names.items() if keep}
