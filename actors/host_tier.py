"""The host tier: one detached, named actor per node that owns the node's host-cache memory.

``HostTier`` (a plain class, tested without Ray) creates one shared-memory region per (engine,
stage) key as a file in /dev/shm (a temp folder when /dev/shm is missing or too small), keeps
the lease table and removes regions on release. Stage actors on the node map a region by path and
copy device <-> host themselves (on GPU machines they page-lock their mapping with
cudaHostRegister); control calls carry region keys and paths, never page bytes. The actor
outlives engines and stage restarts, so a restarted stage finds its pages again.

Each region names its holder, the stage process on this node that maps it. An engine that
shuts down releases its regions; one that dies without doing so (a replica killed with its
stages) leaves them to the sweep: a region whose holder has been gone for the region's grace
period (longer than the engine takes to rebuild a stage, which claims the region again with
its new process) is released. The actor sweeps every SWEEP_INTERVAL_S.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable

import ray

from dsv4ray.actors.processes import process_alive

log = logging.getLogger("dsv4ray.host_tier")

NAMESPACE = "dsv4ray"
SWEEP_INTERVAL_S = 30.0


def _root_for(nbytes: int, committed: int) -> str:
    """Where a region of nbytes goes: /dev/shm (memory) when it can hold it beside what the
    tier's other regions may still grow into (committed: regions are sparse, so a filesystem's
    free space does not count them until they fill), else the temporary directory; a region
    neither can hold is refused, naming the option that sizes it."""
    need = nbytes + committed
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > need:
        return shm
    tmp = tempfile.gettempdir()
    if shutil.disk_usage(tmp).free <= need:
        raise ValueError(
            f"a host tier region of {nbytes / 2**30:.1f} GiB (beside {committed / 2**30:.1f} GiB "
            "its other regions may still fill) fits neither /dev/shm nor the temporary directory: "
            "lower host_cache_tokens"
        )
    return tmp


def _unfilled(region: dict) -> int:
    """The bytes a sparse region may still take from its filesystem."""
    try:
        allocated = os.stat(region["path"]).st_blocks * 512
    except OSError:
        return 0
    return max(region["nbytes"] - allocated, 0)


class HostTier:
    """clock and alive (pid -> bool) are the sweep's view of time and of this node's
    processes."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 alive: Callable[[int], bool] = process_alive) -> None:  # fmt: skip
        self.regions: dict[str, dict] = {}
        self.clock, self.alive = clock, alive
        self._lock = threading.Lock()  # the actor's sweep thread beside its calls

    def create_region(self, key: str, nbytes: int, holder_pid: int | None = None,
                      grace_s: float | None = None) -> dict:  # fmt: skip
        """The region for key, created (zero-filled, sparse) on first use; same path after,
        now held by holder_pid (None: held until released), which the sweep releases once that
        process has been gone grace_s (the holder's rebuild bound). ``created`` says which: a region
        created again (its tier died and a new one took over, or the sweep released it) holds
        none of the pages the engine's index believes are there."""
        if holder_pid is not None and grace_s is None:
            raise ValueError(f"host region {key!r}: a holder_pid needs grace_s")
        with self._lock:
            region = self.regions.get(key)
            created = region is None
            if region is not None and region["nbytes"] != nbytes:
                raise ValueError(
                    f"host region {key!r} exists with {region['nbytes']} bytes, not {nbytes}"
                )
            if created:
                committed = sum(_unfilled(r) for r in self.regions.values())
                path = os.path.join(_root_for(nbytes, committed), f"dsv4ray-{key}")
                with open(path, "wb") as f:
                    f.truncate(nbytes)
                region = self.regions[key] = {"key": key, "path": path, "nbytes": nbytes}
                log.info("host tier: region %s, %.1f MiB at %s", key, nbytes / 2**20, path)
            region.update(holder_pid=holder_pid, grace_s=grace_s, gone_since=None)
            return {"key": key, "path": region["path"], "nbytes": nbytes, "created": created}

    def release_region(self, key: str) -> bool:
        with self._lock:
            region = self.regions.pop(key, None)
        if region is None:
            return False
        _unlink(region["path"])
        return True

    def sweep(self) -> list[str]:
        """Releases the regions whose holder has been gone for their grace period; returns
        their keys. A holder seen alive again (a pid reused) keeps its region."""
        now, expired = self.clock(), []
        with self._lock:
            for key, region in self.regions.items():
                pid = region.get("holder_pid")
                if pid is None or self.alive(pid):
                    region["gone_since"] = None
                    continue
                if region["gone_since"] is None:
                    region["gone_since"] = now
                if now - region["gone_since"] >= region["grace_s"]:
                    expired.append(key)
        for key in expired:
            if self.release_region(key):
                log.warning("host tier: released region %s, its holder has been gone for "
                            "its grace period (an engine that died without shutting down)",
                            key)  # fmt: skip
        return expired

    def usage(self) -> dict:
        with self._lock:
            return {
                "num_regions": len(self.regions),
                "bytes": sum(r["nbytes"] for r in self.regions.values()),
            }

    def ping(self) -> bool:
        return True

    def shutdown(self) -> None:
        with self._lock:
            keys = list(self.regions)
        for key in keys:
            self.release_region(key)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@ray.remote(num_cpus=0)
class HostTierActor(HostTier):
    """The actor shell: the same methods, one instance per node, detached, sweeping its regions
    every SWEEP_INTERVAL_S from a thread of its own."""

    def __init__(self) -> None:
        super().__init__()
        threading.Thread(target=self._sweep_forever, name="host-tier-sweep", daemon=True).start()

    def _sweep_forever(self) -> None:
        while True:
            time.sleep(SWEEP_INTERVAL_S)
            try:
                self.sweep()
            except Exception:  # a sweep that failed tries again next time
                log.exception("host tier sweep failed")


def host_tier_for_node(node_id: str):
    """The node's host tier actor, created on first use (detached: it outlives this engine)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return HostTierActor.options(
        name=f"dsv4ray-host-tier-{node_id[:16]}",
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote()


def release_host_tiers(timeout_s: float = 10.0) -> int:
    """Every node's host tier releases all its regions (for a Ray about to be shut down whose
    engines have all finished: regions of engines killed without a shutdown would otherwise
    stay in /dev/shm). Returns how many tiers answered."""
    answered = 0
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        try:
            tier = ray.get_actor(f"dsv4ray-host-tier-{node['NodeID'][:16]}", namespace=NAMESPACE)
            ray.get(tier.shutdown.remote(), timeout=timeout_s)
            answered += 1
        except Exception as exc:  # no tier on that node, or it died: nothing it could free
            log.debug("host tier of node %s: %s", node["NodeID"][:16], exc)
    return answered
