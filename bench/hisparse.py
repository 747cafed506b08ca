"""HiSparse benchmark: decode with C4 history in host memory against all on the device, and how
many 64k-token requests fit on one GPU each way (PERF.md).

    python bench/hisparse.py [--model DIR] [--batch 16] [--context 16384] [--new-tokens 32]
                             [--kv-cache-dtype fp8] [--eager] [--commit SHA] [--out-dir DIR]

On a GPU: makes the dsv4-mini checkpoint when --model does not exist, then in one run
  1. requests that fit: with the free memory the stage measures after loading the weights (the
     engine's own `available_bytes`), the largest number of concurrent 64k-token requests whose
     pages, rings (and hot rows) the sizing of cache/configurator.py admits, with and without
     HiSparse (and the host memory HiSparse then needs);
  2. decode tokens/s at the same batch and context: the all-on-device engine, then the HiSparse
     engine (the median pure-decode step of the full batch after the prompts were prefilled once
     and cached), with the hot rows' hit rate and misses per step;
  3. device C4 bytes per request at that context, HiSparse (stats) against all on device.
On CPU it runs the same at tiny shapes (the `tiny` preset in a temporary folder, batch 4, a
1k context) as a smoke test. Writes bench/results/hisparse-<device>.json.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import torch

from dsv4ray import LLM, SamplingParams
from dsv4ray.bench.report import bench_parser, random_prompts, result, save_results
from dsv4ray.cache.configurator import size_stage
from dsv4ray.cache.formats import KINDS
from dsv4ray.cache.hisparse_sizing import resolve_hot_rows
from dsv4ray.cache.page_layout import layout_for
from dsv4ray.config import ModelConfig
from dsv4ray.worker.stage_spec import StageSpec
from dsv4ray.worker.stage_worker import StageWorker

LONG = 65536  # tokens of one long request
MEMORY_FRACTION = 0.85  # the engine's default


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def fits(cfg: ModelConfig, available: float, num_requests: int, kv: str, hot_rows: int) -> bool:
    """Whether the sizing admits num_requests running requests of LONG tokens each."""
    entry = {k: layout_for(k, kv).bytes_per_entry for k in KINDS}
    skip = [s.skip_topk for s in cfg.layers]
    try:
        cap = size_stage(0, 0, cfg.num_hidden_layers, cfg.layer_ratios, skip, entry,
                         available_bytes=available, max_running_requests=num_requests,
                         hisparse_hot_rows=hot_rows)  # fmt: skip
    except ValueError:  # not one page fits beside the fixed reservations
        return False
    return cap.num_pages >= num_requests * (LONG // 256)


def max_requests(cfg: ModelConfig, available: float, kv: str, hot_rows: int) -> int:
    lo, hi = 0, 1
    while fits(cfg, available, hi, kv, hot_rows):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(cfg, available, mid, kv, hot_rows) else (lo, mid)
    return lo


def available_bytes(model: str, cfg: ModelConfig, kv: str, device: str, cpu_budget: float):
    """Device bytes for pools after the weights, as the engine measures them (CPU: a budget)."""
    if device != "cuda":
        return cpu_budget
    worker = StageWorker(StageSpec(model, 0, cfg.num_hidden_layers, kv, None, device), cfg)
    free = worker.available_bytes(MEMORY_FRACTION)
    del worker
    torch.cuda.empty_cache()
    return free


def capacity_rows(args, cfg, available, gpu: bool) -> tuple[list, dict]:
    hot_rows = resolve_hot_rows(cfg.index_topk, None)
    without = max_requests(cfg, available, args.kv_cache_dtype, 0)
    with_hot = max_requests(cfg, available, args.kv_cache_dtype, hot_rows)
    c4_layers = sum(1 for r in cfg.layer_ratios if r == 4)
    host = with_hot * LONG / 4 * layout_for("c4", args.kv_cache_dtype).bytes_per_entry * c4_layers
    raw = {"available_gib": available / 2**30, "requests_64k_device": without,
           "requests_64k_hisparse": with_hot, "hisparse_host_gib": host / 2**30}  # fmt: skip
    print(json.dumps(raw), flush=True)
    pools = (f"{available / 2**30:.1f} GiB for pools after weights (x {MEMORY_FRACTION})" if gpu
             else f"a {available / 2**30:.1f} GiB pool budget (CPU smoke)")  # fmt: skip
    note = f"{pools}; HiSparse keeps {host / 2**30:.1f} GiB of C4 history in host memory"
    name = "concurrent 64k-token requests on one device, HiSparse vs all on device"
    return [result(name, with_hot, "requests", without, None, ">=", note)], raw


class StepClock:
    """Wall time of each committed pure-decode step at the full batch (host work included)."""

    def __init__(self, llm: LLM, batch: int) -> None:
        self.scheduler, self.batch = llm.core.scheduler, batch
        self.commit, self.last, self.steps = self.scheduler.commit, None, []
        self.scheduler.commit = self._commit

    def _commit(self, plan, *args):
        _sync()
        now = time.perf_counter()
        full = len(plan.batch) == self.batch and all(e.num_tokens == 1 for e in plan.batch)
        if self.last is not None and full:
            self.steps.append(now - self.last)
        self.last = now
        return self.commit(plan, *args)

    def close(self) -> None:
        self.scheduler.commit = self.commit


def decode_tok_s(llm: LLM, args) -> tuple[float, dict]:
    """Decode tokens/s of the full batch at the context (prompts prefilled and cached first)."""
    prompts = random_prompts(args.batch, args.context - args.new_tokens - 1, seed=17)
    llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
    before = llm.core.stats()
    clock = StepClock(llm, args.batch)
    try:
        llm.generate(prompts, SamplingParams(max_tokens=args.new_tokens + 1, ignore_eos=True))
    finally:
        clock.close()
    steps = sorted(clock.steps)
    if len(steps) < args.new_tokens // 2:
        raise RuntimeError(f"only {len(steps)} steps ran the whole batch of {args.batch}")
    after = llm.core.stats()
    delta = {k: after[k] - before[k] for k in ("hisparse_hits", "hisparse_misses") if k in after}
    delta["num_steps"] = len(steps)
    return args.batch / steps[len(steps) // 2], {**delta, **_bytes(after)}


def _bytes(stats: dict) -> dict:
    keys = ("hisparse_device_c4_bytes_per_request", "hisparse_all_on_device_c4_bytes_per_token",
            "hisparse_host_bytes")  # fmt: skip
    return {k: stats[k] for k in keys if k in stats}


def engine(args, hisparse: bool) -> LLM:
    tokens = args.batch * (-(-(args.context + 256) // 256) * 256)  # the batch, a page spare
    extra = {"enable_hisparse": True, "hisparse_host_tokens": tokens} if hisparse else {
        "max_total_tokens": tokens}  # fmt: skip
    return LLM(args.model, kv_cache_dtype=args.kv_cache_dtype, max_running_requests=args.batch,
               max_num_batched_tokens=args.prefill_budget, max_model_len=args.context + 256,
               cuda_graphs=not args.eager, **extra)  # fmt: skip


def decode_rows(args) -> tuple[list, dict]:
    raw = {}
    for hisparse in (False, True):
        llm = engine(args, hisparse)
        try:
            tok_s, info = decode_tok_s(llm, args)
        finally:
            llm.shutdown()
        raw["hisparse" if hisparse else "device"] = {"tok_s": tok_s, **info}
        print(json.dumps({"hisparse": hisparse, "tok_s": tok_s, **info}), flush=True)
    dev, hs = raw["device"], raw["hisparse"]
    per_step = hs["hisparse_misses"] / max(hs["num_steps"], 1)
    lookups = hs["hisparse_hits"] + hs["hisparse_misses"]
    ctx = f"batch {args.batch}, {args.context // 1024}k context"
    without = args.context * hs["hisparse_all_on_device_c4_bytes_per_token"]
    with_hot = hs["hisparse_device_c4_bytes_per_request"]
    return [
        result(f"decode tok/s, {ctx}, HiSparse vs all on device", hs["tok_s"], "tok/s",
               dev["tok_s"], 0.8, ">=", f"hot-row hit rate {hs['hisparse_hits'] / lookups:.3f}, "
               f"{per_step:.0f} misses per step (every C4 layer)"),
        result(f"device C4 bytes per request at {args.context // 1024}k, HiSparse vs all on "
               "device", with_hot, "bytes", without, 0.25, "<=",
               f"{hs['hisparse_host_bytes'] / 2**20:.0f} MiB of host history"),
    ], raw  # fmt: skip


def main(argv=None) -> None:
    args = parse_args(argv)
    gpu = torch.cuda.is_available()
    if not gpu:  # a smoke run at tiny shapes
        args.model = args.model or os.path.join(tempfile.mkdtemp(), "tiny")
        args.batch, args.context = min(args.batch, 4), min(args.context, 1024)
        args.new_tokens, args.prefill_budget = min(args.new_tokens, 8), 1024
    args.model = args.model or "/tmp/dsv4-mini"
    if not os.path.exists(os.path.join(args.model, "config.json")):
        from dsv4ray.model.tiny import make_tiny

        make_tiny(args.model, "dsv4-mini" if gpu else "tiny", seed=0,
                  device="cuda" if gpu else "cpu")  # fmt: skip
    cfg = ModelConfig.from_hf(args.model)
    device = "cuda" if gpu else "cpu"
    available = available_bytes(args.model, cfg, args.kv_cache_dtype, device, args.cpu_budget)
    rows, raw = capacity_rows(args, cfg, available, gpu)
    more, more_raw = decode_rows(args)
    name = torch.cuda.get_device_name() if gpu else "cpu"
    settings = {"name": "settings", "value": None, "unit": "", "ceiling": None, "ratio": None,
                "op": ">=", "target": None,
                "note": f"{args.kv_cache_dtype} pages, {cfg.num_hidden_layers} layers, index_topk "
                f"{cfg.index_topk}, cuda_graphs={gpu and not args.eager}, raw: "
                f"{json.dumps({**raw, **more_raw})}"}  # fmt: skip
    print(save_results(args, "hisparse", name, {}, rows + more + [settings]))


def parse_args(argv=None):
    p = bench_parser(
        __doc__,
        model=None,
        model_help="checkpoint directory (default: /tmp/dsv4-mini on a GPU, a temporary tiny one "
        "on CPU)",
        kv_cache_dtype="fp8",
    )
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prefill-budget", type=int, default=8192, help="max_num_batched_tokens")
    p.add_argument("--eager", action="store_true", help="engines without CUDA graphs")
    p.add_argument("--cpu-budget", type=float, default=2**30, help="pool bytes on CPU (smoke)")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
