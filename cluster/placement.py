"""Joining or starting Ray, and the resource shapes of pipeline bundles."""

from __future__ import annotations

import logging
import os

log = logging.getLogger("dsv4ray.ray")

CPU_BUNDLE = {"CPU": 0.5}  # pp = 3 fits on a 2-core machine
GPU_BUNDLE = {"GPU": 1, "CPU": 2}  # the stage takes the GPU and 1 CPU; the rest is for a replica


def ensure_ray() -> None:
    """Joins the cluster at RAY_ADDRESS when set, else starts a local Ray; no-op when connected.

    Called only from driver-side entry points (LLM, AsyncEngine, the job runner), never inside
    actors.
    """
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS") or None
    ray.init(
        address=address,
        include_dashboard=False,
        logging_level=logging.WARNING,
        log_to_driver=os.environ.get("DSV4RAY_ACTOR_LOGS", "1") == "1",
    )
    log.info(
        "ray: %s (%s)",
        "joined " + address if address else "started a local instance",
        ray.cluster_resources(),
    )


def stage_bundle(use_gpu: bool, num_gpus: float = 1.0) -> dict:
    """num_gpus: the stage's GPU share (below 1, pipelines share GPUs)."""
    if not use_gpu:
        return dict(CPU_BUNDLE)
    return {**GPU_BUNDLE, "GPU": num_gpus}
