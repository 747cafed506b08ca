"""Prefix-aware routing across Serve replicas against Serve's power-of-two routing: multi-turn
conversations, their prefix-cache hit rate and time to first token.

    python bench/routing.py [--model .tiny] [--replicas 4] [--conversations 16] [--turns 4]
        [--turn-len 320] [--max-tokens 8] [--kv-cache-dtype fp8] [--commit SHA] [--out-dir DIR]

For each routing (``pow2`` then ``prefix``) the Serve app starts on the local Ray with --replicas
engine replicas; every conversation runs its turns one after another, all conversations at once.
Turn t's prompt is turn t - 1's prompt, the tokens answered to it, and --turn-len new token ids
(a chat's history as token ids), streamed from /v1/completions. A turn's cached tokens come from
the response's ``usage.prompt_tokens_details.cached_tokens``; the hit rate is cached over prompt
tokens of turns after the first (the first turn of a conversation cannot hit), TTFT the time to
the first streamed token of those turns. Writes bench/results/routing-<device>.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time

import httpx
import torch

from dsv4ray.bench.report import bench_parser, result, save_results
from dsv4ray.bench.serve_load import serve_app

# (prompt tokens, cached tokens, ttft_s) of one turn after a conversation's first
Turn = tuple[int, int, float]


async def conversation(http, name: str, idx: int, args) -> list[Turn]:
    rng = random.Random(idx)
    prompt, turns = [], []
    for t in range(args.turns):
        prompt += [rng.randrange(2, 258) for _ in range(args.turn_len)]
        body = {
            "model": name,
            "prompt": prompt,
            "max_tokens": args.max_tokens,
            "stream": True,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
        }
        start, first, answer, usage = time.perf_counter(), None, [], None
        async with http.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    if choice.get("token_ids") and first is None:
                        first = time.perf_counter()
                    answer += choice.get("token_ids") or []
        if t:
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            turns.append((usage["prompt_tokens"], cached, first - start))
        prompt += answer
    return turns


async def run_load(url: str, name: str, args) -> list[Turn]:
    limits = httpx.Limits(max_connections=args.conversations + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        await conversation(http, name, -1, args)  # warm-up
        runs = [conversation(http, name, i, args) for i in range(args.conversations)]
        return [turn for turns in await asyncio.gather(*runs) for turn in turns]


def measure(args, model: str, routing: str) -> dict:
    from ray import serve

    config = {
        "model": model,
        "num_replicas": args.replicas,
        "routing": routing,
        "kv_cache_dtype": args.kv_cache_dtype,
    }
    if args.max_total_tokens:
        config["max_total_tokens"] = args.max_total_tokens
    try:
        url = serve_app(config)
        turns = asyncio.run(run_load(url, os.path.basename(model), args))
    finally:
        serve.shutdown()
    ttft = [t[2] for t in turns]
    return {
        "hit_rate": sum(t[1] for t in turns) / sum(t[0] for t in turns),
        "ttft_p50_ms": 1e3 * statistics.median(ttft),
        "ttft_mean_ms": 1e3 * statistics.fmean(ttft),
        "turns": len(turns),
    }


def main(argv=None) -> None:
    parser = bench_parser(__doc__, model=".tiny", kv_cache_dtype="fp8")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-len", type=int, default=320)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-total-tokens", type=int, default=32768)
    args = parser.parse_args(argv)
    if min(args.replicas, args.conversations, args.turn_len, args.max_tokens) < 1 or args.turns < 2:
        parser.error("--replicas, --conversations, --turn-len, --max-tokens >= 1; --turns >= 2")
    import ray

    gpu = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if gpu else "cpu"
    model = os.path.abspath(args.model)
    # logical CPUs: every replica's engine and stage actor on a small machine
    ray.init(include_dashboard=False, logging_level="ERROR",
             **({} if gpu else {"num_cpus": 2 * args.replicas + 2}))  # fmt: skip
    base, prefix = measure(args, model, "pow2"), measure(args, model, "prefix")
    note = (
        f"{os.path.basename(model)}, {args.replicas} replicas, {args.conversations} "
        f"conversations of {args.turns} turns ({args.turn_len} new tokens a turn, "
        f"{args.max_tokens} answered), {prefix['turns']} turns after the first"
    )
    rows = [
        result("prefix-cache hit rate, prefix routing vs power of two", prefix["hit_rate"],
               "fraction", base["hit_rate"], 1.0, ">=", note),
        result("TTFT p50 of later turns, prefix routing vs power of two", prefix["ttft_p50_ms"],
               "ms", base["ttft_p50_ms"], 1.0, "<=", note),
        result("TTFT mean of later turns, prefix routing vs power of two",
               prefix["ttft_mean_ms"], "ms", base["ttft_mean_ms"], 1.0, "<=", note),
    ]  # fmt: skip
    ceilings = {
        f"power of two {what}": {"value": base[key], "unit": unit, "note": note}
        for what, key, unit in (
            ("hit rate", "hit_rate", "fraction"),
            ("TTFT p50", "ttft_p50_ms", "ms"),
            ("TTFT mean", "ttft_mean_ms", "ms"),
        )
    }
    path = save_results(args, "routing", device, ceilings, rows)
    print(json.dumps({"pow2": base, "prefix": prefix}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
