"""Pipeline benchmark: per-hop step time, compiled graph vs plain calls, pp=2 vs pp=1.

    python bench/pipeline.py [--model .tiny] [--batch 16] [--decode 16] [--commit SHA]

On CPU (tiny preset): the per-step latency of an empty plan through the compiled graph vs a
chain of plain ``.remote()`` calls (PERF.md: compiled >= 2x faster), and decode throughput of
pp=2 vs pp=1. On GPUs (one per stage, NCCL between stages; use the dsv4-mini preset): decode
throughput pp=2 vs pp=1 at the same batch (>= 0.9x) and maximum concurrent tokens (>= 1.9x),
plus a check that pp=2 gives pp=1's greedy tokens. Writes bench/results/pipeline-<device>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import ray
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import (  # noqa: E402
    git_commit,
    random_prompts,
    result,
    write_benchmarks_md,
    write_results,
)

from dsv4ray import LLM, SamplingParams  # noqa: E402
from dsv4ray.engine.plan import StepPlan, encode  # noqa: E402


def empty_step_ms(llm: LLM, steps: int = 200) -> tuple[float, float]:
    """Median ms of an empty plan: compiled graph vs plain actor calls (same actors)."""
    pipe = llm.core.pipeline
    compiled, plain = [], []
    for k in range(steps):
        plan = encode(StepPlan(step_id=10**6 + k))
        t0 = time.perf_counter()
        ray.get(pipe.dag.execute(plan))
        compiled.append(time.perf_counter() - t0)
    for k in range(steps):
        plan = encode(StepPlan(step_id=2 * 10**6 + k))
        t0 = time.perf_counter()
        ref = pipe.actors[0].first.remote(plan)
        for actor in pipe.actors[1:]:
            ref = actor.next.remote(plan, ref)
        ray.get(ref)
        plain.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(compiled), 1e3 * statistics.median(plain)


def decode_tok_s(llm: LLM, batch: int, length: int, steps: int) -> float:
    """Decode tokens/s: generate(steps + 1) minus generate(1) on fresh prompts."""
    llm.generate(random_prompts(batch, length, 1), SamplingParams(max_tokens=2, ignore_eos=True))
    t0 = time.perf_counter()
    llm.generate(random_prompts(batch, length, 2), SamplingParams(max_tokens=1, ignore_eos=True))
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate(
        random_prompts(batch, length, 3), SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    )
    return batch * steps / (time.perf_counter() - t0 - prefill)


def measure(model: str, pp: int, args) -> dict:
    llm = LLM(
        model,
        pp_size=pp,
        use_ray=True,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=False,
        max_total_tokens=args.max_total_tokens,
    )
    try:
        out = {
            "capacity": llm.core.pipeline.capacity.num_full_tokens,
            "tok_s": decode_tok_s(llm, args.batch, args.prompt_len, args.decode),
            "tokens": [
                o.token_ids
                for o in llm.generate(
                    random_prompts(4, args.prompt_len, 9),
                    SamplingParams(max_tokens=8, ignore_eos=True),
                )
            ],
        }
        out["compiled_ms"], out["plain_ms"] = empty_step_ms(llm)
    finally:
        llm.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=".tiny")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--kv-cache-dtype", default="fp8")
    parser.add_argument("--max-total-tokens", type=int, default=None)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if gpu else "cpu"
    one, two = measure(args.model, 1, args), measure(args.model, 2, args)
    note = f"{args.model}, batch {args.batch}, {args.prompt_len}-token prompts"
    rows = [
        result(
            "pp=2 decode throughput vs pp=1",
            two["tok_s"],
            "tok/s",
            one["tok_s"],
            0.9,
            ">=",
            f"{note}; same greedy tokens: {one['tokens'] == two['tokens']}",
        ),
        result(
            "pp=2 max concurrent tokens vs pp=1",
            two["capacity"],
            "tokens",
            one["capacity"],
            1.9 if gpu else 1.0,
            ">=",
            "pool capacity" + ("" if gpu else " (CPU: capped by max_total_tokens)"),
        ),
        result(
            "empty step, plain calls / compiled graph (pp=2)",
            two["plain_ms"],
            "ms",
            two["compiled_ms"],
            2.0,
            ">=",
            f"median of 200 steps; ratio = plain / compiled; compiled {two['compiled_ms']:.3f} "
            f"ms per step = {two['compiled_ms'] / 3:.3f} ms per hop (driver -> s0 -> s1 -> driver)",
        ),
    ]
    ceilings = {
        "pp=1 decode": {"value": one["tok_s"], "unit": "tok/s", "note": note},
        "pp=1 capacity": {"value": one["capacity"], "unit": "tokens", "note": ""},
    }
    kwargs = {"results_dir": args.out_dir} if args.out_dir else {}
    path = write_results("pipeline", device, args.commit or git_commit(), ceilings, rows, **kwargs)
    if not args.out_dir:
        write_benchmarks_md()
    for row in rows:
        print(
            f"{row['name']}: {row['value']:.3g} {row['unit']} (ratio {row['ratio']:.3g}, "
            f"target {row['op']} {row['target']})"
        )
    print(f"same greedy tokens pp=1 vs pp=2: {one['tokens'] == two['tokens']}; wrote {path}")


if __name__ == "__main__":
    main()
