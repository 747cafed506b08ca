"""Pipeline benchmark: pp=N against pp=1 (decode throughput, capacity); compiled graph vs calls.

    python bench/pipeline.py [--model DIR] [--pp 2,4] [--batches 1,16,64] [--max-batch 256]
                             [--weights bf16,native] [--decode 32] [--micro-batches 0,4]
                             [--commit SHA] [--out-dir DIR]

On CPU (tiny preset): the per-step latency of an empty plan through the compiled graph vs a
chain of plain ``.remote()`` calls (PERF.md: compiled >= 2x faster), and decode throughput of
pp=2 vs pp=1. On N GPUs (one per stage, NCCL between stages): a dsv4-mini checkpoint with
--layers layers (each stage holds 1/N of them; made on the GPU when --model does not exist, bf16
and natively quantized, FP8 linears + FP4 experts), for every pp in --pp and each weight format:
decode throughput at each batch of --batches (>= 0.9x pp=1) and at --max-batch (running-request
limit of both; >= 1.8x pp=1), the pools' maximum concurrent tokens (>= 1.9x at pp 2, 3.6x at 4),
pp=N's greedy tokens and logprobs against pp=1's (each prompt alone), and the compiled graph's
empty-plan round trip. Each count of --micro-batches is measured at every pp > 1 (0: the
engine's default, one per stage).
Writes bench/results/pipeline-<device>.json.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import ray
import torch

from dsv4ray import LLM, SamplingParams
from dsv4ray.bench.report import (
    RESULTS_DIR,
    bench_parser,
    device_slug,
    random_prompts,
    result,
    save_results,
)
from dsv4ray.engine.plan import StepPlan, encode

CAPACITY_TARGETS = {2: 1.9, 4: 3.6}  # pp -> max concurrent tokens vs pp=1


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
            ref = actor.next.remote(actor.prepare.remote(plan), ref)
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


def timeline(llm: LLM, batch: int, args, prompts: list | None = None) -> str:
    """Where a Ray pipeline's decode step goes: every stage actor (and the draft actor) records
    when each graph method was entered (its inputs read: after an NCCL receive, the sender's
    kernels finished) and left; medians over the steady decode steps of one run at ``batch``
    (``prompts``: the run's prompts, else random ones of args.prompt_len tokens)."""
    pipe = llm.core.pipeline
    stages, draft = list(pipe.actors), pipe.draft
    actors = stages + ([draft] if draft is not None else [])
    prompts = prompts or random_prompts(batch, args.prompt_len, 21)
    llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
    ray.get([a.timeline.remote(True) for a in actors])
    llm.generate(prompts, SamplingParams(max_tokens=args.decode + 1, ignore_eos=True))
    records = ray.get([a.timeline.remote(False) for a in actors])
    steps: dict[int, dict] = {}
    for actor, rows in enumerate(records):
        for method, step_id, entered, left in rows:
            steps.setdefault(step_id, {})[(actor, method)] = (entered, left)
    last = len(stages) - 1
    chain = [(0, "first")] + [(i, "next") for i in range(1, last + 1)]
    chain += [(last + 1, "next"), (last, "settle")] if draft is not None else []
    name = lambda key: f"stage {key[0]}" if key[0] <= last else "draft actor"  # noqa: E731
    full = sorted(k for k, v in steps.items() if k >= 0 and all(c in v for c in chain))
    full = full[len(full) // 4 : -2] or full  # steady state: no prefill, no final steps
    med = lambda xs: 1e3 * statistics.median(xs) if xs else float("nan")  # noqa: E731
    lines = [f"batch {batch}, pp {len(stages)}{', draft actor' if draft is not None else ''}: "
             f"medians over {len(full)} steps (ms)"]  # fmt: skip
    period = med([steps[b][chain[0]][0] - steps[a][chain[0]][0] for a, b in zip(full, full[1:])])
    lines.append(f"  step period (stage 0 entries)              {period:8.3f}")
    for i, key in enumerate(chain):
        if i:
            wait = med([steps[k][key][0] - steps[k][chain[i - 1]][1] for k in full])
            hop = f"{name(chain[i - 1])} left -> {name(key)} entered (hop+GPU)"
            lines.append(f"  {hop} {wait:8.3f}")
        host = med([steps[k][key][1] - steps[k][key][0] for k in full])
        lines.append(f"  {name(key)} {key[1]:5s} in the method (host)       {host:8.3f}")
    for i in range(1, last + 1):  # a later stage readies its step before it receives
        readied = [steps[k][(i, "prepare")] for k in full if (i, "prepare") in steps[k]]
        host = med([left - entered for entered, left in readied])
        lines.append(f"  stage {i} prepare (host, before the receive) {host:8.3f}")
    asked = [steps[k][(last + 1, "proposals")] for k in full if (last + 1, "proposals") in steps[k]]
    if asked:  # the held proposals of the steps before, read back before stage 0 enters
        host = med([left - entered for entered, left in asked])
        lines.append(f"  draft actor proposals (host, read back)  {host:8.3f}")
    taken = [k for k in full if (0, "take") in steps[k]]
    pairs = [(a, b) for a, b in zip(full, full[1:]) if b == a + 1]
    if taken:
        back = med([steps[k][(0, "take")][0] - steps[k][chain[-1]][1] for k in taken])
        took = med([steps[k][(0, "take")][1] - steps[k][(0, "take")][0] for k in taken])
        idle = med([steps[b][chain[0]][0] - steps[a][(0, "take")][1]
                    for a, b in zip(taken, taken[1:]) if b == a + 1])  # fmt: skip
        lines.append(f"  {name(chain[-1])} left -> stage 0 take entered    {back:8.3f}")
        lines.append(f"  stage 0 take  in the method (host)       {took:8.3f}")
        lines.append(f"  take left -> next step entered (driver)  {idle:8.3f}")
    else:  # the output goes to the driver, which commits and submits the next step
        idle = med([steps[b][chain[0]][0] - steps[a][chain[-1]][1] for a, b in pairs])
        lines.append(f"  {name(chain[-1])} left -> next step entered (driver) {idle:8.3f}")
    return "\n".join(lines)


def decode_rows(llm: LLM, batches: list[int], args) -> dict[int, float]:
    return {b: decode_tok_s(llm, b, args.prompt_len, args.decode) for b in batches}


def alone_outputs(llm: LLM, prompt_len: int) -> list[tuple[list[int], list[dict]]]:
    """Greedy tokens and top-2 logprobs of 4 prompts, each generated alone. A step's rows are
    computed by GEMMs whose reduction order depends on how many rows the step has, and pp > 1
    splits a batch into micro-batches, so only one request at a time gives pp=1 and pp=N the same
    shapes: there the split into stages must be exact to the bit."""
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2)
    outs = [llm.generate([p], params)[0] for p in random_prompts(4, prompt_len, 9)]
    return [(o.token_ids, o.logprobs) for o in outs]


def measure(model: str, pp: int, args, micro: int = 0) -> dict:
    options = {"pp_micro_batches": micro} if micro else {}
    llm = LLM(
        model,
        pp_size=pp,
        use_ray=True,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=False,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.max_batch,
        **options,
    )
    try:
        gpus = {info["gpu"] for info in llm.core.pipeline.infos} - {None}
        out = {
            "capacity": llm.core.pipeline.capacity.num_full_tokens,
            "gpus": len(gpus),
            "tok_s": decode_rows(llm, sorted({*args.batches, args.max_batch}), args),
            "tokens": alone_outputs(llm, args.prompt_len),
        }
        out["compiled_ms"], out["plain_ms"] = empty_step_ms(llm)
        if pp > 1 and args.timeline:
            out["timeline"] = "\n".join(timeline(llm, b, args) for b in args.timeline)
            print(out["timeline"])
    finally:
        llm.shutdown()
    gpus = out["gpus"] or "no"
    print(f"{model} pp={pp}, {micro_label(micro)}: {gpus} GPUs, capacity {out['capacity']}, "
          f"tok/s {out['tok_s']}")  # fmt: skip
    return out


def checkpoints(args, gpu: bool) -> dict[str, str]:
    """weight format -> checkpoint dir, made when missing (dsv4-mini with --layers layers on a
    GPU: every stage of pp 2 and 4 holds one C4 and one C128 layer per two layers)."""
    from dsv4ray.model.tiny import make_tiny

    out = {}
    for weights in args.weights:
        path = args.model if weights == "bf16" else f"{args.model}-native"
        if not os.path.isfile(os.path.join(path, "config.json")):
            if not gpu:
                make_tiny(path, "tiny", seed=0)
            else:
                quantize = None if weights == "bf16" else "fp8+fp4-experts"
                ratios = [4, 128] * (args.layers // 2) + [0]
                make_tiny(path, "dsv4-mini", seed=0, device="cuda", quantize=quantize,
                          num_hidden_layers=args.layers, compress_ratios=ratios)  # fmt: skip
        out[weights] = path
    return out


def micro_label(micro: int) -> str:
    return f"{micro} micro-batches" if micro else "micro-batches: default"


def rows_for(weights: str, pp: int, one: dict, many: dict, args, gpu: bool,
             micro: int = 0) -> list[dict]:  # fmt: skip
    note = f"{weights} weights, {args.prompt_len}-token prompts, {micro_label(micro)}"
    weights = weights if not micro else f"{weights}, {micro} micro-batches"
    same = one["tokens"] == many["tokens"]
    out = [
        result(
            f"pp={pp} decode throughput vs pp=1, batch {b} ({weights})",
            many["tok_s"][b], "tok/s", one["tok_s"][b], 0.9, ">=",
            f"{note}; {many['gpus'] or 'no'} GPUs; same tokens and logprobs as pp=1: {same}",
        )
        for b in args.batches if b != args.max_batch
    ]  # fmt: skip
    top = args.max_batch
    out.append(result(
        f"pp={pp} decode throughput vs pp=1, largest batch {top} ({weights})",
        many["tok_s"][top], "tok/s", one["tok_s"][top], 1.8 if gpu else 0.9, ">=",
        f"{note}; max_running_requests {top} for both; same tokens and logprobs as pp=1: {same}",
    ))  # fmt: skip
    target = CAPACITY_TARGETS.get(pp, 0.9 * pp) if gpu else 1.0
    out.append(result(
        f"pp={pp} max concurrent tokens vs pp=1 ({weights})",
        many["capacity"], "tokens", one["capacity"], target,
        ">=", "pool capacity" + ("" if gpu else " (CPU: capped by max_total_tokens)"),
    ))  # fmt: skip
    out.append(result(
        f"empty step, plain calls / compiled graph (pp={pp}, {weights})",
        many["plain_ms"], "ms", many["compiled_ms"], 2.0, ">=",
        f"median of 200 steps; ratio = plain / compiled; compiled {many['compiled_ms']:.3f} ms "
        f"per step = {many['compiled_ms'] / (pp + 1):.3f} ms per hop",
    ))  # fmt: skip
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> None:
    parser = bench_parser(
        __doc__,
        model=None,
        model_help="checkpoint directory (default: /tmp/dsv4-mini-pp on GPUs, .tiny on CPU)",
        kv_cache_dtype="fp8",
    )
    parser.add_argument("--pp", type=_ints, default=None)
    parser.add_argument("--batches", type=_ints, default=None)
    parser.add_argument("--max-batch", type=int, default=None)
    parser.add_argument("--weights", type=lambda t: t.split(","), default=None)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode", type=int, default=None)
    parser.add_argument("--micro-batches", type=_ints, default=[0])
    parser.add_argument("--max-total-tokens", type=int, default=None)
    parser.add_argument(
        "--timeline",
        type=_ints,
        default=[],
        help="batches at which pp > 1 pipelines record where a step's time goes",
    )
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if gpu else "cpu"
    count = torch.cuda.device_count() if gpu else 2
    args.model = args.model or ("/tmp/dsv4-mini-pp" if gpu else ".tiny")
    args.pp = args.pp or [n for n in (2, 4) if n <= count]
    args.batches = args.batches or ([1, 16, 64] if gpu else [16])
    args.max_batch = args.max_batch or (256 if gpu else 16)
    args.weights = args.weights or (["bf16", "native"] if gpu else ["bf16"])
    args.decode = args.decode or (32 if gpu else 16)
    rows, ceilings, profiles = [], {}, []
    for weights, model in checkpoints(args, gpu).items():
        one = measure(model, 1, args)
        for b, tok_s in one["tok_s"].items():
            note = f"{model}, {args.prompt_len}-token prompts"
            ceilings[f"pp=1 decode, batch {b} ({weights})"] = {
                "value": tok_s, "unit": "tok/s", "note": note}  # fmt: skip
        ceilings[f"pp=1 capacity ({weights})"] = {
            "value": one["capacity"],
            "unit": "tokens",
            "note": "",
        }
        for pp in args.pp:
            for micro in args.micro_batches:
                many = measure(model, pp, args, micro)
                rows += rows_for(weights, pp, one, many, args, gpu, micro)
                label = f"{weights} weights, {micro_label(micro)}"
                profiles.append(f"{label}\n{many.get('timeline', '')}")
    path = save_results(args, "pipeline", device, ceilings, rows)
    if args.timeline:
        out_dir = Path(args.out_dir) if args.out_dir else RESULTS_DIR / "profiles"
        text = f"bench/pipeline.py --timeline on {device}\n\n" + "\n\n".join(profiles)
        (out_dir / f"pipeline-timeline-{device_slug(device)}.txt").write_text(text + "\n")
    for row in rows:
        print(
            f"{row['name']}: {row['value']:.4g} {row['unit']} (ratio {row['ratio']:.3g}, "
            f"target {row['op']} {row['target']}; {row['note']})"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
