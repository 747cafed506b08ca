"""Where each stage of a prefill/decode pipeline finds worker/pd/bind_only.c's library.

A preloaded library must exist on the node whose worker loads it, so every node that holds a
bundle of the pipeline gets its own copy: built here for this process's node, by a zero-CPU
task pinned to each other node. A node that cannot build it (no C compiler; the build says
why in that node's log) gets None, and its stages fall back to socket filters over wildcard
listeners.
"""

from __future__ import annotations

import logging

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from dsv4ray.worker.pd.bind_only import library, preload_env

log = logging.getLogger("dsv4ray.pipeline")


@ray.remote(num_cpus=0)
def _library_on_node() -> str | None:
    return library()


def stage_runtime_envs(pg, count: int, timeout_s: float) -> list[dict | None]:
    """Per bundle of pg (count of them), the runtime_env that preloads the library on the
    bundle's node, or None where that node has none."""
    nodes = ray.util.placement_group_table(pg)["bundles_to_node_id"]
    placed = [nodes[i] for i in range(count)]  # bundle index -> node id (hex)
    here = ray.get_runtime_context().get_node_id()
    paths = {here: library()} if here in placed else {}
    others = sorted({node for node in placed if node not in paths})
    refs = [
        _library_on_node.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
        ).remote()
        for node in others
    ]
    for node, ref in zip(others, refs):
        try:
            paths[node] = ray.get(ref, timeout=timeout_s)
        except Exception as exc:  # the node went away, or its worker could not start
            log.warning("node %s: no bind library (%s)", node[:8], exc)
            paths[node] = None
    return [{"env_vars": preload_env(paths[node])} if paths.get(node) else None for node in placed]
