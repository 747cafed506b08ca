"""Prefill/decode disaggregation on Ray: a prefill engine actor beside a decode engine.

``build_pd_core(config)`` (what LLM, AsyncEngine and the Serve replica get for
``prefill_pp_size=P, pp_size=D``) starts a ``PrefillActor``, which owns a prefill pipeline of P
stage actors in its own placement group, and returns a ``DecodeCore`` over a decode pipeline of D
stage actors (in the caller's placement group, or its own). Both pipelines open a Mooncake engine
per stage (worker/pd/transfer.py); the decode core reaches the prefill actor through a Ray actor
handle (``RayPrefillClient``), never over HTTP. The prefill actor's stage actors are its own:
they end with it, so a killed prefill actor writes nothing more (after a short grace).

``PrefillService`` is the plain class the actor wraps: a PrefillCore stepped on one thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading

import ray

from dsv4ray.cluster.pipeline import RayPipeline
from dsv4ray.cluster.stage_graph import describe
from dsv4ray.config import ModelConfig
from dsv4ray.engine.checks import check_paged_shapes
from dsv4ray.engine.config import EngineConfig
from dsv4ray.engine.handoff import PrefillRequest, PrefillResult, to_dict
from dsv4ray.engine.pd.core import DecodeCore, PrefillCore
from dsv4ray.sources import fetch_model

log = logging.getLogger("dsv4ray.pd")

READY_TIMEOUT_S = 600.0
PING_TIMEOUT_S = 10.0


def prefill_config(config: EngineConfig) -> EngineConfig:
    """The prefill engine's config: the decode engine's, with prefill_pp_size stages, no
    micro-batch count (micro-batches split decodes, which stay on the decode side) and no
    drafts: the decode side's draft layer starts cold on a handed-off prompt, so the prefill
    engine only keeps the rings the decode side's drafts need."""
    return dataclasses.replace(
        config,
        pp_size=config.prefill_pp_size,
        prefill_pp_size=0,
        pp_micro_batches=None,
        speculative_num_steps=0,
        draft_rings=config.ring_scale > 1,
    )


