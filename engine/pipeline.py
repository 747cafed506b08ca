"""The Pipeline protocol: what EngineCore needs from a pipeline of stages.

Two transports of the same stage code (worker/stage_worker.py): ``worker.local_pipeline.
LocalPipeline`` calls the stages in this process, ``cluster.pipeline.RayPipeline`` runs them as
actors over a Ray compiled graph; both replay every stage's CUDA graphs and both overlap
scheduling with the device (plan.lag: the host commits step n and schedules step n + 1 while the
stages run step n). ``capacity`` is the pipeline's pool sizes (the minimum over its stages, each
sized by its own layer slice); ``depth`` how many plans may be in flight; ``submit`` returns a
handle that ``collect`` turns into the last stage's StageResult (through the draft worker, when
one follows the last stage), in submission order. A dead stage or draft worker surfaces as
PipelineFailure, nothing else.
"""

from __future__ import annotations

from typing import Any, Protocol

from dsv4ray.engine.plan import StageResult, StepPlan


class PipelineFailure(RuntimeError):
    """A stage of the pipeline died or stopped answering: rebuild before the next step."""


class Pipeline(Protocol):
    capacity: Any  # cache.configurator.PipelineCapacity
    depth: int
    host_lost: bool  # the last rebuild found the host tier's regions empty (a new tier)

    def submit(self, plan: StepPlan) -> Any: ...

    def collect(self, handle: Any) -> StageResult: ...

    def rebuild(self) -> None: ...

    def shutdown(self) -> None: ...

    def attach_host(self, num_pages: int, num_snapshots: int) -> None: ...

    def host_alive(self) -> bool: ...

    def drop_host(self) -> None: ...

    def placement(self) -> dict: ...

    def draft_lost(self) -> bool: ...  # after a PipelineFailure: only the draft worker died

    def stages_alive(self) -> bool: ...  # every stage (and the draft worker) answers a ping
    def stage_stats(self) -> list[dict]: ...
