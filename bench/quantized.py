"""Decode with a release checkpoint's FP8 / FP4 weights kept on the GPU, against the same
checkpoint dequantised to bf16 at load (`python bench/decode.py --quantize fp8+fp4-experts`).

Makes the dsv4-mini preset in the release layout (make_tiny(..., quantize=...)) when --model does
not exist, then in one run, for weight_format "dequantized" and then "native": the engine's decode
step (bench/step_clock.py: median pure-decode step at the full batch) at each batch. Rows: each
step against its own roofline (weight bytes read per step in that format + KV bytes, over the
device copy ceiling) and native against dequantized. Writes
bench/results/decode-quantized-<device>.json.

On a CPU machine it runs as a smoke check (`--preset tiny --batches 1,4`): no ceilings, no
roofline rows.
"""

from __future__ import annotations

import json
import os

import torch

from dsv4ray import LLM
from dsv4ray.bench.report import result, save_results
from dsv4ray.bench.roofline import ceilings, kv_bytes_per_step, weight_bytes_per_step
from dsv4ray.bench.step_clock import engine_decode_s
from dsv4ray.config import ModelConfig

FORMATS = ("dequantized", "native")


def _steps_ms(args, fmt: str) -> dict[int, float]:
    """Median decode step (ms) per batch with weight_format `fmt`."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(args.model, device=device, kv_cache_dtype=args.kv_cache_dtype, weight_format=fmt,
              dtype="bfloat16", max_running_requests=max(args.batches), cuda_graphs=not args.eager,
              max_model_len=max(4096, args.prompt_len + args.new_tokens + 8))  # fmt: skip
    try:
        out = {}
        for batch in args.batches:
            s = engine_decode_s(llm, batch, args.prompt_len, args.new_tokens, 10 * batch)
            out[batch] = 1e3 * s / args.new_tokens
            print(json.dumps({"weights": fmt, "batch": batch, "step_ms": out[batch]}), flush=True)
        return out
    finally:
        llm.shutdown()


def _rows(args, cfg, copy_bw, steps) -> tuple[list, dict]:
    rows, raw = [], {"steps_ms": steps}
    ctx = args.prompt_len + args.new_tokens // 2
    for batch in args.batches:
        kv = batch * kv_bytes_per_step(cfg, ctx, args.kv_cache_dtype)
        roof = {}
        for fmt in FORMATS:
            wbytes = weight_bytes_per_step(cfg, batch, fmt)
            raw[f"roofline_{fmt}_b{batch}"] = {"weight_bytes": wbytes, "kv_bytes": kv}
            if copy_bw:
                roof[fmt] = 1e3 * (wbytes + kv) / copy_bw
                note = f"roofline: {wbytes / 1e9:.2f} GB weights + {kv / 1e6:.1f} MB KV"
                name = f"decode step, batch {batch}, {fmt} weights"
                rows.append(result(name, steps[fmt][batch], "ms", roof[fmt], 2.0, "<=", note))
        note = "stored FP8/FP4 weights vs bf16 dequantised at load"
        if roof:
            note += f"; rooflines {roof['native']:.3f} vs {roof['dequantized']:.3f} ms"
        name = f"decode step, batch {batch}, native vs dequantized"
        native, dense = steps["native"][batch], steps["dequantized"][batch]
        rows.append(result(name, native, "ms", dense, 1.0, "<=", note))
    return rows, raw


def run(args) -> None:
    """Runs the comparison and writes the results file (args: decode.py's parse_args(); its
    main calls this with --quantize)."""
    if args.model == "/tmp/dsv4-mini":
        args.model = f"/tmp/{args.preset}-{args.quantize.replace('+', '-')}"
    cuda = torch.cuda.is_available()
    if not os.path.exists(os.path.join(args.model, "config.json")):
        from dsv4ray.model.tiny import make_tiny

        make_tiny(args.model, args.preset, seed=0, device="cuda" if cuda else "cpu",
                  quantize=args.quantize)  # fmt: skip
    cfg = ModelConfig.from_hf(args.model)
    if cfg.quantization is None:
        raise SystemExit(f"--quantize: {args.model} is not a quantized checkpoint")
    copy_bw = ceilings()["copy"] if cuda else None
    steps = {fmt: _steps_ms(args, fmt) for fmt in FORMATS}
    rows, raw = _rows(args, cfg, copy_bw, steps)
    device = torch.cuda.get_device_name() if cuda else "cpu"
    ceil = {}
    if cuda:
        ceil["device copy"] = {"value": copy_bw / 1e9, "unit": "GB/s", "note": "read + write"}
    note = (f"{args.preset} in the {args.quantize} release layout, {args.kv_cache_dtype} pages, "
            f"bf16 compute, prompts {args.prompt_len}, {args.new_tokens} new tokens, "
            f"cuda_graphs={not args.eager}, raw: {json.dumps(raw)}")  # fmt: skip
    settings = {"name": "settings", "value": None, "unit": "", "ceiling": None, "ratio": None,
                "op": ">=", "target": None, "note": note}  # fmt: skip
    print(save_results(args, "decode-quantized", device, ceil, rows + [settings]))