class PrefillService:
    """A prefill engine: PrefillCore over its own Ray pipeline, stepped on one thread;
    ``submit`` returns a future of the PrefillResult."""

    def __init__(self, config: EngineConfig) -> None:
        if config.model_source:  # this machine's copy
            config = dataclasses.replace(config, model=fetch_model(config.model_source))
        model_config = check_paged_shapes(ModelConfig.from_hf(config.model))
        pipeline = RayPipeline(config, model_config, kv_transfer=True)
        self.core = PrefillCore(config, model_config, pipeline)
        self._inbox: queue.Queue = queue.Queue()
        self._futures: dict[str, concurrent.futures.Future] = {}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dsv4ray-prefill", daemon=True)
        self._thread.start()

    def submit(self, request: PrefillRequest) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put((request, future))
        return future

    def describe(self) -> dict:
        return {"prefill_pp_size": self.core.config.pp_size, **self.core.describe()}

    def _loop(self) -> None:
        while not self._stopped.is_set():
            self._take(block=not self.core.has_unfinished())
            if not self.core.has_unfinished():
                continue
            try:
                updates = self.core.step()
            except Exception:  # keep serving: the decode engines prefill these themselves
                log.exception("prefill step failed")
                updates = self.core.abort_all("the prefill engine failed while it ran")
            for result in self.core.collect(updates):
                self._futures.pop(result.key).set_result(result)

    def _take(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            request, future = item
            try:
                self.core.add_prefill(request)
                self._futures[request.key] = future
            except ValueError as exc:
                future.set_result(PrefillResult(request.key, error=f"prefill refused: {exc}"))
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                item = None

    def shutdown(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=30)
        self.core.shutdown()


@ray.remote(num_cpus=0)
class PrefillActor:
    """The thin actor shell over PrefillService: an asyncio actor, so that prefills wait
    concurrently; the service starts on a thread (its pipeline build blocks) at the first call."""

    def __init__(self, config: EngineConfig, log_level: str = "INFO") -> None:
        logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
        self.config = config
        self._service: asyncio.Task | None = None

    async def _started(self) -> PrefillService:
        if self._service is None:
            self._service = asyncio.create_task(asyncio.to_thread(PrefillService, self.config))
        return await self._service

    async def ready(self) -> dict:
        return (await self._started()).describe()

    async def ping(self) -> bool:
        return True

    async def prefill(self, request: dict) -> dict:
        future = (await self._started()).submit(PrefillRequest.from_dict(request))
        return to_dict(await asyncio.wrap_future(future))

    async def stats(self) -> dict:
        return (await self._started()).core.stats()

    async def shutdown(self) -> None:
        if self._service is not None:
            await asyncio.to_thread((await self._service).shutdown)


class RayPrefillClient:
    """A decode engine's handle on a PrefillActor (engine.pd.core.PrefillClient)."""

    def __init__(self, actor, config: EngineConfig | None = None) -> None:
        self.actor = actor
        self.alive = True
        self.info: dict = {}
        self.config = config  # what a restart starts again
        self._starting = None  # a restarted actor's ready() while it comes up
        self.closed = False  # shut down: never restarted

    def submit(self, request: PrefillRequest):
        return self.actor.prefill.remote(to_dict(request))

    def wait(self, handles: list, timeout: float) -> list:
        ready, _ = ray.wait(handles, num_returns=1, timeout=timeout)
        if ready:  # and every other that is done by now
            ready, _ = ray.wait(handles, num_returns=len(handles), timeout=0)
        return ready

    def result(self, handle) -> PrefillResult:
        try:
            return PrefillResult.from_dict(ray.get(handle, timeout=0))
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            return PrefillResult("", error=f"prefill engine lost: {describe(exc)}", lost=True)
        except Exception as exc:  # a bug on the prefill side: this handoff fails alone
            return PrefillResult("", error=f"prefill failed: {describe(exc)}")

    def placement(self) -> dict:
        keys = ("prefill_pp_size", "stage_placement_group_id", "draft_worker")
        return {k if k.startswith("prefill") else f"prefill_{k}": self.info.get(k) for k in keys}

    def answers(self) -> bool:
        try:
            ray.get(self.actor.ping.remote(), timeout=PING_TIMEOUT_S)
            return True
        except Exception as exc:  # a dead or stuck actor surfaces in several types
            log.warning("prefill engine does not answer: %s", describe(exc))
            return False

    def restart(self) -> bool:
        """Starts a new prefill actor (killing the old one), or polls the one starting; True
        once it is up (then ``alive``). A start that fails is tried again at the next call."""
        if self.closed:
            return False
        if self._starting is None:
            ray.kill(self.actor, no_restart=True)
            self._drop_placement()
            self.actor = start_prefill(self.config).actor
            self._starting = self.actor.ready.remote()
            log.info("prefill engine: starting a new one")
            return False
        done, _ = ray.wait([self._starting], timeout=0)
        if not done:
            return False
        self._starting, ref = None, self._starting
        try:
            self.info = ray.get(ref)
        except Exception as exc:  # it died while starting: the next call starts another
            log.error("prefill engine failed to start: %s", describe(exc))
            return False
        self.alive = True
        return True

    def shutdown(self) -> None:
        self.closed = True
        try:
            ray.get(self.actor.shutdown.remote(), timeout=60)
        except Exception as exc:  # already gone: its stages went with it, not their bundles
            log.debug("prefill actor shutdown: %s", describe(exc))
            self._drop_placement()
        ray.kill(self.actor, no_restart=True)

    def _drop_placement(self) -> None:
        """Removes a dead engine's stage placement group: it outlives the actor that made it
        (a placement group lives as long as its job), and its bundles hold the CPUs or GPUs a
        new engine needs."""
        pg_id = self.info.pop("stage_placement_group_id", None)
        if not pg_id:
            return
        from ray._raylet import PlacementGroupID
        from ray.util.placement_group import PlacementGroup, remove_placement_group

        try:
            remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id))))
        except Exception as exc:  # already removed
            log.debug("prefill placement group %s: %s", pg_id, describe(exc))


def start_prefill(config: EngineConfig) -> RayPrefillClient:
    """Starts a prefill engine actor for a decode engine's config (returns before it is up)."""
    level = logging.getLevelName(log.getEffectiveLevel())
    actor = PrefillActor.options(scheduling_strategy="DEFAULT").remote(
        prefill_config(config), level
    )
    return RayPrefillClient(actor, config)


def build_pd_core(config: EngineConfig, model_config: ModelConfig, placement=None) -> DecodeCore:
    """The decode engine of a prefill/decode pair, its prefill engine started beside it (one
    after the other when they share GPUs, so that each sizes its pools from what is free)."""
    client = start_prefill(config)
    sharing = config.device == "cuda" and config.num_gpus_per_stage < 1
    if sharing:
        client.info = ray.get(client.actor.ready.remote(), timeout=READY_TIMEOUT_S)
    pipeline = None
    try:
        pipeline = RayPipeline(config, model_config, placement, kv_transfer=True)
        if not sharing:
            client.info = ray.get(client.actor.ready.remote(), timeout=READY_TIMEOUT_S)
        core = DecodeCore(config, model_config, pipeline, client)
    except BaseException:
        if pipeline is not None:
            pipeline.shutdown()
        ray.kill(client.actor, no_restart=True)
        raise
    log.info(
        "prefill/decode: prefill pp %d -> decode pp %d over Mooncake %s",
        config.prefill_pp_size,
        config.pp_size,
        config.pd_protocol,
    )
    return core
