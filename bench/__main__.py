"""python -m dsv4ray.bench <name> [args...]: run one benchmark (bench/<name>.py's main).

Without a name, or with --help, it lists the benchmarks. Nothing is imported before a name is
given: the benchmarks import torch, Ray or Triton at the top.
"""

from __future__ import annotations

import importlib
import sys
import textwrap

USAGE = "usage: python -m dsv4ray.bench <name> [args...]"
ABOUT = (
    "Runs bench/<name>.py's main with the remaining arguments (`<name> --help`: its options; "
    "`python bench/<name>.py` and `python -m dsv4ray.bench.<name>` do the same). A benchmark "
    "writes <benchmark>-<device>.json (PERF.md's format) to --out-dir, or to bench/results and "
    "then rebuilds bench/BENCHMARKS.md."
)
BENCHMARKS = {  # every module of bench/ with a main(argv=None) -> what it measures
    "autoscale": "a Serve app scaled from zero nodes and back on Ray's fake autoscaler (CPU)",
    "chaos": "one engine under greedy load while stage kills and poison requests land",
    "cpu": "engine decode on CPU against a bare loop over the reference",
    "decode": "decode and prefill on one GPU against transformers and rooflines (--quantize)",
    "hicache": "host tier: reload bandwidth, and TTFT of a host-tier hit vs a cold prefill",
    "hisparse": "HiSparse (C4 history in host memory) vs all on the device: speed, capacity",
    "http_fuzz": "thousands of malformed HTTP requests; none may hurt the server",
    "kernel_sweep": "tile sizes of the sparse attention, indexer and compress kernels",
    "kernels": "each kernel's bandwidth against copy ceilings measured in the same run",
    "mtp": "MTP drafts on the trained checkpoint: tokens per verification, batch-1 speed",
    "mtp_depth": "the draft layer's cost as the target deepens: steps with and without drafts",
    "native_kernels": "FP8 / FP4 kernels at V4-Flash's shapes vs cuBLAS bf16 and the copy ceiling",
    "paths": "every way to run a model next to the fast path, on one GPU",
    "pd": "prefill/decode disaggregation: TTFT with and without, KV transfer bandwidth",
    "pipeline": "pp=N against pp=1 (throughput, capacity); compiled graph vs plain calls",
    "profile_step": "a step's GPU time by kernel name: eager decode steps and one prefill",
    "quant_sweep": "tile shapes of the FP8 linear and the FP8 / FP4 grouped experts (one GPU)",
    "report": "rebuild bench/BENCHMARKS.md from bench/results/*.json",
    "routing": "prefix-aware routing across Serve replicas against power of two: hit rate, TTFT",
    "sampling": "the last stage's host costs (sampling, detokenisation, stops) vs old schemes",
    "serve_load": "N streaming clients over HTTP against the same engine called directly",
    "structured": "structured output's cost: free requests beside grammar-constrained ones",
}


def usage() -> str:
    width = max(map(len, BENCHMARKS)) + 2
    lines = [USAGE, "", *textwrap.wrap(ABOUT, 100), "", "benchmarks:"]
    lines += [f"  {name:<{width}}{text}" for name, text in BENCHMARKS.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0].replace("-", "_"), argv[1:]
    if name not in BENCHMARKS:
        print(f"{usage()}\n\nno benchmark {argv[0]!r}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"dsv4ray.bench.{name}")
    prog, sys.argv[0] = sys.argv[0], f"python -m dsv4ray.bench {name}"  # argparse's prog
    try:
        code = module.main(rest)
    finally:
        sys.argv[0] = prog
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
