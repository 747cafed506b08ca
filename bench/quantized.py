"""Decode with a release checkpoint's FP8 / FP4 weights kept on the GPU, against the same
checkpoint dequantised to bf16 at load (`python bench/decode.py --quantize fp8+fp4-experts`).

Makes the preset's checkpoint in the release layout when --model does not exist (dsv4-mini, or
dsv4-flash-layers: V4-Flash's per-layer shapes, --layers of them, written tensor by tensor on
the GPU), then in one run, for each --routing and for weight_format "dequantized" then "native":
the engine's decode step (bench/step_clock.py: median pure-decode step at the full batch) at each
batch. Routing: "router" is the checkpoint's own (random) router, which sends the tokens of a
random model to a few favoured experts; "hash" makes every layer a hash layer (`tid2eid`, a random
expert set per token id), which spreads random prompts over the experts as a trained router
spreads real text. The experts a step touches are measured, not assumed: the router's choices
for the prompts' tokens (hooks on every gate while they prefill) are drawn into batches of each
size, and the mean number of distinct experts a layer sees sets the roofline's expert bytes.
Rows: each step against its own roofline (weight bytes read per step in that format + KV bytes,
over the device copy ceiling) and native against dequantized. Prefill: tokens/s over
PREFILL_PROMPTS prompts of --prefill-len tokens in each format (with --fp8-prefill the native
engine quantises the FP8 linears' activations per 1 x 128 block, kernels/fp8_act.py), and its
accuracy against the dequantized engine, teacher-forced over ACCURACY_PROMPTS random prompts of
--prompt-len tokens: how often both rank the same token first at a position, and the mean
absolute difference of the logprob each gives the prompt's next token (prompt_logprobs; the
engine returns no full distributions, hence no KL here: tests/gpu/test_quantized_cuda.py has it).
Writes bench/results/decode-quantized[-<preset>]-<device>.json.

On a CPU machine it runs as a smoke check (`--preset tiny --batches 1,4`): no ceilings, no
roofline rows.
"""

from __future__ import annotations

import json
import os
import time

import torch

from dsv4ray import LLM, SamplingParams
from dsv4ray.bench.report import random_prompts, result, save_results
from dsv4ray.bench.roofline import ceilings, kv_bytes_per_step, weight_bytes_per_step
from dsv4ray.bench.step_clock import engine_decode_s
from dsv4ray.config import ModelConfig

FORMATS = ("dequantized", "native")
ROUTINGS = {"router": "the checkpoint's router", "hash": "token-id hash in every layer"}
DRAWS = 64  # batches drawn per size when counting touched experts
PREFILL_PROMPTS = 4
ACCURACY_PROMPTS = 4


def _checkpoint(args, routing: str) -> str:
    """The model path for `routing` (made when it does not exist)."""
    path = args.model
    if path == "/tmp/dsv4-mini":
        layers = f"-L{args.layers}" if args.layers else ""
        path = f"/tmp/{args.preset}-{args.quantize.replace('+', '-')}{layers}-{routing}"
    if not os.path.exists(os.path.join(path, "config.json")):
        from dsv4ray.model.tiny import make_tiny, tiny_config

        over = {"num_hidden_layers": args.layers} if args.layers else {}
        if routing == "hash":
            over["num_hash_layers"] = tiny_config(args.preset, **over).num_hidden_layers
        device = "cuda" if torch.cuda.is_available() else "cpu"
        make_tiny(path, args.preset, seed=0, device=device, quantize=args.quantize, **over)
    return path


def touched_experts(llm: LLM, prompts: list, batches: list[int]) -> dict[int, float]:
    """Mean distinct routed experts per MoE layer at each batch size: the gates' choices for the
    prompts' tokens (recorded while they prefill) drawn into DRAWS batches of each size."""
    chosen: dict[int, list[torch.Tensor]] = {}
    hooks = []
    for worker in llm.core.pipeline.workers:
        for name, block in worker.model.layers.items():
            record = lambda _m, _a, out, i=name: chosen.setdefault(i, []).append(out[1].cpu())  # noqa: E731
            hooks.append(block.ffn.gate.register_forward_hook(record))
    try:
        llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
    finally:
        for h in hooks:
            h.remove()
    gen = torch.Generator().manual_seed(0)
    out = {}
    for batch in batches:
        counts = []
        for ids in (torch.cat(v) for v in chosen.values()):
            for _ in range(DRAWS):
                rows = torch.randint(0, ids.shape[0], (batch,), generator=gen)
                counts.append(ids[rows].unique().numel())
        out[batch] = sum(counts) / len(counts)
    return out


