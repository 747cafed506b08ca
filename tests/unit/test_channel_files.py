"""The sweeps of channel files: those of raylets that no longer run go, a live raylet's (this
user's or another's) and files that are not channel files stay; those a dead driver's graph
ledger lists go once no process maps them."""

import json
import mmap
import os
import subprocess

from dsv4ray.cluster.channel_files import (
    drop_ledger,
    mapped_by_any_process,
    sweep_dead_graphs,
    sweep_dead_raylets,
    write_ledger,
)


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


def test_a_dead_drivers_graph_files_go_once_no_process_maps_them(tmp_path):
    """A driver killed without tearing its graph down leaves a ledger: its files go once no
    process maps them, then the ledger; a live driver's ledger and files stay."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    tag = os.urandom(4).hex()
    a, b, gone, live_file = (f"/dev/shm/sem.dsv4test{tag}-{n}" for n in "abcd")
    for path in (a, b, live_file):
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
    ledgers = tmp_path / "ledgers"
    ledgers.mkdir()
    (ledgers / f"{dead.pid}-0-x").write_text(json.dumps([a, b, gone]))
    live = write_ledger([live_file], str(ledgers))
    assert os.path.basename(live).startswith(f"{os.getpid()}-")
    held = open(b, "r+b")
    view = mmap.mmap(held.fileno(), 4096)  # b is still mapped (an actor still exiting)
    try:
        assert b in mapped_by_any_process() and a not in mapped_by_any_process()
        assert sweep_dead_graphs(str(ledgers)) == 1
        assert not os.path.exists(a) and os.path.exists(b)
        assert (ledgers / f"{dead.pid}-0-x").exists()  # b waits for the next sweep
    finally:
        view.close()
        held.close()
    try:
        assert sweep_dead_graphs(str(ledgers)) == 1
        assert not os.path.exists(b)
        assert sorted(p.name for p in ledgers.iterdir()) == [os.path.basename(live)]
        assert os.path.exists(live_file)
        drop_ledger(live)
        assert list(ledgers.iterdir()) == []
    finally:
        for path in (a, b, live_file):
            if os.path.exists(path):
                os.unlink(path)
