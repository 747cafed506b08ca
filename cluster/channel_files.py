"""The /dev/shm files of a compiled graph's shared-memory channels, and their removal.

Ray 2.60 gives every shared-memory channel two POSIX semaphores, files
``/dev/shm/sem.{obj,hdr}<raylet pid>-<ns>``. It never frees them while a graph runs or after
``teardown()``: each process that used a channel unlinks them only when its core worker is
destroyed, on a clean exit.
An actor killed with ``ray.kill`` (or one that crashed) never gets there, and a live actor keeps
the files of every graph it ever ran until it exits. A StageGraph (cluster/stage_graph.py)
therefore records, once built, the channel files that this (driver) process and each of its
actors map, and removes exactly those when it is torn down. Channels a graph grows while it runs
(a larger message gets a new buffer) are recorded from what its actors on this machine map, every
LEDGER_REFRESH_S while it runs and when it is torn down, before any of them is killed.
``node_shm_files`` counts the files a node's graphs and host tiers hold (tests, bench/chaos.py);
``sweep_dead_raylets`` removes those of raylets that no longer run (a command that stopped the
local Ray it started calls it, so actors killed with that Ray leave nothing behind).
A driver killed outright (a Serve or job replica's SIGKILL) never tears its graph down, and its
raylet lives on: every built graph therefore leaves a ledger of its files, named by its driver's
pid, in ``/dev/shm/dsv4ray-graphs-<uid>/``, which its teardown deletes. ``sweep_dead_graphs``
(run by every graph build) removes the files of ledgers whose driver is gone once no live
process maps them, and then the ledger.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import threading

from dsv4ray.actors.processes import process_alive

log = logging.getLogger("dsv4ray.pipeline")

SEM_PREFIX = "/dev/shm/sem."

# Held from just before a graph is compiled until its channels are mapped (one warm-up step),
# so no other graph in this process maps new channel files in between: the difference of
# two ``mapped_channel_files()`` calls then belongs to that graph alone.
BUILD_LOCK = threading.Lock()


def mapped_channel_files(pid: int | str = "self") -> set[str]:
    """Paths of the semaphore files a process of this machine maps (this one by default; empty
    where there is no /proc or no such process)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    paths = set()
    for line in lines:
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
        path = fields[5] if len(fields) == 6 else ""
        if path.startswith(SEM_PREFIX) and not path.endswith("(deleted)"):
            paths.add(path)
    return paths


def remove_channel_files(paths: list[str]) -> int:
    """Unlinks the paths still present; returns how many it removed. Called only once no
    process will open these channels again (the graph is torn down, its actors are gone)."""
    removed = 0
    for path in paths:
        try:
            os.unlink(path)
            removed += 1
        except FileNotFoundError:
            continue  # the usual case: a stage's clean exit removed it
        except OSError as exc:
            log.warning("channel file %s not removed: %s", path, exc)
    if removed:  # a dead stage's, or those of a stage still exiting
        log.info("removed %d channel files of a torn-down graph from /dev/shm", removed)
    return removed


LEDGER_DIR = f"/dev/shm/dsv4ray-graphs-{os.getuid()}"
_ledger_ids = itertools.count()


