"""Where a step's GPU time goes: kernels by name for eager decode steps and for one prefill.

    python bench/profile_step.py [--model DIR] [--batch 64] [--steps 4] [--prefill-len 8192]
                                 [--context 512] [--out DIR] [--weight-format auto|native]

Makes dsv4-mini when --model does not exist, runs the engine eagerly (no CUDA graphs, so every
launch shows), and writes two tables to --out: decode (kernels per step and GPU time by kernel
name, over `steps` pure-decode steps at `batch` requests of `context` tokens) and prefill (one
`prefill-len` prompt). Contexts past 8k are seeded into the prefix cache as bench/paths.py's
context part does (no long prefill; a step reads the same bytes). The tables say what to fuse
next; numbers that claim speed come from bench/decode.py and bench/paths.py.
"""

from __future__ import annotations

import os
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from dsv4ray import LLM, SamplingParams
from dsv4ray.bench.report import bench_parser, random_prompts


def kernel_table(prof, steps: int, title: str) -> str:
    """GPU events grouped by name: count per step, total ms per step, share."""
    count, total = defaultdict(int), defaultdict(float)
    for e in prof.events():
        if e.device_type.name == "CUDA":
            key = e.name[:90]
            count[key] += 1
            total[key] += e.device_time_total / 1e3
    all_ms = sum(total.values())
    events = sum(count.values()) / steps
    head = f"{title}: {events:.0f} GPU events, {all_ms / steps:.3f} ms of GPU time per step"
    lines = [head, f"{'per step':>9} {'ms/step':>9} {'share':>6}  kernel"]
    for key in sorted(total, key=total.get, reverse=True)[:45]:
        lines.append(f"{count[key] / steps:9.1f} {total[key] / steps:9.3f} "
                     f"{100 * total[key] / all_ms:5.1f}%  {key}")  # fmt: skip
    return "\n".join(lines)


def cached_prompts(llm: LLM, batch: int, context: int) -> list:
    """batch prompts whose pages the prefix cache holds: `context` tokens generated from when
    short; past 8k, `context` - 256 tokens seeded and one more token."""
    if context <= 8192:
        prompts = random_prompts(batch, context, 1)
        llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
        return prompts
    if context % 256:
        raise SystemExit(f"--context {context}: past 8192 it must be a multiple of 256")
    from dsv4ray.bench.paths import seed_context  # imports ray: only for long contexts

    prompts = random_prompts(batch, context - 256, 1)
    for ids in prompts:
        seed_context(llm, ids)
    return [ids + [5] for ids in prompts]


def main(argv=None) -> None:
    p = bench_parser(__doc__, results=False, model="/tmp/dsv4-mini")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prefill-len", type=int, default=8192)
    p.add_argument(
        "--context",
        type=int,
        default=512,
        help="tokens of each decoding request's context (past 8192: a multiple of 256)",
    )
    p.add_argument("--out", default=".", help="where profile-step.txt goes")
    p.add_argument("--weight-format", default="auto", help="native: FP8/FP4 weights as stored")
    args = p.parse_args(argv)
    if not os.path.exists(os.path.join(args.model, "config.json")):
        from dsv4ray.model.tiny import make_tiny

        make_tiny(args.model, "dsv4-mini", seed=0, device="cuda")
    llm = LLM(args.model, device="cuda", max_running_requests=args.batch, cuda_graphs=False,
              max_num_batched_tokens=max(8192, args.prefill_len),
              max_model_len=max(8192, args.prefill_len, args.context) + 64,
              weight_format=args.weight_format)  # fmt: skip
    prompts = cached_prompts(llm, args.batch, args.context)
    core = llm.core
    for r, ids in enumerate(prompts):
        core.add_request(f"p{r}", ids, SamplingParams(max_tokens=64, ignore_eos=True))
    for _ in range(4):  # prefill of the cached prompts' last page, first decodes
        core.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            core.step()
        torch.cuda.synchronize()
    text = kernel_table(
        prof, args.steps, f"decode, batch {args.batch}, {args.context}-token contexts, eager"
    )
    while core.has_unfinished():
        core.step()
    if args.prefill_len:
        long = random_prompts(1, args.prefill_len, 2)
        llm.generate(random_prompts(1, args.prefill_len, 3), SamplingParams(max_tokens=1))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate(long, SamplingParams(max_tokens=1))
            torch.cuda.synchronize()
        text += "\n\n" + kernel_table(prof, 1, f"prefill, {args.prefill_len} tokens")
    llm.shutdown()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile-step.txt"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
