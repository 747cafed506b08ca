"""Prefill/decode disaggregation benchmark: time to first token with and without a prefill engine,
the KV transfer's share of it, and the transfer's bandwidth against the Mooncake TCP ceiling.

    python bench/pd.py [--model DIR] [--prompt-len N] [--reps R] [--kv-cache-dtype fp8]
                       [--commit SHA] [--out-dir DIR]

On GPUs (default --model /tmp/dsv4-mini, made with make_tiny(dir, "dsv4-mini") when missing;
8192-token prompts) each engine's stage has a GPU of its own where the machine has two or more
(the prefill pipeline on one, the decode pipeline on another; the engine without PD on a third,
or, with two GPUs, measured before the PD pair starts); with one GPU every engine shares it: each
stage takes 0.3 of it (num_gpus_per_stage) and 0.3 of the memory free when it starts. On CPU it
is a smoke run on the tiny preset (1024-token prompts). In one run it measures:
  - the ceiling: one raw 256 MiB Mooncake TCP write between two buffers registered in this
    process (device buffers on a GPU, as the pools are), median of 3;
  - TTFT of an engine without PD (one Ray stage actor) and of a PD pair (prefill pp 1 ->
    decode pp 1) with the same options over the same fresh prompts (no prefix hits), medians
    over R prompts after a warm-up prompt of the same length;
  - each PD request's transfer time (the prefill stages' write time,
    RequestOutput.metrics.kv_transfer_s), the part of its TTFT outside the prefill engine (TTFT -
    metrics.remote_prefill_s) and the handoff's bytes; greedy tokens of the two engines are
    compared.
Writes bench/results/pd-<device>.json (PERF.md's format).
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from dsv4ray import LLM, SamplingParams
from dsv4ray.bench.report import bench_parser, random_prompts, result, save_results
from dsv4ray.worker.pd.transfer import MooncakeTransport, TransferError

CEILING_BYTES = 256 << 20
FOUR = SamplingParams(max_tokens=4, ignore_eos=True)


def mooncake_ceiling(device: torch.device) -> tuple[float, str]:
    """(GB/s, buffer kind) of a raw 256 MiB write between two registered buffers on device
    (loopback TCP); host buffers when this Mooncake build cannot reach device memory."""
    try:
        return _raw_write_gbs(device), device.type
    except TransferError as exc:
        print(f"raw write between {device.type} buffers failed ({exc}); host buffers instead")
        return _raw_write_gbs(torch.device("cpu")), "host (device failed)"


def _raw_write_gbs(device: torch.device) -> float:
    sender, receiver = MooncakeTransport("127.0.0.1"), MooncakeTransport("127.0.0.1")
    src = torch.randint(0, 256, (CEILING_BYTES,), dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    sender.register(src)
    receiver.register(dst)
    try:
        write = [(src.data_ptr(), dst.data_ptr(), CEILING_BYTES)]
        sender.write(receiver.session, write)  # connects
        times = []
        for _ in range(3):
            dst.zero_()
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            sender.write(receiver.session, write)
            times.append(time.perf_counter() - start)
        if not torch.equal(src[-4096:], dst[-4096:]):
            raise RuntimeError("the raw Mooncake write did not arrive")
    finally:
        sender.close()
        receiver.close()
    return CEILING_BYTES / statistics.median(times) / 1e9


def measure(model: str, gpu: bool, prompt_len: int, reps: int, kv_dtype: str) -> dict:
    """TTFT of one engine and of a PD pair over the same prompts, one request at a time; the
    first prompt warms up. With two GPUs the plain engine runs first on one and the PD pair
    then takes both; otherwise both are up at once (a GPU each with three or more, else each
    stage takes 0.3 of the one GPU and 0.3 of its free memory)."""
    options = dict(kv_cache_dtype=kv_dtype, max_num_batched_tokens=max(2048, prompt_len))
    gpus = torch.cuda.device_count() if gpu else 0
    if gpus == 1:
        options.update(num_gpus_per_stage=0.3, memory_fraction=0.3)
    prompts = random_prompts(reps + 1, prompt_len, seed=11)
    if gpus == 2:
        base = _run(LLM(model, use_ray=True, **options), prompts)
        torch.cuda.empty_cache()
        pd = LLM(model, prefill_pp_size=1, pp_size=1, **options)
        return {"base": base[1:], **_run_pd(pd, prompts)}
    plain = LLM(model, use_ray=True, **options)
    try:
        # each prompt on one, then on the other: load on a shared machine hits both alike
        pd = LLM(model, prefill_pp_size=1, pp_size=1, **options)
        base = []
        m = _run_pd(pd, prompts, before=lambda p: base.append(plain.generate([p], FOUR)[0]))
    finally:
        plain.shutdown()
    return {"base": base[1:], **m}


def _run(llm: LLM, prompts: list) -> list:
    try:
        return [llm.generate([p], FOUR)[0] for p in prompts]
    finally:
        llm.shutdown()


def _run_pd(pd: LLM, prompts: list, before=lambda prompt: None) -> dict:
    try:
        outs = []
        for prompt in prompts:
            before(prompt)
            outs.append(pd.generate([prompt], FOUR)[0])
        return {"pd": outs[1:], "stats": pd.core.stats()}
    finally:
        pd.shutdown()


def _median(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def rows(m: dict, ceiling: float, prompt_len: int, kv_dtype: str, gpu: bool) -> tuple[list, float]:
    base_ttft = _median(o.metrics.ttft_s for o in m["base"])
    pd_ttft = _median(o.metrics.ttft_s for o in m["pd"])
    transfer = _median(o.metrics.kv_transfer_s for o in m["pd"])
    engine_s = _median(o.metrics.remote_prefill_s for o in m["pd"])
    outside = _median(
        o.metrics.ttft_s - o.metrics.remote_prefill_s for o in m["pd"] if o.metrics.remote_prefill_s
    )
    share = _median(
        o.metrics.kv_transfer_s / o.metrics.ttft_s for o in m["pd"] if o.metrics.kv_transfer_s
    )
    stats = m["stats"]
    gpus = torch.cuda.device_count() if gpu else 0
    placed = {0: "sharing the CPU", 1: "sharing one GPU", 2: "a GPU each, one engine at a time"}
    placed = placed.get(gpus, "a GPU each, both up at once")
    num_bytes = stats["pd_transfer_bytes"] / max(1, stats["pd_remote_prefills"])
    seconds = stats["pd_transfer_seconds"]
    bandwidth = stats["pd_transfer_bytes"] / seconds / 1e9 if seconds else float("nan")
    same = [o.token_ids for o in m["pd"]] == [o.token_ids for o in m["base"]]
    handoffs = (
        f"{stats['pd_remote_prefills']} verified handoffs, {stats['pd_local_prefills']} local "
        f"fallbacks, {stats['pd_checksum_failures']} checksum failures"
    )
    out = [
        result(
            f"KV transfer share of TTFT with PD ({prompt_len} tokens)",
            transfer, "s", pd_ttft, 0.10, "<=",
            f"median write time of the prefill stages over median PD TTFT (median per-request "
            f"share {share:.3g}); {num_bytes / 2**20:.1f} MiB of {kv_dtype} pages and rings per "
            f"request; {handoffs}",
        ),
        result(
            f"TTFT with PD / without ({prompt_len} tokens)",
            pd_ttft, "s", base_ttft, 1.10, "<=",
            f"prefill pp 1 -> decode pp 1 vs one engine (both Ray stage actors, {placed}); "
            f"greedy tokens {'equal' if same else 'DIFFER'}"
            + ("" if gpu else "; CPU smoke run: on shared cores the ratio swings both ways"),
        ),
        result(
            f"PD TTFT outside the prefill engine ({prompt_len} tokens)",
            outside, "s", pd_ttft, 0.1, "<=",
            f"median of TTFT - remote_prefill_s (the prefill engine's time from taking the "
            f"request to its answer, median {engine_s * 1e3:.1f} ms): the request's trips to the "
            "prefill actor and back and the decode engine's own steps; no PERF.md target "
            "(informational)",
        ),
        result(
            f"KV checksums' share of TTFT with PD ({prompt_len} tokens)",
            stats["pd_checksum_seconds"] / max(1, stats["pd_remote_prefills"]), "s", pd_ttft,
            0.1, "<=",
            "the prefill stages' CRC-32 per layer of the bytes they send, summed over the stages "
            "and averaged over the run's handoffs (the warm-up's included), over median PD TTFT "
            "(the decode stages checksum what they received in a step of their own, not counted "
            "here); no PERF.md target (informational)",
        ),
        result(
            "KV handoff bandwidth / raw Mooncake TCP write",
            bandwidth, "GB/s", ceiling, 0.5, ">=",
            "bytes the prefill stages wrote over their write time, coalesced page runs per "
            "buffer and layer; no PERF.md target (informational)",
        ),
    ]  # fmt: skip
    return out, base_ttft


def main(argv=None) -> None:
    parser = bench_parser(
        __doc__,
        model=None,
        model_help="checkpoint directory (default: /tmp/dsv4-mini on GPUs, .tiny on CPU; made "
        "when missing)",
        kv_cache_dtype="fp8",
    )
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    name = torch.cuda.get_device_name() if gpu else "cpu"
    model = args.model or ("/tmp/dsv4-mini" if gpu else ".tiny")
    if not os.path.isfile(os.path.join(model, "config.json")):
        from dsv4ray.model.tiny import make_tiny

        make_tiny(model, "dsv4-mini" if gpu else "tiny", device=device.type)
    prompt_len = args.prompt_len or (8192 if gpu else 1024)
    reps = args.reps or (5 if gpu else 2)
    ceiling, kind = mooncake_ceiling(device)
    if gpu:
        torch.cuda.empty_cache()  # the stage actors size their pools from what is free
    m = measure(model, gpu, prompt_len, reps, args.kv_cache_dtype)
    out, base_ttft = rows(m, ceiling, prompt_len, args.kv_cache_dtype, gpu)
    ceilings = {
        "Mooncake TCP write, 256 MiB": {
            "value": ceiling, "unit": "GB/s", "note": f"loopback, {kind} buffers, median of 3",
        },
        "TTFT without PD": {"value": base_ttft, "unit": "s", "note": f"{prompt_len} tokens"},
    }  # fmt: skip
    path = save_results(args, "pd", name, ceilings, out)
    for row in out:
        print(
            f"{row['name']}: {row['value']:.4g} {row['unit']} (ratio {row['ratio']:.3g}, target "
            f"{row['op']} {row['target']}; {row['note']})"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