def write_ledger(files: list[str], ledger_dir: str = LEDGER_DIR,
                 path: str | None = None) -> str | None:  # fmt: skip
    """Records a built graph's channel files under this (driver) process's pid; returns the
    ledger's path (None where there is no /dev/shm or nothing to record). path: a ledger this
    process wrote, replaced whole (its graph's channels grew)."""
    if not files or not os.path.isdir(os.path.dirname(ledger_dir)):
        return None
    if path is None:
        path = os.path.join(ledger_dir,
                            f"{os.getpid()}-{next(_ledger_ids)}-{os.urandom(4).hex()}")  # fmt: skip
    try:
        os.makedirs(ledger_dir, mode=0o700, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(sorted(files), f)
        os.replace(path + ".tmp", path)  # a sweep never reads half a ledger
    except OSError as exc:  # a full or read-only /dev/shm: the graph runs, unrecorded
        log.warning("graph ledger %s not written: %s", path, exc)
        return None
    return path


def drop_ledger(path: str | None) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def sweep_dead_graphs(ledger_dir: str = LEDGER_DIR) -> int:
    """Removes the channel files of graphs whose driver no longer runs and that no live process
    maps (the driver's actors exit a moment after it: a file they still map waits for the next
    sweep), and each ledger whose files are all gone. Returns how many files it removed."""
    try:
        names = os.listdir(ledger_dir)
    except FileNotFoundError:
        return 0
    owners = [(n, n.split("-", 1)[0]) for n in names]
    dead = [n for n, pid in owners if pid.isdigit() and not process_alive(int(pid))]
    if not dead:
        return 0
    mapped, removed = mapped_by_any_process(), 0
    for name in dead:
        path = os.path.join(ledger_dir, name)
        try:
            with open(path) as f:
                files = json.load(f)
        except (OSError, ValueError):  # a ledger cut short by its driver's death
            files = []
        left = [f for f in files if os.path.exists(f)]
        removed += remove_channel_files([f for f in left if f not in mapped])
        if not any(f in mapped for f in left):
            drop_ledger(path)
    if removed:
        log.info("removed %d channel files of graphs whose driver died", removed)
    return removed


def mapped_by_any_process() -> set[str]:
    """The semaphore files any process of this machine that this user can read maps."""
    try:
        pids = [e for e in os.listdir("/proc") if e.isdigit()]
    except FileNotFoundError:
        return set()
    return set().union(*(mapped_channel_files(pid) for pid in pids))


def raylet_pid() -> int:
    """Pid of the raylet this driver is connected to (it must run on this machine): the channel
    files of the node's graphs carry it in their names."""
    import ray

    want = f"--raylet_socket_name={ray._private.worker._global_node.raylet_socket_name}"
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue  # the process ended meanwhile
        if want in args:
            return int(entry)
    raise RuntimeError(f"no raylet process on this machine has {want}")


def node_shm_files(raylet_pid: int, pipeline_keys: list[str]) -> set[str]:
    """Names in /dev/shm of the channel files of the raylet's node and of the host tier
    regions (``dsv4ray-<key>-s<stage>``) of the given pipelines; other Ray instances and
    engines on the machine are left out."""
    prefixes = (
        f"sem.obj{raylet_pid}-",
        f"sem.hdr{raylet_pid}-",
        *(f"dsv4ray-{key}-" for key in pipeline_keys),
    )
    try:
        names = os.listdir("/dev/shm")
    except FileNotFoundError:
        return set()
    return {name for name in names if name.startswith(prefixes)}


def sweep_dead_raylets(shm: str = "/dev/shm") -> int:
    """Removes this user's channel files of raylets no longer running on this machine (a
    stopped or killed Ray leaves those of actors that never exited cleanly); files of a live
    raylet stay. Returns how many it removed."""
    try:
        names = os.listdir(shm)
    except FileNotFoundError:
        return 0
    dead = [
        os.path.join(shm, name)
        for name in names
        if (match := _CHANNEL_FILE.match(name)) and not process_alive(int(match.group(1)))
    ]
    return remove_channel_files([path for path in dead if _owned(path)])


_CHANNEL_FILE = re.compile(r"sem\.(?:obj|hdr)(\d+)-")


def _owned(path: str) -> bool:
    """This user's file (another user's Ray is that user's to clean)."""
    try:
        return os.stat(path).st_uid == os.getuid()
    except FileNotFoundError:
        return False


def actor_channel_files(actors: list, timeout_s: float = 10.0) -> set[str]:
    """The channel files the given actors' processes map; dead or unresponsive actors are
    left out (their channels are mapped by the other end as well)."""
    import ray

    refs = [actor.__ray_call__.remote(_mapped_in_actor) for actor in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    files: set[str] = set()
    for ref in ready:
        try:
            files |= ray.get(ref)
        except Exception as exc:  # a dead actor surfaces in several exception types
            log.debug("channel files of an actor: %s", exc)
    return files


def _mapped_in_actor(_instance) -> set[str]:
    return mapped_channel_files()
