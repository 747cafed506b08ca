"""The host tier: one detached, named actor per node that owns the node's host-cache memory.

``HostTier`` (a plain class, tested without Ray) creates one shared-memory region per (engine,
stage) key as a file in /dev/shm (a temp folder when /dev/shm is missing or too small), keeps
the lease table and removes regions on release. Stage actors on the node map a region by path and
copy device <-> host themselves (on GPU machines they page-lock their mapping with
cudaHostRegister); control calls carry region keys and paths, never page bytes. The actor
outlives engines and stage restarts, so a restarted stage finds its pages again.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

import ray

log = logging.getLogger("dsv4ray.host_tier")

NAMESPACE = "dsv4ray"


def _root_for(nbytes: int) -> str:
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > nbytes:
        return shm
    return tempfile.gettempdir()


class HostTier:
    def __init__(self) -> None:
        self.regions: dict[str, dict] = {}

    def create_region(self, key: str, nbytes: int) -> dict:
        """The region for key, created (zero-filled, sparse) on first use; same path after.
        ``created`` says which: a region created again (its tier died and a new one took over)
        holds none of the pages the engine's index believes are there."""
        region = self.regions.get(key)
        if region is not None:
            if region["nbytes"] != nbytes:
                raise ValueError(
                    f"host region {key!r} exists with {region['nbytes']} bytes, not {nbytes}"
                )
            return {**region, "created": False}
        path = os.path.join(_root_for(nbytes), f"dsv4ray-{key}")
        with open(path, "wb") as f:
            f.truncate(nbytes)
        self.regions[key] = {"key": key, "path": path, "nbytes": nbytes}
        log.info("host tier: region %s, %.1f MiB at %s", key, nbytes / 2**20, path)
        return {**self.regions[key], "created": True}

    def release_region(self, key: str) -> bool:
        region = self.regions.pop(key, None)
        if region is None:
            return False
        _unlink(region["path"])
        return True

    def usage(self) -> dict:
        return {
            "num_regions": len(self.regions),
            "bytes": sum(r["nbytes"] for r in self.regions.values()),
        }

    def ping(self) -> bool:
        return True

    def shutdown(self) -> None:
        for key in list(self.regions):
            self.release_region(key)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@ray.remote(num_cpus=0)
class HostTierActor(HostTier):
    """The actor shell: the same methods, one instance per node, detached."""


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
