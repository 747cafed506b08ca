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


class StepResults:
    """The results a pipeline's outputs bring, handed to ``collect`` by step id.

    Outputs come in the order the stages finish steps, which is not always submission order (a
    plan without a batch answers at once, before a lagged step's result), so results that come
    before their step's ``collect`` wait here. Steps are collected in submission order; a step
    whose caller was interrupted before collecting it is never collected, so any result older
    than the step being collected is dropped (the step was abandoned) rather than kept for good.
    """

    def __init__(self) -> None:
        self.early: dict[int, StageResult] = {}

    def collect(self, step_id: int, read_next) -> StageResult:
        """Step step_id's result: kept, or read_next() until it comes (read_next returns the
        next output, asking for a flush when none is pending)."""
        for abandoned in [s for s in self.early if s < step_id]:
            del self.early[abandoned]
        if step_id in self.early:
            return self.early.pop(step_id)
        while True:
            result = read_next()
            if result.step_id == step_id:
                return result
            if result.step_id > step_id:
                self.early[result.step_id] = result

    def clear(self) -> None:
        self.early.clear()
