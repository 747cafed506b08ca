"""Every configuration on the fast path, one GPU: each way to run a model next to the fast path.

    python bench/paths.py [--model /tmp/dsv4-mini] [--parts paths,context,mtp,mixed]
                          [--batches 1,16,64] [--contexts 4096,131072,524288,1048576]

Parts, each measured in the same run as the fast path it is compared with (dsv4-mini, fp8 pages,
512-token prompts unless said; made on the GPU when --model does not exist):

- paths: the median pure-decode step (bench/step_clock.py: host work, forward, sampling
  and commit of one whole step) at each batch of the fast path (one stage in this process, CUDA
  graphs and overlap scheduling), the same stage eager, a Ray stage actor (pp 1), and pp 2 with
  both stages on this one GPU, as Ray actors and in this process; beside each Ray pipeline the
  round trip of an empty plan through its compiled graph (what a step pays for the hand-over),
  beside the pp 2 actors where a step's time goes (bench/pipeline.py's timeline); and how long
  a pp 2 pipeline asking for one GPU per stage takes to be refused here.
- context: batch 1 and 8 decode steps at growing contexts, against the 4k step. The contexts
  are seeded into the prefix cache (pages and a compressor snapshot taken from the pools without
  computing them: a decode step reads the same bytes whatever they hold), so a 1M-token context
  costs no 1M-token prefill; each request then computes one token and decodes.
- mtp: batch-1 decode tok/s with k = 3 MTP drafts against the same engine without, on the trained
  checkpoints/stdlib-tiny, in process, with the draft worker as a Ray actor beside a pp 1 stage
  actor, and beside the last of two stage actors sharing the GPU (bench/mtp.py's side_by_side);
  for each Ray pair, where a step's time goes (bench/pipeline.py's timeline, stages and draft
  actor, one held-out prompt).
- mixed: decode latency of 16 running requests while prompts of 2k-8k tokens keep arriving
  (p50 / p99 of the steps that decode them) and the arriving prompts' time to first token, at
  each step budget (8192: a prompt in one chunk; 2048, the default: chunks that share four
  steps), beside the pure-decode step at batch 16.

Writes bench/results/paths-<device>.json (PERF.md's format) and regenerates BENCHMARKS.md.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from types import SimpleNamespace

import torch

from dsv4ray import LLM, SamplingParams
from dsv4ray.bench.mtp import held_out_prompts, side_by_side
from dsv4ray.bench.pipeline import timeline
from dsv4ray.bench.report import bench_parser, random_prompts, result, save_results
from dsv4ray.bench.step_clock import decode_s, engine_decode_s
from dsv4ray.cache.radix import Snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = dict(kv_cache_dtype="fp8", max_num_batched_tokens=8192, max_model_len=8192)
PATHS = {  # name -> LLM options beside COMMON
    "in process (fast path)": {},
    "in process, eager": {"cuda_graphs": False},
    "Ray stage actor, pp 1": {"use_ray": True},
    "Ray pp 2, one GPU": {"pp_size": 2, "num_gpus_per_stage": 0.5},
    "in process pp 2, one GPU": {"pp_size": 2, "use_ray": False},
}


def empty_step_ms(llm: LLM, steps: int = 100) -> float | None:
    """Median ms of an empty plan's round trip through a Ray pipeline's compiled graph."""
    from dsv4ray.engine.plan import StepPlan, encode

    pipe = llm.core.pipeline
    if getattr(pipe, "dag", None) is None:
        return None
    times = []
    for k in range(steps):
        plan = encode(StepPlan(step_id=10**7 + k))
        t0 = time.perf_counter()
        pipe.dag.execute(plan).get()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def paths_part(args) -> tuple[list, dict]:
    steps, raw = {}, {}
    for name, options in PATHS.items():
        llm = LLM(args.model, max_running_requests=max(args.batches), **COMMON, **options)
        try:
            steps[name] = {b: 1e3 * engine_decode_s(llm, b, 512, args.new, 10 * b) / args.new
                           for b in args.batches}  # fmt: skip
            raw[name] = {"step_ms": steps[name], "empty_plan_ms": empty_step_ms(llm),
                         "stages": llm.core.pipeline.stage_stats()}  # fmt: skip
            if len(getattr(llm.core.pipeline, "actors", ())) > 1:  # where a step's time goes
                shape = SimpleNamespace(prompt_len=512, decode=args.new)
                raw[name]["timeline"] = {b: timeline(llm, b, shape) for b in args.batches}
                print("\n".join(raw[name]["timeline"].values()), flush=True)
        finally:
            llm.shutdown()
        print(json.dumps({name: raw[name]["step_ms"]}), flush=True)
    fast = steps["in process (fast path)"]
    rows = []
    for name, targets in (
        ("in process, eager", {}),
        ("Ray stage actor, pp 1", {b: 0.95 for b in args.batches}),
        ("Ray pp 2, one GPU", {1: 0.75, 64: 0.9}),
        ("in process pp 2, one GPU", {}),
    ):
        hop = raw[name]["empty_plan_ms"]
        for b in args.batches:
            note = f"{steps[name][b]:.2f} ms vs {fast[b]:.2f} ms a step"
            note += f"; empty plan through the graph {hop:.3f} ms" if hop else ""
            ratio = fast[b] / steps[name][b]
            rows.append(result(f"decode throughput, {name} vs the fast path, batch {b}", ratio,
                               "x", 1.0, targets.get(b), ">=", note))  # fmt: skip
    rows.append(refusal_row(args))
    return rows, {"paths": raw}


def refusal_row(args) -> dict:
    """pp 2 with a whole GPU per stage on a one-GPU machine: refused, and how fast."""
    t0 = time.perf_counter()
    try:
        LLM(args.model, pp_size=2, **COMMON).shutdown()
        message = "started (the machine has two GPUs)"
    except ValueError as exc:
        message = str(exc)
    seconds = time.perf_counter() - t0
    return result("pp 2 asking for 2 GPUs on a one-GPU machine: seconds until refused", seconds,
                  "s", 1.0, None, "<=", message)  # fmt: skip


def seed_context(llm: LLM, token_ids: list[int]) -> None:
    """Puts token_ids (a multiple of 256 tokens) in the prefix cache with pages, a window page
    and a compressor snapshot taken from the pools as they are: a request that starts with them
    computes only what follows (what its steps read is as large as if it had been computed)."""
    kv = llm.core.scheduler.kv
    if not kv.ensure_free(len(token_ids) // 256, 1, 1):  # evicts earlier seeded contexts
        raise RuntimeError(f"the pools hold no {len(token_ids)}-token context")
    pages = kv.pages.alloc(len(token_ids) // 256)
    window, slot = kv.window_pages.alloc(1)[0], kv.cached_state_slots.alloc(1)[0]
    inserted = kv.radix.insert(token_ids, pages, Snapshot(window, slot))
    if inserted.unadopted_page_ids or not inserted.snapshot_adopted:
        raise RuntimeError("the seeded context was already cached")


def context_part(args) -> tuple[list, dict]:
    llm = LLM(args.model, kv_cache_dtype="fp8", max_running_requests=8,
              max_model_len=max(args.contexts), max_num_batched_tokens=8192)  # fmt: skip
    steps = {}
    try:
        for batch in (1, 8):
            for ctx in args.contexts:  # a page below ctx: the decode steps stay inside it
                prompts = random_prompts(batch, ctx - 256, 7 * ctx + batch)
                for prompt in prompts:
                    seed_context(llm, prompt)
                tails = [p + [5] for p in prompts]
                steps[(batch, ctx)] = 1e3 * decode_s(llm, tails, args.new) / args.new
                print(json.dumps({"batch": batch, "context": ctx,
                                  "step_ms": steps[(batch, ctx)]}), flush=True)  # fmt: skip
        stats = llm.core.pipeline.stage_stats()
    finally:
        llm.shutdown()
    rows, base = [], min(args.contexts)
    for (batch, ctx), ms in steps.items():
        if ctx != base:
            rows.append(result(f"decode step, batch {batch}, {ctx // 1024}k vs {base // 1024}k "
                               "context", ms, "ms", steps[(batch, base)], 1.25, "<="))  # fmt: skip
    raw = {f"b{b}_ctx{c}": ms for (b, c), ms in steps.items()}
    return rows, {"context": raw, "context_graph_steps": stats[0]["graph_steps"]}


MTP_PATHS = {  # the two engines of a pair live together: each takes half the GPU
    "in process": {"use_ray": False},
    "draft actor, pp 1": {"use_ray": True, "num_gpus_per_stage": 0.5},
    "draft actor, pp 2 on one GPU": {"pp_size": 2, "num_gpus_per_stage": 0.25},
}


def mtp_part(args) -> tuple[list, dict]:
    prompts = held_out_prompts(args.mtp_prompts, 128, 64)
    rows, raw = [], {}
    for name, options in MTP_PATHS.items():
        llms = {}
        try:
            for k in (0, 3):
                llms[k] = LLM(args.mtp_model, kv_cache_dtype="fp32", enable_prefix_caching=False,
                              speculative_num_steps=k, max_total_tokens=65536,
                              **options)  # fmt: skip
            seconds, outputs, _ = side_by_side(llms, prompts, 64)
            shape = SimpleNamespace(prompt_len=128, decode=64)
            steps = {k: timeline(llm, 1, shape, prompts[:1]) for k, llm in llms.items()
                     if hasattr(llm.core.pipeline, "actors")}  # fmt: skip
        finally:
            for llm in llms.values():
                llm.shutdown()
        tok_s = {k: len(prompts) * 63 / s for k, s in seconds.items()}
        same = sum(a == b for a, b in zip(outputs[0], outputs[3]))
        raw[name] = {"tok_s": tok_s, "same_outputs": same, "timeline": steps}
        print(json.dumps({name: {"tok_s": tok_s, "same_outputs": same}}), flush=True)
        print("\n".join(steps.values()), flush=True)
        note = f"stdlib-tiny, {len(prompts)} held-out prompts, {same} outputs equal plain "
        note += "decoding's"
        note += "; each Ray pipeline's timeline in the settings row" if steps else ""
        rows.append(result(f"batch-1 decode with k = 3 drafts vs without, {name}", tok_s[3],
                           "tok/s", tok_s[0], 1.5, ">=", note))  # fmt: skip
    return rows, {"mtp": raw}


def mixed_part(args) -> tuple[list, dict]:
    """Per step budget (max_num_batched_tokens): step times of 16 decoding requests while 2k-8k
    prompts arrive every 4 steps, and the arriving prompts' time to first token."""
    rows, raw = [], {}
    for budget in args.mixed_budgets:
        p50, p99, pure_ms, ttft, arrivals = _mixed_run(args, budget)
        note = (
            f"max_num_batched_tokens {budget}: 16 decoding requests, a 2k-8k prompt "
            f"arriving every 4 steps ({arrivals} in {args.mixed_steps} steps), their median "
            f"time to first token {ttft:.1f} ms; pure decode at batch 16: {pure_ms:.2f} ms"
        )
        for name, value in (("p50", p50), ("p99", p99)):
            rows.append(result(f"decode latency under arriving prompts, budget {budget}, {name}",
                               value, "ms", pure_ms, None, "<=", note))  # fmt: skip
        raw[budget] = {"p50_ms": p50, "p99_ms": p99, "pure_ms": pure_ms, "ttft_ms": ttft}
    return rows, {"mixed": raw}