def prefill_tok_s(llm: LLM, length: int) -> float:
    """Prefill tokens/s over PREFILL_PROMPTS prompts of `length` tokens (one token each)."""
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    llm.generate(random_prompts(1, length, seed=5), params)  # warm-up
    start = time.perf_counter()
    llm.generate(random_prompts(PREFILL_PROMPTS, length, seed=6), params)
    return PREFILL_PROMPTS * length / (time.perf_counter() - start)


def teacher_forced(llm: LLM, length: int) -> list[tuple[int, float]]:
    """(first-ranked token, logprob of the prompt's next token) at every position after the first
    of ACCURACY_PROMPTS random prompts, computed in their prefills."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    outs = llm.generate(random_prompts(ACCURACY_PROMPTS, length, seed=9), params)
    rows = []
    for out in outs:
        for entries in out.prompt_logprobs[1:]:
            first = next(tok for tok, _, rank in entries if rank == 1)
            rows.append((first, entries[0][1]))
    return rows


def accuracy(native: list, dense: list) -> dict:
    """Top-1 agreement and mean |logprob difference| of the native against the dequantized."""
    same = sum(a[0] == b[0] for a, b in zip(native, dense, strict=True))
    diff = sum(abs(a[1] - b[1]) for a, b in zip(native, dense, strict=True))
    return {"top1_agreement": same / len(dense), "mean_abs_logprob_diff": diff / len(dense),
            "positions": len(dense)}  # fmt: skip


def _steps_ms(args, path: str, fmt: str) -> dict:
    """{"steps": median decode step ms per batch, "touched": touched experts per batch (native
    only), "prefill_tok_s", "forced": `teacher_forced`} with `fmt`."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    longest = max(args.prompt_len + args.new_tokens, args.prefill_len)
    llm = LLM(path, device=device, kv_cache_dtype=args.kv_cache_dtype, weight_format=fmt,
              dtype="bfloat16", max_running_requests=max(args.batches), cuda_graphs=not args.eager,
              max_model_len=max(4096, longest + 8),
              max_num_batched_tokens=max(8192, args.prefill_len),
              fp8_prefill=args.fp8_prefill and fmt == "native")  # fmt: skip
    try:
        out = {"steps": {}, "touched": {}}
        for batch in args.batches:
            s = engine_decode_s(llm, batch, args.prompt_len, args.new_tokens, 10 * batch)
            out["steps"][batch] = 1e3 * s / args.new_tokens
            print(json.dumps({"weights": fmt, "batch": batch, "step_ms": out["steps"][batch]}),
                  flush=True)  # fmt: skip
        if fmt == "native":
            prompts = random_prompts(max(args.batches), args.prompt_len, seed=7)
            out["touched"] = touched_experts(llm, prompts, args.batches)
            print(json.dumps({"touched_experts_per_layer": out["touched"]}), flush=True)
        if args.prefill_len:
            out["prefill_tok_s"] = prefill_tok_s(llm, args.prefill_len)
            out["forced"] = teacher_forced(llm, args.prompt_len)
            print(json.dumps({"weights": fmt, "prefill_tok_s": out["prefill_tok_s"]}), flush=True)
        return out
    finally:
        llm.shutdown()


