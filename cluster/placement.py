"""Joining or starting Ray, the resource shapes of pipeline bundles, and which accelerator a
pipeline asks for.

Bundle shapes are fixed when an app or job is built, possibly on a head node without GPUs
and before any GPU node runs: the autoscaler starts a GPU node only for a request that asks
for GPUs, so ``accelerator: auto`` looks at what the cluster declares, not only at what it
has now. The stages learn their device from the bundles they were given (``bundle_device``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

log = logging.getLogger("dsv4ray.ray")

CPU_BUNDLE = {"CPU": 0.5}  # pp = 3 fits on a 2-core machine
GPU_BUNDLE = {"GPU": 1, "CPU": 2}  # the stage takes the GPU and 1 CPU; the rest is for a replica
ACCELERATORS = ("auto", "cpu", "gpu")
DEVICES = {"cpu": "cpu", "gpu": "cuda"}  # accelerator -> the engine's device
# what `ray up` leaves on the head for its autoscaler (available_node_types with resources)
BOOTSTRAP_CONFIG = "~/ray_bootstrap_config.yaml"


def ensure_ray(num_cpus: int | None = None) -> None:
    """Joins the cluster at RAY_ADDRESS when set, else starts a local Ray; no-op when connected.
    num_cpus: logical CPUs of a local Ray (default: the machine's cores); ignored when joining.

    Called only from driver-side entry points (LLM, AsyncEngine, the job runner), never inside
    actors.
    """
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS") or None
    options = dict(
        include_dashboard=False,
        logging_level=logging.WARNING,
        log_to_driver=os.environ.get("DSV4RAY_ACTOR_LOGS", "1") == "1",
    )
    try:
        ray.init(address=address, num_cpus=None if address else num_cpus, **options)
    except ValueError as exc:  # a `ray start` on this machine, which ray.init joins by itself
        if address or num_cpus is None or "existing cluster" not in str(exc):
            raise
        ray.init(**options)
    log.info(
        "ray: %s (%s)",
        "started a local instance"
        if started_local_ray()
        else f"joined {address or 'the Ray running here'}",
        ray.cluster_resources(),
    )


def started_local_ray() -> bool:
    """Whether this process started the Ray it is connected to, rather than joined a running
    one (RAY_ADDRESS, or a ``ray start`` on this machine, which ray.init finds by itself):
    only a Ray it started may a command stop, and sweep the leftovers of."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    return ray.is_initialized() and bool(getattr(node, "head", False))


def stage_bundle(
    use_gpu: bool, extra: Mapping[str, float] | None = None, num_gpus: float = 1.0
) -> dict:
    """One stage's bundle; ``extra``: custom resources that pin stages to a node type;
    num_gpus: the stage's GPU share (below 1, pipelines share GPUs)."""
    device = {**GPU_BUNDLE, "GPU": num_gpus} if use_gpu else CPU_BUNDLE
    return {**device, **(extra or {})}


def wait_for_placement(pg, bundles: list[Mapping[str, float]], timeout_s: float,
                       what: str = "pipeline") -> None:  # fmt: skip
    """Waits until the placement group of ``bundles`` (strategy PACK) is placed, logging every
    PLACEMENT_LOG_S what it asks for and what the cluster has. Raises ValueError saying both
    at once when no set of the cluster's nodes could ever hold it and no autoscaler could add
    one, or after timeout_s."""
    import ray

    asked = _describe_bundles(bundles)
    problem = unplaceable(bundles, [n["Resources"] for n in ray.nodes() if n.get("Alive")])
    if problem and not declared_node_types():
        raise ValueError(f"the {what} cannot be placed: {asked}, but {problem}, and no "
                         "autoscaler can add nodes. Use fewer stages, or num_gpus_per_stage "
                         "below 1 so that stages share GPUs.")  # fmt: skip
    placed, waited = pg.ready(), 0.0
    while True:
        wait_s = max(min(PLACEMENT_LOG_S, timeout_s - waited), 0.0)
        ready, _ = ray.wait([placed], timeout=wait_s)
        if ready:
            return
        waited += wait_s
        free = ray.available_resources()
        have = {k: round(free.get(k, 0.0), 2) for k in sorted({k for b in bundles for k in b})}
        message = f"the {what} waits {waited:.0f} s for {asked}; the cluster has {have} free"
        if waited >= timeout_s:
            raise ValueError(f"{message}: gave up after {timeout_s:.0f} s")
        log.warning("%s%s", message, f" ({problem})" if problem else "")


PLACEMENT_LOG_S = 5.0  # how often a pipeline waiting for its placement group says so


def unplaceable(bundles: list[Mapping[str, float]], nodes: list[Mapping[str, float]]) -> str:
    """Why the nodes (their total resources) can never hold the bundles together, or ''."""
    for bundle in bundles:
        if not any(_fits(bundle, node) for node in nodes):
            return f"no node has {dict(bundle)}"
    total: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            total[key] = total.get(key, 0.0) + value
    cluster: dict[str, float] = {}
    for node in nodes:
        for key, value in node.items():
            cluster[key] = cluster.get(key, 0.0) + value
    short = {k: v for k, v in total.items() if v > cluster.get(k, 0.0) + 1e-9}
    if short:
        have = {k: cluster.get(k, 0.0) for k in short}
        return f"they need {short} in all and the cluster has {have}"
    return ""


def _fits(bundle: Mapping[str, float], node: Mapping[str, float]) -> bool:
    return all(value <= node.get(key, 0.0) + 1e-9 for key, value in bundle.items())


def _describe_bundles(bundles: list[Mapping[str, float]]) -> str:
    shapes = sorted({tuple(sorted(b.items())) for b in bundles})
    if len(shapes) == 1:
        return f"{len(bundles)} bundles of {dict(shapes[0])} (strategy PACK)"
    return f"bundles {[dict(b) for b in bundles]} (strategy PACK)"


def check_accelerator(accelerator: object) -> str:
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator must be one of {ACCELERATORS}, got {accelerator!r}")
    return accelerator


def resolve_accelerator(accelerator: str, bootstrap_config: str = BOOTSTRAP_CONFIG) -> str:
    """'cpu' or 'gpu'. auto: gpu when the cluster has GPUs or declares a node type with GPUs
    (its GPU nodes may all be scaled to zero now), else cpu; outside Ray, this machine's view."""
    if check_accelerator(accelerator) != "auto":
        return accelerator
    reason = gpu_evidence(bootstrap_config)
    resolved = "gpu" if reason else "cpu"
    log.info("accelerator auto: %s (%s)", resolved, reason or "no GPU in the cluster or its config")
    return resolved


def gpu_evidence(bootstrap_config: str = BOOTSTRAP_CONFIG) -> str | None:
    """Why the cluster counts as a GPU cluster, or None."""
    import ray

    if not ray.is_initialized():
        import torch

        return "this machine has a GPU" if torch.cuda.is_available() else None
    if ray.cluster_resources().get("GPU", 0) > 0:
        return "GPUs in the cluster"
    for name, resources in declared_node_types(bootstrap_config).items():
        if float(resources.get("GPU", 0) or 0) > 0:
            return f"node type {name!r} declares GPUs"
    return None


def declared_node_types(bootstrap_config: str = BOOTSTRAP_CONFIG) -> dict[str, dict]:
    """Node type -> resources: from the cluster config the autoscaler reported to Ray's GCS,
    else from the autoscaler config file on this node; {} when neither is there."""
    reported = _reported_node_types()
    if reported:
        return reported
    path = os.path.expanduser(bootstrap_config)
    if not os.path.isfile(path):
        return {}
    import yaml

    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    types = raw.get("available_node_types") or {}
    return {name: dict(spec.get("resources") or {}) for name, spec in types.items()}


def _reported_node_types() -> dict[str, dict]:
    import ray

    try:
        config = ray._private.state.state.get_cluster_config()
    except Exception:  # an older GCS, or no config reported: the file is the other source
        log.debug("no cluster config in the GCS", exc_info=True)
        return {}
    if config is None:
        return {}
    return {group.name: dict(group.resources) for group in config.node_group_configs}


def bundle_device(bundles: list[Mapping[str, float]]) -> str:
    """The engine's device for stages placed in ``bundles`` (the replica's placement group)."""
    return "cuda" if any(b.get("GPU", 0) > 0 for b in bundles) else "cpu"


def stop_local_ray() -> None:
    """Stops the local Ray a command started, and then removes what its dead processes left
    in /dev/shm: host-tier regions (engines killed without a shutdown keep theirs), the
    raylets' semaphores and the graphs' file lists. Safe when a signal cut ray.init short."""
    import ray

    from dsv4ray.actors.host_tier import release_host_tiers
    from dsv4ray.cluster.channel_files import sweep_dead_graphs, sweep_dead_raylets

    if ray.is_initialized():
        release_host_tiers()
    ray.shutdown()
    sweep_dead_raylets()
    sweep_dead_graphs()
