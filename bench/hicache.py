"""Host tier benchmark: reload bandwidth against the pinned H2D ceiling, and time to first token
of a full host-tier prefix hit against a cold prefill (PERF.md).

    python bench/hicache.py [--model .tiny] [--prompt-len 32768] [--commit SHA]

Reload bandwidth times HostIO.run (the stage's own copy path: page rows of every compressed pool
of the stage's layers, one event per layer on GPUs) on a batch of host pages, next to a plain
pinned host -> device copy of the same number of bytes. The TTFT part runs the engine with a
host tier and a device pool too small for two prompts: prompt A cold, prompt B (evicts A), then
A again, served from host memory. On CPU (no pinned memory) the ceiling is a host memcpy and the
default prompt is 4096 tokens. Writes bench/results/hicache-<device>.json.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch

from dsv4ray import LLM, SamplingParams
from dsv4ray.actors.host_tier import HostTier
from dsv4ray.bench.report import bench_parser, result, save_results
from dsv4ray.cache.hicache import HostOps
from dsv4ray.cache.host_layout import HostLayout
from dsv4ray.cache.pool_sizes import PoolSizes
from dsv4ray.cache.pools import StagePools
from dsv4ray.config import ModelConfig
from dsv4ray.engine.plan import StepPlan
from dsv4ray.worker.host.host_io import HostIO


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _median_s(fn, device, reps: int = 10) -> float:
    fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def reload_bandwidth(model: str, num_pages: int, kv_dtype: str, device) -> tuple[float, float, int]:
    """(HostIO load GB/s, plain pinned copy GB/s, bytes per load) for num_pages pages."""
    cfg = ModelConfig.from_hf(model)
    end = cfg.num_hidden_layers
    pools = StagePools(cfg, 0, end, PoolSizes(num_pages, 8, 1, 1), kv_dtype, device)
    layout = HostLayout(cfg, 0, end, kv_dtype, num_pages, 1)
    tier = HostTier()
    region = tier.create_region(f"bench-{os.getpid()}", layout.nbytes)
    try:
        io = HostIO(pools, layout, region["path"])
        for buf in io.host.c4 + io.host.indexer + io.host.c128:
            buf.random_(0, 255)
        ids = list(range(num_pages))
        plan = StepPlan(step_id=0, host=HostOps(loads=list(zip(ids, ids))))

        def load():
            events = io.run(plan)
            for layer in range(end):
                events.wait(layer)

        moved = sum(t.numel() for t in pools.c4 + pools.indexer + pools.c128)
        load_s = _median_s(load, device)
        src = torch.empty(moved, dtype=torch.uint8, pin_memory=device.type == "cuda")
        dst = torch.empty(moved, dtype=torch.uint8, device=device)
        copy_s = _median_s(lambda: dst.copy_(src, non_blocking=True), device)
    finally:
        tier.release_region(region["key"])
    return moved / load_s / 1e9, moved / copy_s / 1e9, moved


def ttft_hit_vs_cold(model: str, prompt_len: int, kv_dtype: str) -> tuple[float, float, int]:
    """(hit TTFT, cold TTFT, tokens from the host). A first round with other prompts warms up
    every kernel shape (Triton compiles on first use), so neither time includes compilation."""
    g = torch.Generator().manual_seed(0)
    pages = -(-prompt_len // 256) + 2
    llm = LLM(
        model,
        kv_cache_dtype=kv_dtype,
        enable_hicache=True,
        max_total_tokens=pages * 256,
        max_num_batched_tokens=8192,
    )
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    try:
        for _ in range(2):
            a, b = (torch.randint(2, 258, (prompt_len,), generator=g).tolist() for _ in range(2))
            cold = llm.generate([a], one)[0].metrics.ttft_s
            llm.generate([b], one)  # evicts a from the device; a stays in the host tier
            llm.generate([[5]], one)  # lets the write-through backups of b run
            hit = llm.generate([a + [7]], one)[0]
    finally:
        llm.shutdown()
    return hit.metrics.ttft_s, cold, hit.metrics.num_host_cached_tokens


def main(argv=None) -> None:
    parser = bench_parser(__doc__, model=".tiny", kv_cache_dtype="fp8")
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--pages", type=int, default=None, help="pages per reload batch")
    args = parser.parse_args(argv)
    tempfile.tempdir = tempfile.gettempdir()
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    name = torch.cuda.get_device_name() if gpu else "cpu"
    prompt_len = args.prompt_len or (32768 if gpu else 4096)
    gbs, ceiling, moved = reload_bandwidth(
        args.model, args.pages or (256 if gpu else 64), args.kv_cache_dtype, device
    )
    hit, cold, host_tokens = ttft_hit_vs_cold(args.model, prompt_len, args.kv_cache_dtype)
    kind = "pinned H2D copy" if gpu else "host memcpy (CPU: no pinned memory)"
    rows = [
        result(
            "host tier reload (HostIO page loads)",
            gbs,
            "GB/s",
            ceiling,
            0.8,
            ">=",
            f"{moved / 2**20:.1f} MiB per batch, {args.kv_cache_dtype} pages; vs {kind}",
        ),
        result(
            f"TTFT full host hit / cold prefill ({prompt_len} tokens)",
            hit,
            "s",
            cold,
            0.2,
            "<=",
            f"{host_tokens} tokens loaded from the host tier; cold {cold:.3f} s",
        ),
    ]
    ceilings = {
        kind: {"value": ceiling, "unit": "GB/s", "note": f"{moved / 2**20:.1f} MiB"},
        "cold prefill TTFT": {"value": cold, "unit": "s", "note": f"{prompt_len} tokens"},
    }
    path = save_results(args, "hicache", name, ceilings, rows)
    for row in rows:
        print(
            f"{row['name']}: {row['value']:.4g} {row['unit']} (ratio {row['ratio']:.3g}, target "
            f"{row['op']} {row['target']}; {row['note']})"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
