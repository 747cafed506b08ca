"""The warm-up a GPU engine runs before it serves, so that no kernel compiles while serving.

Its prompts reach every kernel variant a request can: the chunk sizes that pick the indexer's
and the experts' tile shapes, a decode step, greedy and filtered sampling with logprobs. Plans
run one at a time and eagerly (the decode graphs compiled their kernels when they were
captured); then the scheduler starts afresh, so nothing of the warm-up stays cached.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from dsv4ray.engine.sampling import SamplingParams


class WarmedCore(Protocol):
    """What the warm-up drives of an ``EngineCore``; a protocol, since the core imports this
    module."""

    config: Any
    model_config: Any
    scheduler: Any
    max_model_len: int

    def add_request(self, req_id: str, prompt: list[int], params: SamplingParams) -> None: ...

    def run_plan(self, plan) -> list: ...

    def pop_output(self, req_id: str): ...

    def restart_scheduler(self) -> None: ...


log = logging.getLogger("dsv4ray.engine")


def warm_up(core: WarmedCore) -> None:
    budget = core.config.max_num_batched_tokens
    top = min(budget, core.max_model_len - 3)
    lengths = sorted({n for n in (1, 256, 768, 1280, 2048, top) if n <= top})
    vocab = core.model_config.vocab_size
    drawn = SamplingParams(max_tokens=2, temperature=1.0, top_k=50, top_p=0.9, logprobs=2,
                           seed=0, ignore_eos=True)  # fmt: skip
    greedy = SamplingParams(max_tokens=2, ignore_eos=True)
    req_ids = [f"warm-up-{i}" for i in range(len(lengths))]
    for i, (req_id, n) in enumerate(zip(req_ids, lengths)):
        prompt = [(7919 * (i * 4096 + j)) % vocab for j in range(n)]
        core.add_request(req_id, prompt, drawn if i % 2 else greedy)
    while (plan := core.scheduler.schedule()) is not None:  # ends with the finished ids
        plan.eager = True
        core.run_plan(plan)
    if core.scheduler.has_unfinished():
        raise RuntimeError("the warm-up prompts did not finish: the pools are too small")
    for req_id in req_ids:
        core.pop_output(req_id)
    core.restart_scheduler()
    log.info("warm-up: %d prompts of %s tokens", len(lengths), lengths)
