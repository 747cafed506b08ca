"""Structured output's cost: requests without a grammar beside grammar-constrained ones.

    python bench/structured.py [--model .tiny] [--free 16] [--constrained 4] [--new 48]
                               [--name structured]

One engine (in process; CUDA when there is one), four runs of the same prompts in turn:
``--free`` requests beside ``--constrained`` others without a grammar (the same batch, the
baseline), the same beside those others constrained by a grammar (a JSON array of integers, so
that they decode as long as the free ones), the baseline again (the drift of the machine between
runs shows as the gap between the two), and the free requests alone. Each run's median
pure-decode step (bench/step_clock.py) gives the free requests' decode throughput: against the
baseline it is the grammars' cost (the target), against the free requests alone it also counts
the extra rows of the batch. The host time the last stage spends on grammars (advancing the
matchers and building the masks, timed around ``Grammars.mask``) over the constrained tokens
drawn gives the cost per constrained token. Writes bench/results/structured-<device>.json.
"""

from __future__ import annotations

import json
import os
import time

import torch

from dsv4ray import LLM, SamplingParams
from dsv4ray.bench.report import bench_parser, random_prompts, result, save_results
from dsv4ray.bench.step_clock import StepClock
from dsv4ray.worker.sampling import grammar as grammar_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARRAY = {"json": {"type": "array", "items": {"type": "integer"}}}


class GrammarClock:
    """Host seconds spent in ``Grammars.mask`` (advancing the matchers, building and uploading
    the masks) and the constrained rows it masked; the wait there for the previous step's draw
    is kept apart (``waited``): the device is busy then, and with overlap scheduling the next
    forward is already queued. Nothing here synchronises the device."""

    def __init__(self) -> None:
        self.seconds, self.waited, self.rows = 0.0, 0.0, 0
        self._mask = grammar_module.Grammars.mask
        self._catch_up = grammar_module.Grammars._catch_up
        clock = self

        def timed(grammars, logits, req_ids, drafts=None):
            t0, waited = time.perf_counter(), clock.waited
            out = clock._mask(grammars, logits, req_ids, drafts)
            if out is not logits:
                clock.seconds += time.perf_counter() - t0 - (clock.waited - waited)
                clock.rows += sum(r in grammars.matchers for r in req_ids)
            return out

        def catch_up(grammars, req_id):
            last = grammars.pending.get(req_id)
            if last is not None:  # the draw's host copy (cached: the catch-up reads it free)
                t0 = time.perf_counter()
                last[0].result()
                clock.waited += time.perf_counter() - t0
            clock._catch_up(grammars, req_id)

        grammar_module.Grammars.mask = timed
        grammar_module.Grammars._catch_up = catch_up

    def restore(self) -> None:
        grammar_module.Grammars.mask = self._mask
        grammar_module.Grammars._catch_up = self._catch_up


def free_step_ms(llm: LLM, prompts, params, num_free: int) -> float:
    """Median step of the run's pure-decode steps that held every free request."""
    clock = StepClock(llm)
    try:
        steps = clock.run(lambda: llm.generate(prompts, params))
    finally:
        llm.core.scheduler.commit = clock.commit
    full = sorted(t for b, ts in steps.items() if b >= num_free for t in ts)
    return 1e3 * full[len(full) // 2]


def main(argv=None) -> None:
    args = parse_args(argv)
    llm = LLM(args.model, kv_cache_dtype="fp8", max_running_requests=args.free + args.constrained)
    free = random_prompts(args.free, 64, 1)
    constrained = random_prompts(args.constrained, 64, 2)
    plain = SamplingParams(max_tokens=args.new, ignore_eos=True)
    tied = SamplingParams(max_tokens=args.new, ignore_eos=True, structured_output=ARRAY)
    clock = GrammarClock()
    try:
        llm.generate(free + constrained, [plain] * args.free + [tied] * args.constrained)  # warm
        clock.seconds = clock.waited = clock.rows = 0
        everyone = free + constrained
        base = free_step_ms(llm, everyone, plain, args.free)
        mixed = [plain] * args.free + [tied] * args.constrained
        beside = free_step_ms(llm, everyone, mixed, args.free)
        per_token_us = 1e6 * clock.seconds / max(clock.rows, 1)
        wait_us = 1e6 * clock.waited / max(clock.rows, 1)
        again = free_step_ms(llm, everyone, plain, args.free)
        alone = free_step_ms(llm, free, plain, args.free)
    finally:
        clock.restore()
        llm.shutdown()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    base_ms = (base + again) / 2
    note = (f"{os.path.basename(os.path.normpath(args.model))}, {args.free} free + "
            f"{args.constrained} constrained requests (a JSON array of integers), 64-token "
            f"prompts, {args.new} new tokens; the same batch without grammars {base:.2f} / "
            f"{again:.2f} ms a step (before and after: the machine's drift)")  # fmt: skip
    rows = [
        result("free requests' decode throughput beside constrained ones vs the same batch "
               "without grammars", base_ms / beside, "x", 1.0, 0.95, ">=",
               f"{beside:.2f} ms a step; {note}"),
        result("free requests' decode throughput beside constrained ones vs the free requests "
               "alone (fewer rows)", alone / beside, "x", 1.0, None, ">=",
               f"{beside:.2f} vs {alone:.2f} ms a step: the grammars and the batch's "
               f"{args.constrained} extra rows"),
        result("host time per constrained token (advance the matcher, build the mask)",
               per_token_us, "us", None, None, "<=",
               f"{clock.rows} constrained draws; vocabulary {llm.model_config.vocab_size}; "
               f"besides, {wait_us:.1f} us a constrained token waiting for the previous "
               "step's draw (device busy, not host work)"),
    ]  # fmt: skip
    ceilings = {"the same batch without grammars": {"value": base_ms, "unit": "ms", "note": note}}
    path = save_results(args, args.name, device, ceilings, rows)
    summary = {"base_ms": [base, again], "alone_ms": alone, "beside_ms": beside,
               "grammar_us_per_token": per_token_us, "wait_us_per_token": wait_us}  # fmt: skip
    print(json.dumps(summary))
    print(path)


def parse_args(argv=None):
    p = bench_parser(__doc__, model=os.path.join(ROOT, ".tiny"))
    p.add_argument("--free", type=int, default=16)
    p.add_argument("--constrained", type=int, default=4)
    p.add_argument("--new", type=int, default=48)
    p.add_argument("--name", default="structured",
                   help="results file name: <out dir>/<name>-<device>.json")  # fmt: skip
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
