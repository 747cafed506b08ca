"""Decode step times of an engine: StepClock (the wall time of each pure-decode step it commits)
and engine_decode_s (the median full-batch step of a timed run), shared by bench/decode.py,
bench/quantized.py, bench/paths.py and bench/structured.py.
"""

from __future__ import annotations

import time

from dsv4ray import LLM, SamplingParams
from dsv4ray.bench.report import random_prompts


class StepClock:
    """Wall time of each pure-decode step the engine commits, by batch size.

    In steady decoding the interval between two consecutive scheduler commits is one whole
    engine step (schedule, upload, forward, sampling, the host copy, commit and
    detokenisation; with overlap scheduling the host's part runs beside the next forward);
    steps whose plan holds a prefill chunk are not counted, so prefill time never leaks in.
    """

    def __init__(self, llm: LLM) -> None:
        self.scheduler, self.commit = llm.core.scheduler, llm.core.scheduler.commit
        self.last: float | None = None
        self.steps: dict[int, list[float]] = {}
        self.scheduler.commit = self._commit

    def _commit(self, plan, *args):
        now = time.perf_counter()  # the engine waited for this step's ids before committing
        if self.last is not None and plan.batch and all(e.num_tokens == 1 for e in plan.batch):
            self.steps.setdefault(len(plan.batch), []).append(now - self.last)
        self.last = now
        return self.commit(plan, *args)

    def run(self, fn) -> dict[int, list[float]]:
        self.last, self.steps = None, {}
        fn()
        return self.steps


def engine_decode_s(llm: LLM, batch: int, prompt_len: int, new: int, seed: int) -> float:
    """Seconds of `new` decode steps at `batch`: the median pure-decode step of the full batch.

    The prompts are prefilled once first (their pages stay in the prefix cache, and every shape
    the run reaches is compiled), so the timed run prefills at most a page per request and then
    decodes the whole batch together.
    """
    prompts = random_prompts(batch, prompt_len, seed)
    llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
    return decode_s(llm, prompts, new)


def decode_s(llm: LLM, prompts: list, new: int) -> float:
    """engine_decode_s's measure for prompts given whole: the median pure-decode step at the
    full batch, times new."""
    clock = StepClock(llm)
    try:
        params = SamplingParams(max_tokens=new + 1, ignore_eos=True)
        steps = clock.run(lambda: llm.generate(prompts, params))
    finally:
        llm.core.scheduler.commit = clock.commit
    full = sorted(steps.get(len(prompts), []))
    if len(full) < new // 2:
        raise RuntimeError(f"only {len(full)} decode steps ran the whole batch {len(prompts)}")
    return new * full[len(full) // 2]
