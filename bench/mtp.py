"""MTP speculative decoding on the trained checkpoint: accepted length and decode speed.

Prompts are line-aligned windows of the held-out Python standard library files (the split
``training/corpus.py`` computes from file paths alone, so it holds on any Python version;
this machine's stdlib may differ from the one the checkpoint was trained on). Two engines with
the same options, one with ``speculative_num_steps = k`` and one without, live side by side and
decode each prompt alone (batch 1, greedy, eos ignored, prefix caching off), one engine after
the other, the order alternating from prompt to prompt:

- mean tokens per verification step = (verification steps + accepted drafts) / verification
  steps, over every step that verified drafts (plain decoding makes 1 token per step);
- batch-1 decode tokens/s of each engine: (max_tokens - 1) tokens over the time of a
  max_tokens generation minus that of a 1-token generation of the same prompt (prefill and
  the first token excluded); both engines must produce the same tokens.

Writes bench/results/mtp-<device>.json (PERF.md's format) and regenerates BENCHMARKS.md.

    python bench/mtp.py [--model checkpoints/stdlib-tiny] [--k 3] [--prompts 16]
                        [--prompt-len 128] [--max-tokens 64] [--device cpu|cuda] [--use-ray]
                        [--profile FILE]
"""

from __future__ import annotations

import os
import platform
import time

import torch

from dsv4ray.bench.report import bench_parser, result, save_results
from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.entrypoints.llm import LLM
from dsv4ray.training.corpus import BOS_ID, EOS_ID, load_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def held_out_prompts(num: int, length: int, margin: int) -> list[list[int]]:
    """num prompts of bos + length tokens starting at evenly spread line starts of the held-out
    stream; windows (with margin tokens after them) that cross a file's end are skipped."""
    split = load_corpus().held_out
    starts = split.line_starts[split.line_starts <= split.tokens.numel() - length - margin]
    prompts = []
    for idx in torch.linspace(0, starts.numel() - 1, 4 * num).long().tolist():
        s = int(starts[idx])
        window = split.tokens[s : s + length + margin]
        if (window == EOS_ID).any():
            continue
        prompts.append([BOS_ID, *split.tokens[s : s + length].tolist()])
        if len(prompts) == num:
            return prompts
    raise ValueError(f"found only {len(prompts)} held-out prompts of {length} tokens")