def _mixed_run(args, budget: int):
    """One engine at the budget -> (p50, p99 step ms, pure batch-16 step ms, median TTFT ms of
    the arriving prompts, how many arrived)."""
    llm = LLM(args.model, max_running_requests=64, **{**COMMON, "max_num_batched_tokens": budget})
    core, g = llm.core, torch.Generator().manual_seed(3)
    try:
        pure_ms = 1e3 * engine_decode_s(llm, 16, 512, args.new, 160) / args.new
        decoding = random_prompts(16, 512, 161)
        for i, prompt in enumerate(decoding):
            core.add_request(f"run-{i}", prompt, SamplingParams(max_tokens=400, ignore_eos=True))
        while any(not core.outputs.outputs[f"run-{i}"].token_ids for i in range(16)):
            core.step()
        times, added, ttft, arrivals = [], {}, [], 0
        for step in range(args.mixed_steps):
            if step % 4 == 0:
                n = int(torch.randint(2048, 8193, (1,), generator=g))
                req_id = f"new-{arrivals}"
                core.add_request(req_id, random_prompts(1, n, 900 + arrivals)[0],
                                 SamplingParams(max_tokens=1, ignore_eos=True))  # fmt: skip
                added[req_id], arrivals = time.perf_counter(), arrivals + 1
            t0 = time.perf_counter()
            core.step()
            now = time.perf_counter()
            times.append(1e3 * (now - t0))
            for req_id in [r for r in added if core.outputs.outputs[r].token_ids]:
                ttft.append(1e3 * (now - added.pop(req_id)))
        for i in range(16):
            core.abort(f"run-{i}")
    finally:
        llm.shutdown()
    times.sort()
    p50, p99 = times[len(times) // 2], times[min(len(times) - 1, int(0.99 * len(times)))]
    return p50, p99, pure_ms, statistics.median(ttft) if ttft else float("nan"), arrivals


PARTS = {"paths": paths_part, "context": context_part, "mtp": mtp_part, "mixed": mixed_part}


def main(argv=None) -> None:
    args = parse_args(argv)
    if not os.path.exists(os.path.join(args.model, "config.json")):
        from dsv4ray.model.tiny import make_tiny

        make_tiny(args.model, "dsv4-mini", seed=0, device="cuda")
    rows, raw = [], {}
    for part in args.parts:  # the file is written after each part: a cut-off run keeps those
        more, more_raw = PARTS[part](args)
        rows, raw = rows + more, {**raw, **more_raw}
        path = write(args, rows, raw)
    print(path)


def write(args, rows: list, raw: dict):
    settings = {"name": "settings", "value": None, "unit": "", "ceiling": None, "ratio": None,
                "op": ">=", "target": None,
                "note": f"parts {args.parts}; raw: {json.dumps(raw, default=str)}"}  # fmt: skip
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    fast = "one stage in process, CUDA graphs and overlap scheduling, measured in the same run"
    ceilings = {"fast path": {"value": 1.0, "unit": "x", "note": fast}}
    name = "paths" if args.out_name is None else args.out_name
    return save_results(args, name, device, ceilings, rows + [settings])


def parse_args(argv=None):
    p = bench_parser(__doc__, model="/tmp/dsv4-mini")
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--mtp-model", default=os.path.join(ROOT, "checkpoints", "stdlib-tiny"))
    p.add_argument("--parts", type=lambda s: s.split(","), default=list(PARTS))
    p.add_argument("--batches", type=ints, default=[1, 16, 64])
    p.add_argument("--contexts", type=ints, default=[4096, 131072, 524288, 1048576])
    p.add_argument("--new", type=int, default=32, help="decode steps timed per measurement")
    p.add_argument("--mtp-prompts", type=int, default=8)
    p.add_argument("--mixed-steps", type=int, default=120)
    p.add_argument("--mixed-budgets", type=ints, default=[8192, 2048],
                   help="max_num_batched_tokens of each mixed run")  # fmt: skip
    p.add_argument("--out-name", default=None, help="results file name (default: paths)")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