def _rows(args, cfg, copy_bw, steps, touched, routing: str) -> tuple[list, dict]:
    rows, raw = [], {"steps_ms": steps, "touched_experts_per_layer": touched}
    ctx = args.prompt_len + args.new_tokens // 2
    label = "" if routing == "router" else f", {routing} routing"
    for batch in args.batches:
        kv = batch * kv_bytes_per_step(cfg, ctx, args.kv_cache_dtype)
        roof = {}
        for fmt in FORMATS:
            wbytes = weight_bytes_per_step(cfg, batch, fmt, touched.get(batch))
            raw[f"roofline_{fmt}_b{batch}"] = {"weight_bytes": wbytes, "kv_bytes": kv}
            if copy_bw:
                roof[fmt] = 1e3 * (wbytes + kv) / copy_bw
                experts = f"{touched.get(batch, 0):.1f} of {cfg.n_routed_experts} experts a layer"
                note = f"roofline: {wbytes / 1e9:.2f} GB weights ({experts}) + {kv / 1e6:.1f} MB KV"
                name = f"decode step, batch {batch}, {fmt} weights{label}"
                rows.append(result(name, steps[fmt][batch], "ms", roof[fmt], 2.0, "<=", note))
        note = f"stored FP8/FP4 weights vs bf16 dequantised at load; routing: {ROUTINGS[routing]}"
        if roof:
            note += f"; rooflines {roof['native']:.3f} vs {roof['dequantized']:.3f} ms"
        target = 0.75 if batch == 1 else 0.6
        name = f"decode step, batch {batch}, native vs dequantized{label}"
        native, dense = steps["native"][batch], steps["dequantized"][batch]
        rows.append(result(name, native, "ms", dense, target, "<=", note))
    return rows, raw


def _prefill_rows(args, runs: dict, raw: dict, routing: str) -> list:
    """Native against dequantized prefill tokens/s (target >= 1.2x), with the accuracy figures."""
    if not args.prefill_len:
        return []
    native, dense = runs["native"]["prefill_tok_s"], runs["dequantized"]["prefill_tok_s"]
    acc = accuracy(runs["native"]["forced"], runs["dequantized"]["forced"])
    raw["prefill_tok_s"] = {"native": native, "dequantized": dense}
    raw["accuracy"] = acc
    label = "" if routing == "router" else f", {routing} routing"
    fp8 = "fp8_prefill: FP8 linears on FP8 activations (1 x 128 blocks)" if args.fp8_prefill \
        else "bf16 activations"  # fmt: skip
    note = (
        f"{PREFILL_PROMPTS} prompts of {args.prefill_len} tokens, {fp8}; teacher-forced against "
        f"the dequantized engine over "
        f"{acc['positions']} positions: top-1 agreement {acc['top1_agreement']:.3f}, mean "
        f"|logprob difference| of the next token {acc['mean_abs_logprob_diff']:.4f} nats"
    )
    size = f"{args.prefill_len // 1024}k" if args.prefill_len % 1024 == 0 else args.prefill_len
    name = f"prefill tokens/s, {size}-token prompts, native vs dequantized"
    return [result(name + label, native, "tok/s", dense, 1.2, ">=", note)]


def run(args) -> None:
    """Runs the comparison and writes the results file (args: decode.py's parse_args(); its
    main calls this with --quantize)."""
    cuda = torch.cuda.is_available()
    copy_bw = ceilings()["copy"] if cuda else None
    rows, raw = [], {}
    for routing in args.routing.split(","):
        path = _checkpoint(args, routing)
        cfg = ModelConfig.from_hf(path)
        if cfg.quantization is None:
            raise SystemExit(f"--quantize: {path} is not a quantized checkpoint")
        runs = {fmt: _steps_ms(args, path, fmt) for fmt in FORMATS}
        steps = {fmt: r["steps"] for fmt, r in runs.items()}
        more, raw[routing] = _rows(args, cfg, copy_bw, steps, runs["native"]["touched"], routing)
        rows += more + _prefill_rows(args, runs, raw[routing], routing)
    device = torch.cuda.get_device_name() if cuda else "cpu"
    ceil = {}
    if cuda:
        ceil["device copy"] = {"value": copy_bw / 1e9, "unit": "GB/s", "note": "read + write"}
    note = (f"{args.preset} ({cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts, "
            f"top-{cfg.num_experts_per_tok}) in the {args.quantize} release layout, "
            f"{args.kv_cache_dtype} pages, bf16 compute, prompts {args.prompt_len}, "
            f"{args.new_tokens} new tokens, cuda_graphs={not args.eager}, "
            f"raw: {json.dumps(raw)}")  # fmt: skip
    settings = {"name": "settings", "value": None, "unit": "", "ceiling": None, "ratio": None,
                "op": ">=", "target": None, "note": note}  # fmt: skip
    name = "decode-quantized" + ("" if args.preset == "dsv4-mini" else f"-{args.preset}")
    print(save_results(args, name, device, ceil, rows + [settings]))
