"""Serving load benchmark: N concurrent streaming clients over HTTP for a bounded time.

    python bench/serve_load.py [--model .tiny] [--clients 16] [--duration 20] [--max-requests 400]
        [--prompt-len 64] [--max-tokens 32] [--pp 1] [--kv-cache-dtype fp8] [--commit SHA]
        [--url http://127.0.0.1:PORT --served-model-name NAME --api-key KEY]

Each of N clients sends streaming completions back to back (fixed-length random prompts,
``max_tokens`` tokens each with ``ignore_eos``) until the time or the request budget is spent;
requests in flight then finish. Phase 1, the ceiling: the same closed loop calling an AsyncEngine
in this process directly (its stage actors on the local Ray, as in a replica; no HTTP, no Serve).
Phase 2: the same load through HTTP against the Serve app, started here on the local Ray at
127.0.0.1:<free port>, or the loopback server given with ``--url`` (no ceiling phase then).
TTFT is the time to the first streamed token; TPOT the mean time per token after the first.
Writes bench/results/serve-<device>.json (PERF.md's format) and regenerates BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import time
from collections.abc import Awaitable, Callable

import httpx
import torch

from dsv4ray.bench.report import (
    add_server_args,
    bench_parser,
    check_loopback_url,
    result,
    save_results,
)
from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.entrypoints.serve import APP_NAME, build_app

# (ttft_s, e2e_s, num_tokens) of one request
Sample = tuple[float, float, int]


async def closed_loop(
    num_clients: int, duration_s: float, max_requests: int, one: Callable[[int], Awaitable[Sample]]
) -> tuple[list[Sample], float]:
    """Every client sends requests back to back until time or the request budget runs out."""
    samples: list[Sample] = []
    issued = 0
    start = time.perf_counter()

    async def client() -> None:
        nonlocal issued
        while time.perf_counter() - start < duration_s and issued < max_requests:
            issued += 1
            samples.append(await one(issued))

    await asyncio.gather(*(client() for _ in range(num_clients)))
    return samples, time.perf_counter() - start


def prompt_ids(idx: int, length: int) -> list[int]:
    rng = random.Random(idx)
    return [rng.randrange(2, 258) for _ in range(length)]


async def engine_phase(args, model: str) -> tuple[list[Sample], float]:
    from dsv4ray.entrypoints.async_engine import AsyncEngine

    engine = AsyncEngine(model, **engine_options(args))
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)

    async def one(idx: int) -> Sample:
        start, first, count = time.perf_counter(), None, 0
        async for update in engine.generate(prompt_ids(idx, args.prompt_len), params):
            if update.token_ids and first is None:
                first = time.perf_counter()
            count += len(update.token_ids)
        return first - start, time.perf_counter() - start, count

    try:
        await one(0)  # warm-up
        return await closed_loop(args.clients, args.duration, args.max_requests, one)
    finally:
        engine.shutdown()


async def http_phase(args, url: str, model_name: str) -> tuple[list[Sample], float]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as http:

        async def one(idx: int) -> Sample:
            body = {
                "model": model_name,
                "prompt": prompt_ids(idx, args.prompt_len),
                "max_tokens": args.max_tokens,
                "stream": True,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            start, first, count = time.perf_counter(), None, 0
            async with http.stream("POST", "/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    num_new = len(json.loads(line[6:])["choices"][0].get("token_ids", []))
                    if num_new and first is None:
                        first = time.perf_counter()
                    count += num_new
            return first - start, time.perf_counter() - start, count

        await one(0)
        return await closed_loop(args.clients, args.duration, args.max_requests, one)


def engine_options(args) -> dict:
    options = {"pp_size": args.pp, "kv_cache_dtype": args.kv_cache_dtype, "use_ray": True}
    if args.max_total_tokens:
        options["max_total_tokens"] = args.max_total_tokens
    return options


def summarize(samples: list[Sample], wall_s: float) -> dict:
    ttft = sorted(s[0] for s in samples)
    tpot = sorted((s[1] - s[0]) / (s[2] - 1) for s in samples if s[2] > 1)
    return {
        "requests": len(samples),
        "tokens": sum(s[2] for s in samples),
        "tok_s": sum(s[2] for s in samples) / wall_s,
        "req_s": len(samples) / wall_s,
        "ttft_p50_ms": 1e3 * percentile(ttft, 50),
        "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "tpot_p50_ms": 1e3 * percentile(tpot, 50),
        "tpot_p99_ms": 1e3 * percentile(tpot, 99),
    }


def percentile(sorted_values: list[float], q: float) -> float:
    if len(sorted_values) < 2:
        return sorted_values[0] if sorted_values else float("nan")
    return statistics.quantiles(sorted_values, n=100, method="inclusive")[int(q) - 1]


def serve_app(config: dict) -> str:
    """The Serve app of ``build_app(config)`` on the local Ray at 127.0.0.1:<free port> -> its
    URL (``serve.shutdown()`` stops it)."""
    from ray import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(config), name=APP_NAME, route_prefix="/")
    return f"http://127.0.0.1:{port}"


def start_server(args, model: str) -> tuple[str, str]:
    config = {"model": model, "max_pending_requests": max(256, 2 * args.clients)}
    config.update({k: v for k, v in engine_options(args).items() if k != "use_ray"})
    return serve_app(config), os.path.basename(os.path.abspath(model))


def rows_for(http: dict, ceiling: dict | None, note: str) -> list[dict]:
    base = ceiling or {}
    specs = [  # name, key, unit, op, target (on the ratio HTTP / in-process engine)
        ("streamed tokens/s over HTTP vs in-process engine", "tok_s", "tok/s", ">=", 0.8),
        ("TTFT p50 over HTTP vs in-process engine", "ttft_p50_ms", "ms", "<=", 1.5),
        ("TTFT p99 over HTTP vs in-process engine", "ttft_p99_ms", "ms", "<=", 2.0),
        ("TPOT p50 over HTTP vs in-process engine", "tpot_p50_ms", "ms", "<=", 1.25),
        ("TPOT p99 over HTTP vs in-process engine", "tpot_p99_ms", "ms", "<=", 1.5),
    ]
    counts = f"; {http['requests']} requests ({http['req_s']:.3g}/s), {http['tokens']} tokens"
    return [
        result(name, http[key], unit, base.get(key, 0.0), target, op, note + counts)
        for name, key, unit, op, target in specs
    ]


def parse_args(argv=None) -> argparse.Namespace:
    parser = bench_parser(__doc__, model=".tiny", kv_cache_dtype="fp8")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per phase")
    parser.add_argument("--max-requests", type=int, default=400, help="per phase")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--max-total-tokens", type=int, default=None)
    add_server_args(parser)
    args = parser.parse_args(argv)
    check_loopback_url(parser, args.url)
    if min(args.clients, args.max_requests, args.max_tokens, args.prompt_len) < 1:
        parser.error("--clients, --max-requests, --max-tokens and --prompt-len must be >= 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    import ray
    from ray import serve

    gpu = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if gpu else "cpu"
    model = os.path.abspath(args.model)
    ceiling = None
    if args.url:
        url, name = args.url, args.served_model_name or os.path.basename(model)
    else:
        ray.init(include_dashboard=False, logging_level="ERROR")
        ceiling = summarize(*asyncio.run(engine_phase(args, model)))
        url, name = start_server(args, model)
    try:
        http = summarize(*asyncio.run(http_phase(args, url, name)))
    finally:
        if not args.url:
            serve.shutdown()
    note = (
        f"{os.path.basename(model)}, pp {args.pp}, kv {args.kv_cache_dtype}, "
        f"{args.clients} streaming clients, {args.prompt_len}-token prompts, "
        f"{args.max_tokens} tokens each, {args.duration:g} s"
    )
    rows = rows_for(http, ceiling, note if ceiling else note + "; external server, no ceiling")
    ceilings = {}
    if ceiling:
        ceilings = {
            f"in-process engine {what}": {"value": ceiling[key], "unit": unit, "note": note}
            for what, key, unit in (
                ("streamed tokens/s", "tok_s", "tok/s"),
                ("TTFT p50", "ttft_p50_ms", "ms"),
                ("TPOT p50", "tpot_p50_ms", "ms"),
            )
        }
    path = save_results(args, "serve", device, ceilings, rows)
    print(json.dumps({"http": http, "engine": ceiling}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
