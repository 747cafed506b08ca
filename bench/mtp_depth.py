"""How the draft layer's cost amortises as the target deepens: step times with and without drafts.

One draft layer costs the same whatever the target's depth, so the gain of speculation grows with
it. This runs random checkpoints of the trained checkpoint's shape (training/train.py's
``trained_overrides``) with L layers (the ratios [0, 4, 128, 4, 4, 128] repeated, a window-only
MTP layer), batch 1, greedy, k drafts, and times decode steps of each engine:

- plain step = decode time / decode tokens; step with drafts = decode time / verification steps
  (random weights accept few drafts, and a step's work does not depend on how many it accepts);
- projected batch-1 decode with drafts = T / (step with drafts), with T the mean tokens per
  verification step that bench/mtp.py measured on the trained checkpoint on this device (read
  from its results file), against 1 / (plain step).

The trained checkpoint itself is the first row (its measured acceptance, not a projection).
Writes bench/results/mtp-depth-<device>.json (PERF.md's format) and regenerates BENCHMARKS.md.

    python bench/mtp_depth.py [--depths 6 18] [--k 3] [--prompts 6] [--max-tokens 64]
"""

from __future__ import annotations

import json
import os
import tempfile

import torch

from dsv4ray.bench.mtp import ROOT, held_out_prompts, side_by_side
from dsv4ray.bench.report import RESULTS_DIR, bench_parser, device_slug, result, save_results
from dsv4ray.config import ModelConfig
from dsv4ray.entrypoints.llm import LLM
from dsv4ray.model.tiny import make_tiny
from dsv4ray.training.train import trained_overrides


def step_us(model: str, k: int, prompts: list, max_tokens: int, device: str) -> tuple:
    """(plain, with drafts) microseconds per decode step (per verification step with drafts),
    prefill excluded; both engines timed ``side_by_side`` (bench/mtp.py)."""
    llms = {}
    try:
        for kk in (0, k):
            llms[kk] = LLM(model, kv_cache_dtype="fp32", enable_prefix_caching=False,
                           speculative_num_steps=kk, use_ray=False, device=device)  # fmt: skip
        seconds, _, steps = side_by_side(llms, prompts, max_tokens)
    finally:
        for llm in llms.values():
            llm.shutdown()
    return tuple(seconds[kk] / steps[kk] * 1e6 for kk in (0, k))


def trained_tokens_per_step(device: str) -> float:
    """bench/mtp.py's mean tokens per verification step on this device."""
    path = RESULTS_DIR / f"mtp-{device_slug(device)}.json"
    if not path.exists():
        raise SystemExit(f"{path} is missing: run bench/mtp.py on this device first")
    rows = json.loads(path.read_text())["results"]
    return next(r["value"] for r in rows if r["name"] == "mean tokens per verification step")


def main(argv=None) -> None:
    parser = bench_parser(__doc__, device="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--depths", type=int, nargs="+", default=[6, 18])
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    tokens = trained_tokens_per_step(device)
    prompts = held_out_prompts(args.prompts, 128, args.max_tokens)
    trained = os.path.join(ROOT, "checkpoints", "stdlib-tiny")
    rows, ceilings = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        depth = ModelConfig.from_hf(trained).num_hidden_layers
        models = [(depth, trained, "the trained checkpoint")]
        for depth in args.depths:
            shape = trained_overrides(depth)
            path = make_tiny(os.path.join(tmp, f"L{depth}"), "tiny", 0, **shape)
            models.append((depth, path, f"random weights, ratios {shape['compress_ratios'][:-1]}"))
        for depth, path, what in models:
            plain, spec = step_us(path, args.k, prompts, args.max_tokens, args.device)
            note = (
                f"{depth} layers ({what}), k={args.k}, batch 1, {args.prompts} prompts of "
                f"128 tokens, fp32 pages; steps of {plain:.0f} us plain, {spec:.0f} us "
                f"with drafts; {tokens:.2f} tokens per verification step (bench/mtp.py)"
            )
            name = f"{depth}-layer target: projected batch-1 decode with drafts"
            ceilings[f"{depth}-layer target: batch-1 decode without drafts"] = {
                "value": 1e6 / plain,
                "unit": "tok/s",
                "note": note,
            }
            rows.append(result(name, tokens * 1e6 / spec, "tok/s", 1e6 / plain, 1.5, ">=", note))
            print(
                f"L={depth}: plain {plain:.0f} us/step, with drafts {spec:.0f} us/step; at "
                f"{tokens:.2f} tokens a step {tokens * plain / spec:.2f}x",
                flush=True,
            )
    path = save_results(args, "mtp-depth", device, ceilings, rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
