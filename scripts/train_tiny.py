r"""Trains the stdlib-tiny checkpoint on this Python's standard library sources.

    .venv/bin/python scripts/train_tiny.py --device cuda --num-layers 12 --batch-size 128 \
        --warmup-steps 50 --steps 520 --log-every 40 --out checkpoints/stdlib-tiny

(the committed checkpoint; checkpoints/stdlib-tiny/TRAINING.md gives the Python, torch and GPU).

``--probe K`` times K steps (after one warm-up step), prints the seconds per step and exits
without writing anything: size ``--steps`` from it, so the run itself is fixed by its step count.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

from dsv4ray.model.loader import load_reference
from dsv4ray.training.corpus import BOS_ID, BYTE_OFFSET, EOS_ID, load_corpus, sample_batch
from dsv4ray.training.train import (
    BiasBalancer,
    TrainConfig,
    build_model,
    make_optimizer,
    train,
    train_step,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", help="checkpoint folder to write (omit for a dry run)")
    p.add_argument("--root", default=None, help="source tree (default: this Python's stdlib)")
    p.add_argument("--probe", type=int, default=0, help="time this many steps and exit")
    p.add_argument("--sample", action="append", default=[], help="prompt to continue greedily")
    p.add_argument("--sample-tokens", type=int, default=200)
    for f in dataclasses.fields(TrainConfig):
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    return p.parse_args(argv)


def probe(cfg: TrainConfig, corpus, num_steps: int) -> float:
    """Seconds per training step (a throwaway model; the first step is not timed)."""
    model = build_model(cfg.seed, cfg.device, cfg.num_layers)
    opt, balancer = make_optimizer(model, cfg), BiasBalancer(model, cfg.bias_update_rate)
    gen = torch.Generator().manual_seed(cfg.seed)
    batches = [sample_batch(corpus.train, cfg.batch_size, cfg.seq_len, gen) for _ in range(2)]
    train_step(model, opt, balancer, batches[0].to(cfg.device), cfg, 0)
    _sync(cfg.device)
    start = time.perf_counter()
    for step in range(num_steps):
        train_step(model, opt, balancer, batches[1].to(cfg.device), cfg, step + 1)
    _sync(cfg.device)
    return (time.perf_counter() - start) / num_steps


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> int:
    args = parse_args(argv)
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    cfg = TrainConfig(**{n: getattr(args, n) for n in names})
    # on CPU too: on several threads the compressor's position-bias gradient (an indexed
    # accumulation) sums in a different order from run to run otherwise
    torch.use_deterministic_algorithms(True, warn_only=True)
    if torch.device(cfg.device).type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cuda.matmul.allow_tf32 = True  # the attention's fp32 einsums
    corpus = load_corpus(args.root)
    print(
        f"corpus {corpus.root}: {corpus.train.num_files} training files "
        f"({corpus.train.num_bytes:,} bytes), {corpus.held_out.num_files} held out "
        f"({corpus.held_out.num_bytes:,} bytes); Python {sys.version.split()[0]}",
        flush=True,
    )
    if args.probe:
        print(f"probe: {probe(cfg, corpus, args.probe):.4f} s/step", flush=True)
        return 0
    model, _ = train(cfg, corpus, args.out, log_line=lambda line: print(line, flush=True))
    if args.out is not None:
        model = load_reference(args.out, torch.float32, cfg.device)
    for prompt in args.sample:
        print(f"greedy from {prompt!r}:\n{sample(model, prompt, args.sample_tokens)}", flush=True)
    return 0


def sample(model, prompt: str, num_tokens: int) -> str:
    """Prompt + its greedy continuation (bos first, as the tokenizer adds it), as text."""
    ids = [BOS_ID] + [b + BYTE_OFFSET for b in prompt.encode()]
    out = model.greedy(ids, num_tokens)
    if EOS_ID in out:
        out = out[: out.index(EOS_ID)]
    data = bytes(t - BYTE_OFFSET for t in out if BYTE_OFFSET <= t < BYTE_OFFSET + 256)
    return prompt + data.decode(errors="replace")


if __name__ == "__main__":
    sys.exit(main())
