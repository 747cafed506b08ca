"""What a committed step did (the scheduler's answer to ``commit``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dsv4ray.engine.request import FinishedRequest


@dataclass(frozen=True)
class StepOutcome:
    """What a committed step did. applied: the requests whose entries of the step count
    (requests preempted, aborted or finished while the step ran are not among them: what the
    stages computed for them belongs to work the scheduler has already thrown away); tokens:
    req_id -> the (last) token appended; finished: the requests that met a stop condition;
    extra_tokens: tokens appended before the last (drafts), accepted_drafts: drafts appended."""

    applied: frozenset[str]
    tokens: dict[str, int]
    finished: list[FinishedRequest]
    extra_tokens: dict[str, list[int]] = field(default_factory=dict)
    accepted_drafts: dict[str, int] = field(default_factory=dict)