def decode_seconds(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[float, list]:
    """(seconds of the prompt's max_tokens - 1 decode tokens, its tokens): a max_tokens
    generation's time minus that of a 1-token one (prefill and the first token)."""
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    t1 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return (time.perf_counter() - t1) - (t1 - t0), out[0].token_ids


def engine(args, k: int) -> LLM:
    return LLM(
        args.model,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=False,
        speculative_num_steps=k,
        use_ray=args.use_ray,
        device=args.device,
    )


def side_by_side(llms: dict, prompts: list, max_tokens: int) -> tuple[dict, dict, dict]:
    """Engines {k: LLM} alive together, each prompt timed on one then the other (the order
    alternating), so that a host whose speed drifts during the run weighs on all alike; one
    warm-up prompt each first. Returns ({k: decode seconds}, {k: outputs}, {k: decode steps}:
    verification steps with drafts, max_tokens - 1 per prompt without)."""
    ks = list(llms)
    for k in ks:  # warm-up (allocations, kernels)
        decode_seconds(llms[k], prompts[0], max_tokens)
    seconds, outputs, steps = dict.fromkeys(ks, 0.0), {k: [] for k in ks}, dict.fromkeys(ks, 0)
    for i, prompt in enumerate(prompts):
        for k in ks if i % 2 == 0 else ks[::-1]:
            before = llms[k].core.stats().get("num_verify_steps", 0)
            dt, tokens = decode_seconds(llms[k], prompt, max_tokens)
            verified = llms[k].core.stats().get("num_verify_steps", 0) - before
            seconds[k] += dt
            outputs[k].append(tokens)
            steps[k] += verified if k else max_tokens - 1
    return seconds, outputs, steps


def measure(args) -> tuple[dict, dict, dict]:
    """Returns ({k: decode tok/s}, {k: outputs}, the spec engine's counters over the run) of
    the engines without and with drafts, timed ``side_by_side``."""
    ks, llms = (0, args.k), {}
    try:
        for k in ks:
            llms[k] = engine(args, k)
        before = llms[args.k].core.stats()
        seconds, outputs, _ = side_by_side(llms, args.prompts_ids, args.max_tokens)
        after = llms[args.k].core.stats()
        if args.profile:
            for k in ks:
                kernel_table(llms[k], args.prompts_ids[0], args.max_tokens, k, args.profile)
    finally:
        for llm in llms.values():
            llm.shutdown()
    decoded = len(args.prompts_ids) * (args.max_tokens - 1)
    tok_s = {k: decoded / seconds[k] for k in ks}
    return tok_s, outputs, {name: after[name] - before[name] for name in after}


def kernel_table(llm: LLM, prompt: list[int], max_tokens: int, k: int, path: str) -> None:
    """Appends to `path` the GPU kernels of one generation (count, total ms, name; top 30) and
    the GPU busy time per step (steps: draft passes with drafts, tokens without)."""
    from torch.profiler import ProfilerActivity, profile

    before = llm.core.stats()["num_draft_passes"]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        torch.cuda.synchronize()
    steps = llm.core.stats()["num_draft_passes"] - before if k else max_tokens
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    count = sum(e.count for e in kernels)
    busy = sum(e.self_device_time_total for e in kernels)  # us
    lines = [f"== k={k}: {steps} steps; {count} GPU events ({count / steps:.0f} a step), busy "
             f"{busy / 1e3:.1f} ms ({busy / steps:.0f} us a step)"]  # fmt: skip
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:30]:
        lines.append(f"  {e.count:6d} {e.self_device_time_total / 1e3:8.2f} ms  {e.key[:110]}")
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> None:
    parser = bench_parser(
        __doc__,
        model=os.path.join(ROOT, "checkpoints", "stdlib-tiny"),
        kv_cache_dtype="fp32",
        device="cuda" if torch.cuda.is_available() else "cpu",
    )
    parser.add_argument("--k", type=int, default=3, help="draft tokens per step")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--use-ray", action="store_true", help="stage and draft actors")
    parser.add_argument(
        "--profile",
        default=None,
        metavar="FILE",
        help="write each engine's GPU kernel table of one generation to FILE",
    )
    args = parser.parse_args(argv)
    if args.profile and args.device != "cuda":
        parser.error("--profile times GPU kernels: it needs --device cuda")
    if args.profile:
        with open(args.profile, "w") as f:
            f.write(
                f"bench/mtp.py --profile: {os.path.basename(os.path.normpath(args.model))}, "
                f"{args.kv_cache_dtype} pages, batch 1, one {args.max_tokens}-token "
                "generation per engine; GPU kernels by total time (count, ms, name)\n"
            )
    args.prompts_ids = held_out_prompts(args.prompts, args.prompt_len, args.max_tokens)
    tok_s, outputs, stats = measure(args)
    plain_tok_s, spec_tok_s = tok_s[0], tok_s[args.k]
    plain_out, spec_out = outputs[0], outputs[args.k]
    same = sum(a == b for a, b in zip(plain_out, spec_out))
    steps, accepted = stats["num_verify_steps"], stats["num_accepted_draft_tokens"]
    mean_len = (steps + accepted) / steps
    acceptance = accepted / max(stats["num_draft_tokens"], 1)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    note = (
        f"{os.path.basename(os.path.normpath(args.model))}, k={args.k}, greedy, batch 1, "
        f"{len(args.prompts_ids)} held-out prompts of {args.prompt_len} tokens from Python "
        f"{platform.python_version()}'s stdlib, "
        f"{args.max_tokens} new tokens each, {args.kv_cache_dtype} pages, "
        f"{'Ray actors' if args.use_ray else 'in process'}; {accepted} of "
        f"{stats['num_draft_tokens']} drafts accepted ({acceptance:.1%}); "
        f"{same} of {len(spec_out)} outputs equal plain decoding's"
    )
    rows = [
        result("mean tokens per verification step", mean_len, "tokens", 1.0, 2.0, ">=", note),
        result("batch-1 decode with drafts", spec_tok_s, "tok/s", plain_tok_s, 1.5, ">=", note),
    ]
    ceilings = {
        "plain decoding": {"value": 1.0, "unit": "tokens per step", "note": "one per step"},
        "batch-1 decode without drafts": {"value": plain_tok_s, "unit": "tok/s", "note": note},
    }
    path = save_results(args, "mtp", device, ceilings, rows)
    print(f"mean tokens per verification step: {mean_len:.2f} (target >= 2.0)")
    print(
        f"draft acceptance: {acceptance:.1%}; outputs equal plain decoding: {same}/{len(spec_out)}"
    )
    print(
        f"batch-1 decode: {spec_tok_s:.1f} tok/s with drafts, {plain_tok_s:.1f} without "
        f"({spec_tok_s / plain_tok_s:.2f}x; GPU target >= 1.5x)"
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
