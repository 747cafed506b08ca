"""Engine decode throughput on CPU against a bare single-process loop over the reference.

Both decode the same batch of equal-length prompts on the tiny preset: the baseline steps the
reference's incremental path with all rows at once ([B, 1] per step); the engine runs its full
serving path (scheduler, plan, paged pools, kernels' torch references, sampling). Decode time of
the engine = generate(max_tokens = n + 1) minus generate(max_tokens = 1) on fresh prompts, so
prefill is excluded from both sides. Writes bench/results/cpu-engine-cpu.json.

    python bench/cpu.py [--model .tiny] [--batch 32] [--prompt-len 64] [--decode 32]
"""

from __future__ import annotations

import os
import time

import torch

from dsv4ray.bench.report import bench_parser, random_prompts, result, save_results
from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.entrypoints.llm import LLM
from dsv4ray.model import load_reference


def reference_decode_tok_s(model_path: str, batch: int, length: int, steps: int) -> float:
    model = load_reference(model_path, torch.float32)
    state = model.new_state(batch)
    logits = model.step(torch.tensor(random_prompts(batch, length, 0)), state)[:, -1]
    start = time.perf_counter()
    for _ in range(steps):
        logits = model.step(logits.argmax(-1, keepdim=True), state)[:, -1]
    return batch * steps / (time.perf_counter() - start)


def engine_decode_tok_s(model_path: str, batch: int, length: int, steps: int, kv: str) -> float:
    llm = LLM(model_path, kv_cache_dtype=kv, enable_prefix_caching=False)
    try:
        llm.generate(
            random_prompts(batch, length, 1), SamplingParams(max_tokens=2, ignore_eos=True)
        )
        t0 = time.perf_counter()
        llm.generate(
            random_prompts(batch, length, 2), SamplingParams(max_tokens=1, ignore_eos=True)
        )
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        llm.generate(
            random_prompts(batch, length, 3), SamplingParams(max_tokens=steps + 1, ignore_eos=True)
        )
        total = time.perf_counter() - t0
    finally:
        llm.shutdown()
    return batch * steps / (total - prefill)


def main(argv=None) -> None:
    parser = bench_parser(__doc__, model=".tiny")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode", type=int, default=32)
    args = parser.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    ref = reference_decode_tok_s(args.model, args.batch, args.prompt_len, args.decode)
    note = f"tiny preset, batch {args.batch}, {args.prompt_len}-token prompts, {args.decode} steps"
    rows = []
    for kv in ("fp8", "fp32"):
        tok_s = engine_decode_tok_s(args.model, args.batch, args.prompt_len, args.decode, kv)
        rows.append(result(f"engine decode, {kv} pages", tok_s, "tok/s", ref, 0.7, ">=", note))
    ceilings = {"reference decode loop": {"value": ref, "unit": "tok/s", "note": note}}
    path = save_results(args, "cpu-engine", "cpu", ceilings, rows)
    for row in rows:
        print(
            f"{row['name']}: {row['value']:.1f} tok/s = {row['ratio']:.2f}x the reference loop "
            f"({ref:.1f} tok/s); target >= 0.7x"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
