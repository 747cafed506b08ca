"""RayPipeline: one StageActor per pipeline stage, driven through a Ray compiled graph.

One placement group per pipeline (strategy PACK, one bundle per stage, passed explicitly to every
actor). The compiled graph sends each plan (msgpack bytes) to every stage and passes each stage's
StageResult (residual stack [T, hc * hidden], running top-k) to the next: shared-memory channels
on CPU, NCCL between GPUs, a device link between stages that share a GPU (the rows stay in
device memory and the channel carries a ticket). Up to pp_size plans are in flight. A dead or
stuck stage raises PipelineFailure; ``rebuild`` tears the graph down and starts fresh actors in
the same bundles. Teardown removes the graph's channel files from /dev/shm
(cluster/stage_graph.py) and lets the stage actors exit cleanly, killing only those that do not:
builds, failed builds and rebuilds leave no files behind, whichever stages died, and on GPUs a
teardown returns once the actors' processes have exited (their device memory is free again). With
speculative decoding a DraftActor shares the last stage's bundle (0.1 of its GPU, or half its CPU
share) and is the graph's last node; a rebuild replaces it with the stages.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import uuid
from collections import deque

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from dsv4ray.actors.draft import DraftActor
from dsv4ray.actors.host_tier import host_tier_for_node
from dsv4ray.actors.processes import end_processes
from dsv4ray.actors.stage import StageActor
from dsv4ray.cache.host_layout import HostLayout
from dsv4ray.cache.layer_mapping import split_layers
from dsv4ray.cluster.bind_preload import stage_runtime_envs
from dsv4ray.cluster.placement import ensure_ray, stage_bundle, wait_for_placement
from dsv4ray.cluster.stage_graph import StageGraph, describe
from dsv4ray.config import ModelConfig
from dsv4ray.engine.config import EngineConfig
from dsv4ray.engine.handoff import StageEndpoint
from dsv4ray.engine.pipeline import PipelineFailure, StepResults
from dsv4ray.engine.plan import FLUSH_STEP, StageResult, StepPlan, encode
from dsv4ray.worker.pool_sizing import (
    check_shared_host_memory,
    graph_shapes,
    pool_sizes,
    size_pipeline,
)
from dsv4ray.worker.stage_spec import DraftSpec, StageSpec

log = logging.getLogger("dsv4ray.pipeline")

EXIT_TIMEOUT_S = 10.0  # a stage actor not gone this long after being asked to exit is killed


class RayPipeline:
    def __init__(
        self,
        config: EngineConfig,
        cfg: ModelConfig,
        placement: ray.util.placement_group.PlacementGroup | None = None,
        kv_transfer: bool = False,
    ) -> None:
        """kv_transfer: every stage opens a Mooncake engine for prefill/decode handoffs and
        reports its endpoint (``kv_endpoints``, renewed by every rebuild)."""
        ensure_ray()
        self.config, self.cfg = config, cfg
        self.use_gpu = config.device == "cuda"
        self.processes: list[tuple[str, int]] = []  # (node id, pid) of GPU actors
        # results one step late: the last stage launches a step and returns the one before
        # (overlap scheduling, or micro-batches beyond one per stage)
        self.lag = config.lags_last_stage
        self.ranges = split_layers(cfg.num_hidden_layers, config.pp_size)
        # the last stage's samples go back to the first (overlap over several stages): through
        # the graph (``take``), or device memory when both share a GPU (set by each build)
        self.overlap = config.uses_overlap
        self.take = self.shared_samples = False
        self.depth = max(2 if self.lag else 1, config.micro_batches, config.pp_size)
        self.refs: deque = deque()  # the graph's outputs not read yet, in submission order
        self.results = StepResults()  # results read before their step's collect
        self.own_pg = placement is None
        bundle = stage_bundle(self.use_gpu, num_gpus=config.num_gpus_per_stage)
        bundles = [bundle] * len(self.ranges)
        self.pg = placement or placement_group(bundles, strategy="PACK")
        try:
            wait_for_placement(self.pg, bundles if self.own_pg else self.pg.bundle_specs,
                               config.startup_timeout_s, f"pipeline of {len(self.ranges)} "
                               "stages")  # fmt: skip
        except ValueError:
            if self.own_pg:
                remove_placement_group(self.pg)
            raise
        self.actors: list = []
        self.draft = None  # the DraftActor, with speculative decoding
        self.dag: StageGraph | None = None
        self.host_args: dict | None = None  # host tier regions (HiCache), once attached
        self.tiers, self.regions = [], []
        self.host_lost = False  # a rebuild found the host tier's regions empty
        self.key = uuid.uuid4().hex[:12]
        self.kv_transfer = kv_transfer
        self.kv_endpoints: tuple[StageEndpoint, ...] = ()
        try:
            # transfer engines bound to the node's address: the bind library preloaded per bundle
            self.runtime_envs = (
                stage_runtime_envs(self.pg, len(self.ranges), config.startup_timeout_s)
                if kv_transfer
                else [None] * len(self.ranges)
            )
            self._build()
        except BaseException:  # nothing it took stays taken: actors, regions, the group
            self.shutdown()
            raise

    def _build(self) -> None:
        """Starts the stage actors, sizes and allocates their pools, maps the host tier and
        compiles the graph. Every wait is bounded; a failure leaves what was started for
        ``_teardown`` (the next ``rebuild`` or ``shutdown``)."""
        ec = self.config
        self.actors = [self._actor(i, start, end) for i, (start, end) in enumerate(self.ranges)]
        self.draft = self._draft_actor() if ec.speculative_num_steps else None
        infos = self.infos = self._get([a.ready.remote() for a in self.actors])
        draft_info = [self._get(self.draft.ready.remote())] if self.draft is not None else []
        if self.use_gpu:  # their device memory is free again only once these have exited
            self.processes = [(info["node"], info["pid"]) for info in infos + draft_info]
        devices = [info["gpu"] for info in infos]
        self._link_stages(devices)  # before sizing: the rings take device memory
        available = self._get([a.available_bytes.remote(ec.memory_fraction) for a in self.actors])
        self.capacity = size_pipeline(self.cfg, ec, available, devices)
        pools = pool_sizes(self.capacity, ec.ring_scale)
        sizes = dataclasses.asdict(pools)
        if not self.use_gpu:  # stages allocate at once: each alone would see the machine free
            check_shared_host_memory(
                self._get([a.host_memory.remote(sizes) for a in self._all_actors]), pools
            )
        self._get([a.allocate.remote(sizes) for a in self._all_actors])
        graphs = graph_shapes(ec, self.cfg, self.capacity)
        if graphs is not None:  # every stage (and the draft worker) on CUDA
            k = ec.speculative_num_steps
            refs = [a.capture_graphs.remote(*graphs, k) for a in self.actors]
            refs += [self.draft.capture_graphs.remote(*graphs)] if self.draft is not None else []
            self._get(refs)
            if self.draft is not None:  # it drafts from a replayed verification's rows
                self._get(self.actors[-1].hand_off_verifications.remote())
        if self.kv_transfer:
            opened = self._get([a.open_transfer.remote(ec.pd_protocol) for a in self.actors])
            self.kv_endpoints = tuple(StageEndpoint.from_dict(e) for e in opened)
        if self.host_args is not None:
            self._attach_regions()
        # first and last stage on one GPU: sampled ids go back through device memory
        back = self.overlap and len(self.actors) > 1
        self.shared_samples = back and devices[0] is not None and devices[0] == devices[-1]
        self.take = back and not self.shared_samples
        if self.shared_samples:
            self._share_sampled_tokens()
        try:
            self.dag = StageGraph(
                self.actors,
                self.depth,
                ec.execution_timeout_s,
                warmup=encode(StepPlan(step_id=-1)),
                devices=devices,
                draft=self.draft,
                local_pids=self._local_pids(infos + draft_info),
                buffer_bytes=None if self.use_gpu else self._step_bytes(),
                take=self.take,
                poll=not self.use_gpu,
            )
        except Exception as exc:  # a stage died while the graph was compiled or warmed up
            raise PipelineFailure(describe(exc)) from exc
        log.info(
            "pipeline: %d stage actors %s, compiled graph ready",
            len(self.actors),
            [(i["start"], i["end"], i["pid"]) for i in infos],
        )

    def _share_sampled_tokens(self) -> None:
        """First and last stage on one GPU: the last writes its sampled ids straight into the
        first's table (CUDA IPC) and records an interprocess event the first one waits on, so
        the graph needs no edge back (a count both map orders the records before the waits)."""
        first, last = self.actors[0], self.actors[-1]
        event = self._get(last.map_tokens.remote(self._get(first.export_tokens.remote())))
        self._get(first.wait_for_tokens.remote(event))

    def _link_stages(self, devices: list[str | None]) -> None:
        """Neighbouring stages on one GPU, and the last stage and the draft actor beside it,
        hand their rows over through a ring in the receiver's device memory
        (worker/graphs/device_link.py); the graph's channel carries only tickets."""
        rows = self.config.max_num_batched_tokens
        for i in range(len(self.actors) - 1):
            if devices[i] is None or devices[i] != devices[i + 1]:
                continue
            self._link(self.actors[i], self.actors[i + 1], rows)
        if self.draft is not None and devices[-1] is not None:  # the draft actor shares its GPU
            # a verification's slotted rows: k + 1 a request
            slotted = self.config.max_running_requests * (self.config.speculative_num_steps + 1)
            self._link(self.actors[-1], self.draft, max(rows, slotted))

    def _link(self, sender, receiver, rows: int) -> None:
        exported = self._get(receiver.open_link.remote(self.depth + 1, rows))
        self._get(receiver.link_peer.remote(self._get(sender.map_link.remote(exported))))

    @staticmethod
    def _local_pids(infos: list[dict]) -> list[int]:
        node = ray.get_runtime_context().get_node_id()
        return [info["pid"] for info in infos if info["node"] == node]

    def _step_bytes(self) -> int:
        """A shared-memory channel's first buffer: one full step's residual stack and top-k
        (a smaller buffer grows while serving, into new /dev/shm files), 1 to 64 MiB."""
        c = self.cfg
        tokens = self.config.max_num_batched_tokens
        need = tokens * (c.hc_mult * c.hidden_size * 4 + c.index_topk * 8) + (1 << 16)
        return min(max(need, 1 << 20), 64 << 20)

    def _get(self, refs, startup: bool = True):
        """ray.get bounded by the startup timeout (a build's actor starts, weight loads and graph
        captures), or by the step timeout for calls while serving."""
        ec = self.config
        timeout_s = ec.startup_timeout_s if startup else ec.execution_timeout_s
        try:
            return ray.get(refs, timeout=timeout_s)
        except GetTimeoutError:
            what = "starting (actors, weights, pools, graph captures)" if startup else "a call"
            name = "startup_timeout_s" if startup else "execution_timeout_s"
            raise TimeoutError(
                f"the pipeline's stage actors did not finish {what} within {name}="
                f"{timeout_s:g} s; raise it for large checkpoints or slow nodes"
            ) from None

    @property
    def _all_actors(self) -> list:
        return self.actors + ([self.draft] if self.draft is not None else [])

    def _actor(self, idx: int, start: int, end: int):
        ec = self.config
        strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=idx)
        gpus = ec.num_gpus_per_stage
        resources = {"num_gpus": gpus, "num_cpus": 1} if self.use_gpu else {"num_cpus": 0.5}
        if ec.speculative_num_steps and idx == len(self.ranges) - 1:  # the draft shares it
            resources = (
                {"num_gpus": 0.9 * gpus, "num_cpus": 1} if self.use_gpu else {"num_cpus": 0.25}
            )
        env = self.runtime_envs[idx]  # None: the job's own
        return StageActor.options(
            scheduling_strategy=strategy, runtime_env=env, **resources
        ).remote(
            StageSpec.of(ec, start, end, model=ec.model_source),
            1 if not self.use_gpu else 2,
            logging.getLevelName(log.getEffectiveLevel()),
        )

    def _draft_actor(self):
        """The draft worker, in the last stage's bundle (the Serve replica's CPU of a GPU bundle
        leaves it none of its own there)."""
        ec = self.config
        strategy = PlacementGroupSchedulingStrategy(
            self.pg, placement_group_bundle_index=len(self.ranges) - 1
        )
        gpus = 0.1 * ec.num_gpus_per_stage
        resources = {"num_gpus": gpus, "num_cpus": 0} if self.use_gpu else {"num_cpus": 0.25}
        level = logging.getLevelName(log.getEffectiveLevel())
        return DraftActor.options(scheduling_strategy=strategy, **resources).remote(
            DraftSpec.of(ec, model=ec.model_source), 1, level
        )

    def stages_alive(self) -> bool:
        """Every stage actor and the draft actor answer a ping (a control call beside the
        compiled graph)."""
        actors = [*self.actors, *([self.draft] if self.draft is not None else [])]
        try:
            ray.get([a.ready.remote() for a in actors], timeout=10)
            return True
        except Exception as exc:  # a dead actor surfaces in several exception types
            log.error("a pipeline actor does not answer: %s", describe(exc))
            return False

    def draft_lost(self) -> bool:
        """After a PipelineFailure: True when the draft actor is gone and every stage answers."""
        if self.draft is None:
            return False
        try:
            ray.get(self.draft.ready.remote(), timeout=10)
            return False
        except Exception:  # a dead actor surfaces in several exception types
            pass
        try:
            ray.get([a.ready.remote() for a in self.actors], timeout=10)
        except Exception as exc:
            log.error("a stage died with the draft worker: %s", describe(exc))
            return False
        return True

    # ------------------------------------------------------------------ host tier
    def attach_host(self, num_pages: int, num_snapshots: int) -> None:
        """Maps a host-tier region per stage (on the stage's node); rebuilds map them again."""
        ring_scale = self.config.ring_scale  # as the stage pools' rings
        self.host_args = {"num_pages": num_pages, "num_snapshots": num_snapshots,
                          "ring_scale": ring_scale}  # fmt: skip
        self._attach_regions()

    def _attach_regions(self) -> None:
        """Maps each stage's region; host_lost is set when any came back newly created after
        the first attach (a new tier: the host copies the engine indexed are gone)."""
        first = not self.regions
        self.tiers, self.regions = [], []
        for i, (actor, info) in enumerate(zip(self.actors, self.infos, strict=True)):
            start, end = self.ranges[i]
            layout = HostLayout(self.cfg, start, end, self.config.kv_cache_dtype, **self.host_args)
            tier = host_tier_for_node(info["node"])
            region = self._get(tier.create_region.remote(
                f"{self.key}-s{i}", layout.nbytes, holder_pid=info["pid"],
                grace_s=self.config.startup_timeout_s + 60,  # a rebuild claims it before
            ))  # fmt: skip
            self._get(actor.attach_host.remote(self.host_args, region["path"]))
            self.tiers.append(tier)
            self.regions.append(region)
        self.host_lost = not first and any(r["created"] for r in self.regions)

    def host_alive(self) -> bool:
        try:
            ray.get([t.ping.remote() for t in self.tiers], timeout=10)
            return True
        except Exception as exc:  # a dead actor surfaces in several exception types
            log.error("host tier unreachable: %s", describe(exc))
            return False

    def placement(self) -> dict:
        """Where the stages run (the placement group that holds their bundles) and whether a
        draft worker runs beside them."""
        return {
            "stage_placement_group_id": self.pg.id.hex(),
            "draft_worker": self.draft is not None,
        }

    def stage_stats(self) -> list[dict]:
        """Each stage's counters (a control call beside the compiled graph)."""
        return self._get([actor.stats.remote() for actor in self.actors], startup=False)

    def drop_host(self) -> None:
        """The host tier is gone: stop using it and remove its files on this node."""
        for region in self.regions:
            _unlink(region["path"])
        self.host_args, self.tiers, self.regions = None, [], []

    def submit(self, plan: StepPlan) -> int:
        """Runs the plan through the graph -> its step id (``collect`` takes it). With lag the
        graph's output for a plan is the previous lagged plan's result (NO_RESULT first)."""
        plan.lag, plan.take = self.lag, self.take
        data = encode(plan)  # a plan that does not encode is a bug here, never a dead stage
        try:
            self.refs.append(self.dag.execute(data))
        except Exception as exc:  # the compiled graph reports a dead actor in many types
            raise PipelineFailure(describe(exc)) from exc
        return plan.step_id

    def _read(self, ref) -> StageResult:
        try:
            return self.dag.get(ref, self.config.execution_timeout_s)
        except Exception as exc:
            raise PipelineFailure(describe(exc)) from exc

    def collect(self, step_id: int) -> StageResult:
        """The result of a submitted step, from the outputs in order: a lagged step's comes
        with the next plan that has a batch, or with a flush when none followed; a plan without
        a batch answers at once (its result may come before the lagged one of an earlier step,
        which is then kept until collected)."""
        return self.results.collect(step_id, self._next_output)

    def _next_output(self) -> StageResult:
        if not self.refs:
            self.submit(StepPlan(step_id=FLUSH_STEP))
        return self._read(self.refs.popleft())

    def rebuild(self) -> None:
        """After a stage died: the survivors exit first (a clean exit removes every channel
        file they used; a graph whose actors are all gone tears down at once, while Ray's
        teardown can wait on a live one without end), then fresh actors start."""
        if self.dag is not None:  # before a stuck survivor is killed below
            self.dag.record_grown_channels()
        _stop_actors(self._all_actors)
        self._teardown()  # returns once the old actors' processes let go of their GPU memory
        self._build()

    def _teardown(self) -> None:
        self.refs.clear()
        self.results.clear()
        if self.dag is not None:
            self.dag.teardown()
            self.dag = None
        _stop_actors(self._all_actors)
        self.actors, self.draft = [], None
        _await_exits(self.processes)
        self.processes = []

    def shutdown(self) -> None:
        self._teardown()
        for tier, region in zip(getattr(self, "tiers", []), getattr(self, "regions", [])):
            try:
                ray.get(tier.release_region.remote(region["key"]), timeout=10)
            except Exception as exc:  # the tier died: nobody else removes its files
                log.warning("host region %s not released: %s", region["key"], describe(exc))
                _unlink(region["path"])
        self.tiers, self.regions = [], []
        if self.own_pg:
            remove_placement_group(self.pg)


