"""Decode benchmark on one GPU: the engine against transformers `generate` on dsv4-mini.

    python bench/decode.py [--model DIR] [--batches 1,16,64] [--contexts 4096,16384,65536]
                           [--prefill-len 8192] [--no-hf] [--profile DIR] [--commit SHA]
    python bench/decode.py --quantize fp8+fp4-experts [--batches 1,64]   (see bench/quantized.py)
    python bench/decode.py --quantize fp8+fp4-experts --preset dsv4-flash-layers --layers 4 \
                           --routing router,hash

Makes the dsv4-mini checkpoint when --model does not exist, measures the device copy ceiling and
the bf16 matmul peak, then in the same run: decode tokens/s of the engine and of transformers
(bf16, greedy, the same 512-token prompts) at each batch; the engine's decode step against the
roofline (weight bytes read per step + KV bytes read, over the copy ceiling); decode step time at
batch 8 over growing contexts; prefill tokens/s at 8k-token prompts against the matmul peak.
The engine's decode step is the median wall time of its pure-decode steps at the full batch
(host work, forward, sampling and detokenisation included; see bench/step_clock.py's
StepClock); transformers' is generate(n + 1 tokens) - generate(1 token) over n. Writes
bench/results/decode-<device>.json (PERF.md's format).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from dsv4ray import LLM, SamplingParams
from dsv4ray.bench.report import bench_parser, random_prompts, result, save_results
from dsv4ray.bench.roofline import (
    active_params,
    ceilings,
    kv_bytes_per_step,
    median_s,
    weight_bytes_per_step,
)
from dsv4ray.bench.step_clock import engine_decode_s
from dsv4ray.config import ModelConfig


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def hf_decode_s(model, batch: int, prompt_len: int, new: int, seed: int) -> float:
    def gen(n, s):
        ids = torch.tensor(random_prompts(batch, prompt_len, s), device="cuda")
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                       min_new_tokens=n, do_sample=False)  # fmt: skip

    gen(2, seed + 7)  # warm-up
    return _timed(lambda: gen(new + 1, seed + 1)) - _timed(lambda: gen(1, seed))


def load_hf(path: str):
    from transformers import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()


def hf_rows(args) -> dict:
    """transformers decode tok/s per batch (measured before the engine takes the memory)."""
    if args.no_hf:
        return {}
    hf, out = load_hf(args.model), {}
    for batch in args.batches:
        hf_s = hf_decode_s(hf, batch, args.prompt_len, args.new_tokens, 10 * batch)
        out[batch] = (batch * args.new_tokens / hf_s, 1e3 * hf_s / args.new_tokens)
        print(json.dumps({"hf_batch": batch, "tok_s": out[batch][0]}), flush=True)
    del hf
    torch.cuda.empty_cache()
    return out


def decode_rows(args, cfg, peaks, llm, hf) -> tuple[list, dict]:
    rows, raw = [], {}
    for batch in args.batches:
        engine_s = engine_decode_s(llm, batch, args.prompt_len, args.new_tokens, 10 * batch)
        step_ms = 1e3 * engine_s / args.new_tokens
        tok_s = batch * args.new_tokens / engine_s
        raw[f"engine_b{batch}"] = {"tok_s": tok_s, "step_ms": step_ms}
        ctx = args.prompt_len + args.new_tokens // 2
        wbytes = weight_bytes_per_step(cfg, batch)
        kbytes = batch * kv_bytes_per_step(cfg, ctx, args.kv_cache_dtype)
        roof_ms = 1e3 * (wbytes + kbytes) / peaks["copy"]
        raw[f"roofline_b{batch}"] = {"weight_bytes": wbytes, "kv_bytes": kbytes, "ms": roof_ms}
        rows.append(result(f"decode step, batch {batch}", step_ms, "ms", roof_ms, 2.0, "<=",
                           f"roofline: {wbytes / 1e9:.2f} GB weights + {kbytes / 1e6:.1f} MB KV "
                           "over the copy ceiling"))  # fmt: skip
        if batch in hf:
            hf_tok_s, hf_ms = hf[batch]
            raw[f"hf_b{batch}"] = {"tok_s": hf_tok_s, "step_ms": hf_ms}
            target = {1: 5.0, 64: 10.0}.get(batch)
            note = f"transformers {hf_tok_s:.1f} tok/s ({hf_ms:.1f} ms/step)"
            name = f"decode tok/s, batch {batch}, vs transformers"
            rows.append(result(name, tok_s, "tok/s", hf_tok_s, target, ">=", note))
        print(json.dumps({k: v for k, v in raw.items() if k.endswith(f"b{batch}")}), flush=True)
    return rows, raw


def replay_rows(args, cfg, peaks, llm) -> tuple[list, dict]:
    """GPU time of the captured decode forward alone (no host work, no sampling), replaying
    the graphs over the index buffers their last step left (pages rewritten with equal bytes)."""
    graphs = llm.core.pipeline.workers[0].graphs
    if graphs is None:
        return [], {}
    rows, raw, ctx0 = [], {}, min(graphs.contexts)
    keys = [(b, ctx0) for b in args.batches] + [(8, c) for c in args.contexts if c != ctx0]
    for b, ctx in (k for k in keys if k in graphs.graphs):
        ms = 1e3 * median_s(graphs.graphs[(b, ctx)].graph.replay)
        raw[f"replay_b{b}_ctx{ctx}"] = ms
        context = args.prompt_len if ctx == ctx0 else ctx  # what the last step there read
        kv = b * kv_bytes_per_step(cfg, context, args.kv_cache_dtype)
        roof = 1e3 * (weight_bytes_per_step(cfg, b) + kv) / peaks["copy"]
        rows.append(result(f"decode forward alone (graph replay), batch {b}, {ctx // 1024}k "
                           "bucket", ms, "ms", roof, 2.0, "<=", "roofline at the bench's "
                           "context"))  # fmt: skip
    print(json.dumps(raw), flush=True)
    return rows, raw


def context_rows(args, llm) -> tuple[list, dict]:
    steps, raw = {}, {}
    for ctx in args.contexts:
        s = engine_decode_s(llm, 8, ctx - args.ctx_new - 1, args.ctx_new, 1000 + ctx)
        steps[ctx] = 1e3 * s / args.ctx_new
        raw[f"ctx_{ctx}"] = steps[ctx]
        print(json.dumps({"context": ctx, "step_ms": steps[ctx]}), flush=True)
    if len(steps) < 2:
        return [], raw
    lo, hi = min(steps), max(steps)
    return [
        result(
            f"decode step, batch 8, {hi // 1024}k vs {lo // 1024}k context",
            steps[hi],
            "ms",
            steps[lo],
            1.5,
            "<=",
            ", ".join(f"{c // 1024}k: {v:.2f} ms" for c, v in steps.items()),
        )
    ], raw


def prefill_rows(args, cfg, peaks, llm) -> tuple[list, dict]:
    if not args.prefill_len:
        return [], {}
    num = 4
    llm.generate(random_prompts(1, args.prefill_len, 5), SamplingParams(max_tokens=1))
    s = _timed(lambda: llm.generate(random_prompts(num, args.prefill_len, 6),
                                    SamplingParams(max_tokens=1, ignore_eos=True)))  # fmt: skip
    tok_s = num * args.prefill_len / s
    flops = 2 * active_params(cfg) * tok_s
    return [
        result(
            f"prefill, {args.prefill_len // 1024}k-token prompts",
            flops / 1e12,
            "TFLOP/s",
            peaks["matmul"] / 1e12,
            0.35,
            ">=",
            f"{tok_s:.0f} tokens/s; 2 x {active_params(cfg) / 1e6:.0f}M active "
            "parameters per token (attention scores not counted)",
        )
    ], {"prefill_tok_s": tok_s}


def profile_decode(llm: LLM, out_dir: str, batch: int = 16, steps: int = 16) -> None:
    """A torch-profiler table of `steps` decode steps at `batch` (after one warm step)."""
    from torch.profiler import ProfilerActivity, profile

    prompts = random_prompts(batch, 512, 77)
    llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(
            random_prompts(batch, 512, 78), SamplingParams(max_tokens=steps + 1, ignore_eos=True)
        )
    os.makedirs(out_dir, exist_ok=True)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    kernels = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
    syncs = sum(e.count for e in prof.key_averages() if "synchronize" in e.key.lower()
                or e.key in ("aten::item", "aten::_local_scalar_dense"))  # fmt: skip
    with open(os.path.join(out_dir, f"profile-decode-b{batch}.txt"), "w") as f:
        f.write(
            f"{steps} decode steps (+ prefill) at batch {batch}: {kernels} CUDA kernel/memcpy "
            f"events, {syncs} host synchronisations\n\n{table}\n"
        )
    print(f"profile: {kernels} device events, {syncs} syncs over {steps} steps + prefill")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.quantize:
        from dsv4ray.bench.quantized import run as run_quantized

        return run_quantized(args)
    if not os.path.exists(os.path.join(args.model, "config.json")):
        from dsv4ray.model.tiny import make_tiny

        make_tiny(args.model, "dsv4-mini", seed=0, device="cuda")
    cfg = ModelConfig.from_hf(args.model)
    peaks = ceilings()
    hf = hf_rows(args)
    llm = LLM(args.model, device="cuda", kv_cache_dtype=args.kv_cache_dtype,
              max_running_requests=max(args.batches + [8]), max_num_batched_tokens=8192,
              cuda_graphs=not args.eager, max_model_len=max(args.contexts + [4096]),
              overlap_scheduling=not args.no_overlap)  # fmt: skip
    rows, raw = decode_rows(args, cfg, peaks, llm, hf)
    for fn in (
        lambda: context_rows(args, llm),
        lambda: replay_rows(args, cfg, peaks, llm),  # after the steps that fill its graphs
        lambda: prefill_rows(args, cfg, peaks, llm),
    ):
        more, more_raw = fn()
        rows, raw = rows + more, {**raw, **more_raw}
    if args.profile:
        profile_decode(llm, args.profile)
    llm.shutdown()
    device = torch.cuda.get_device_name()
    ceil = {
        "device copy": {"value": peaks["copy"] / 1e9, "unit": "GB/s", "note": "read + write"},
        "bf16 matmul": {"value": peaks["matmul"] / 1e12, "unit": "TFLOP/s", "note": "8192^3"},
    }
    note = {
        "name": "settings",
        "value": None,
        "unit": "",
        "ceiling": None,
        "ratio": None,
        "op": ">=",
        "target": None,
        "note": f"{args.kv_cache_dtype} pages, prompts {args.prompt_len}, {args.new_tokens} "
        f"new tokens, cuda_graphs={not args.eager}, overlap scheduling "
        f"{not args.no_overlap}, raw: {json.dumps(raw)}",
    }
    print(save_results(args, "decode", device, ceil, rows + [note]))


def parse_args(argv=None):
    p = bench_parser(__doc__, model="/tmp/dsv4-mini", kv_cache_dtype="fp8")
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--batches", type=ints, default=[1, 16, 64])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--contexts", type=ints, default=[4096, 16384, 65536])
    p.add_argument("--ctx-new", type=int, default=32, help="decode steps per context")
    p.add_argument("--prefill-len", type=int, default=8192, help="0 skips the prefill run")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--eager", action="store_true", help="engine without CUDA graphs")
    p.add_argument("--no-overlap", action="store_true", help="engine without overlap scheduling")
    p.add_argument("--profile", default=None, help="write a decode profile table here")
    p.add_argument(
        "--quantize",
        default=None,
        choices=["fp8", "fp8+fp4-experts"],
        help="native FP8/FP4 weights vs dequantised bf16 (bench/quantized.py)",
    )
    p.add_argument("--preset", default="dsv4-mini", help="make_tiny preset for --quantize")
    p.add_argument("--layers", type=int, default=None, help="num_hidden_layers for --quantize")
    p.add_argument("--routing", default="router", help="router, hash or router,hash (--quantize)")
    p.add_argument("--fp8-prefill", action="store_true",
                   help="native engine with EngineConfig.fp8_prefill (--quantize)")  # fmt: skip
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