def _stop_actors(actors: list) -> None:
    """Asks every actor to exit and waits for it (a clean exit frees its resources at once).
    Actors still there after EXIT_TIMEOUT_S (a stuck stage) are killed."""
    if not actors:
        return
    refs = [actor.__ray_terminate__.remote() for actor in actors]
    # an exited actor's ref is ready (with ActorDiedError), as is one of an actor already dead
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=EXIT_TIMEOUT_S)
    done = set(ready)
    for actor, ref in zip(actors, refs):
        if ref not in done:
            log.warning("stage actor did not exit in %.0f s; killing it", EXIT_TIMEOUT_S)
            ray.kill(actor, no_restart=True)


@ray.remote(num_cpus=0)
def _end_processes_task(pids: list[int], timeout_s: float) -> list[int]:
    return end_processes(pids, timeout_s)


def _await_exits(processes: list[tuple[str, int]]) -> None:
    """Returns once the stopped actors' worker processes ((node id, pid) each) are gone. Ray
    reports an actor dead before its process has let go of what it holds: a GPU stage's device
    memory stays taken for seconds while CUDA tears down, and a pipeline sizing its pools on that
    GPU meanwhile (the next engine of this process, a rebuild) would count it as used. A process
    still running EXIT_TIMEOUT_S after its actor exited is killed."""
    by_node: dict[str, list[int]] = {}
    for node, pid in processes:
        by_node.setdefault(node, []).append(pid)
    here = ray.get_runtime_context().get_node_id()
    refs = {
        node: _end_processes_task.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
        ).remote(pids, EXIT_TIMEOUT_S)
        for node, pids in by_node.items()
        if node != here
    }
    left = {here: end_processes(by_node[here], EXIT_TIMEOUT_S)} if here in by_node else {}
    for node, ref in refs.items():
        try:
            left[node] = ray.get(ref, timeout=EXIT_TIMEOUT_S + 60)
        except Exception as exc:  # the node itself is gone, and its processes with it
            log.info("stage processes on node %s not checked: %s", node[:12], describe(exc))
    for node, pids in left.items():
        if pids:
            log.warning("stage actor processes %s on node %s outlived a SIGKILL", pids, node[:12])


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
