"""Trains a small DSV4 of the ``tiny`` family on byte tokens: ``train(cfg, corpus, out_dir)``.

The training forward is the reference's own layer code with autograd: ``run_layers`` from an
empty state over the whole row (what ``DSV4Reference.forward`` runs under no_grad), ``logits``,
and the MTP block's ``draft`` on the pre-head stack h [B, T, hc, hidden] at positions 0..T-1 with
the tokens at positions 1..T, predicting the tokens at 2..T+1. Loss = CE(main) + mtp_weight *
CE(MTP) (DeepSeek's MTP loss with one depth). Gradients flow from the MTP loss into the shared
embedding, the shared head and the main layers.

Parts without a gradient: the lightning indexers (top-k selection is a sort) keep their random
init; hash-layer expert tables stay as drawn (fixed routing by design); the score-routed gates'
biases, which only choose experts, follow the auxiliary-loss-free balancing rule: after each step
every bias moves by ``bias_update_rate`` towards under-loaded experts (sign of mean load - load).
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from dsv4ray.model.layers.moe import Gate
from dsv4ray.model.loader import load_reference
from dsv4ray.model.mtp import MTPBlock
from dsv4ray.model.reference import DSV4Reference
from dsv4ray.model.tiny import randomise, tiny_config
from dsv4ray.model.weights import save_state
from dsv4ray.text.tokenizer_files import write_byte_tokenizer
from dsv4ray.training.corpus import Corpus, eval_windows, sample_batch

log = logging.getLogger("dsv4ray.train")

# The `tiny` preset (ratios [0, 4, 128, 4, 4, 128] + a window-only MTP layer, hc_mult 2, 2 hash
# MoE layers then score-routed ones, vocab 512) narrowed so the checkpoint is a few MB; its depth
# is TrainConfig.num_layers, the ratio pattern repeated.
TRAINED_SHAPE = dict(
    hidden_size=128,
    num_attention_heads=2,
    q_lora_rank=64,
    o_lora_rank=32,
    index_n_heads=8,
    moe_intermediate_size=64,
)
RATIO_PATTERN = (0, 4, 128, 4, 4, 128)
LN2 = math.log(2.0)


def trained_overrides(num_layers: int) -> dict:
    """The `tiny` preset's overrides of a trained model of num_layers layers."""
    ratios = [RATIO_PATTERN[i % len(RATIO_PATTERN)] for i in range(num_layers)]
    return {**TRAINED_SHAPE, "num_hidden_layers": num_layers, "compress_ratios": [*ratios, 0]}


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    steps: int = 2000
    batch_size: int = 32
    seq_len: int = 512
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_weight: float = 0.3
    bias_update_rate: float = 1e-3
    log_every: int = 50
    eval_windows: int = 256
    eval_batch: int = 32
    device: str = "cpu"
    num_layers: int = 6  # the ratio pattern repeated; 2 or more, so a C4 layer feeds top-k

    def __post_init__(self) -> None:
        if self.num_layers < 2:
            raise ValueError(f"TrainConfig.num_layers must be >= 2, got {self.num_layers}")
        for name in ("steps", "batch_size", "seq_len", "log_every", "eval_windows", "eval_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"TrainConfig.lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"TrainConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.mtp_weight < 0:
            raise ValueError(f"TrainConfig.mtp_weight must be >= 0, got {self.mtp_weight}")

    @property
    def autocast(self) -> bool:
        """bf16 autocast on GPUs; CPU runs stay fp32 (and bit-reproducible)."""
        return torch.device(self.device).type == "cuda"


def build_model(seed: int, device: str = "cpu", num_layers: int = 6) -> DSV4Reference:
    """The random-init model (fp32 master weights) with its MTP block."""
    cfg = tiny_config("tiny", **trained_overrides(num_layers))
    model = DSV4Reference(cfg, torch.float32)
    model.mtp.append(MTPBlock(cfg))
    randomise(model, torch.Generator().manual_seed(seed))
    return model.to(device)


def training_logits(model: DSV4Reference, tokens: torch.Tensor):
    """tokens [B, T + 2] -> (main logits [B, T, V] for tokens 1..T, MTP logits [B, T, V] for
    tokens 2..T+1), both fp32, through the reference's layer code with autograd."""
    inputs, nxt = tokens[:, :-2], tokens[:, 1:-1]
    batch, seq_len = inputs.shape
    positions = torch.arange(seq_len, device=tokens.device)
    state = model.new_state(batch)
    h, topk = model.run_layers(model.embed_tokens(inputs), inputs, positions, state)
    main = model.logits(h)
    mtp = model.draft_block
    mtp_logits, _ = mtp.draft(
        h, model.embed(nxt), model.head.weight, nxt, positions, mtp.new_state(batch), topk
    )
    return main, mtp_logits


def token_losses(model: DSV4Reference, tokens: torch.Tensor):
    """Per-token cross-entropies (nats) [B, T] and hits [B, T] of the main and MTP heads."""
    main, mtp = training_logits(model, tokens)
    out = []
    for logits, target in ((main, tokens[:, 1:-1]), (mtp, tokens[:, 2:])):
        ce = F.cross_entropy(logits.float().transpose(1, 2), target, reduction="none")
        out.append((ce, logits.argmax(-1) == target))
    return out


class BiasBalancer:
    """Counts the experts each score-routed gate picks during a step, then nudges the biases."""

    def __init__(self, model: torch.nn.Module, rate: float) -> None:
        self.rate = rate
        self.gates = [m for m in model.modules() if isinstance(m, Gate) and not m.hashed]
        self.loads = {id(g): torch.zeros_like(g.bias) for g in self.gates}
        for gate in self.gates:
            gate.register_forward_hook(self._count)

    def _count(self, gate, _inputs, output) -> None:
        if torch.is_grad_enabled():  # training forwards only, not evaluation
            ids = output[1].reshape(-1)
            self.loads[id(gate)] += torch.bincount(ids, minlength=gate.bias.numel()).float()

    @torch.no_grad()
    def update(self) -> None:
        for gate in self.gates:
            load = self.loads[id(gate)]
            gate.bias += self.rate * torch.sign(load.mean() - load)
            load.zero_()


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup, then cosine decay toward min_lr_ratio * lr, which step ``steps`` (one
    past the last) would take."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if name.endswith("gate.bias"):
            continue  # moved by BiasBalancer, not by gradients
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def _autocast(cfg: TrainConfig):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=cfg.autocast)


def train_step(model, opt, balancer, tokens, cfg: TrainConfig, step: int) -> tuple[float, float]:
    """One optimizer step on tokens [B, T + 2]; returns (main CE, MTP CE) in nats."""
    for group in opt.param_groups:
        group["lr"] = lr_at(cfg, step)
    with _autocast(cfg):
        (main_ce, _), (mtp_ce, _) = token_losses(model, tokens)
    main_loss, mtp_loss = main_ce.mean(), mtp_ce.mean()
    opt.zero_grad(set_to_none=True)
    (main_loss + cfg.mtp_weight * mtp_loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    balancer.update()
    return main_loss.item(), mtp_loss.item()


@torch.no_grad()
def evaluate(model: DSV4Reference, windows: torch.Tensor, cfg: TrainConfig) -> dict[str, float]:
    """Bits per byte and next-byte accuracy of the main head (token t+1) and the MTP head
    (token t+2) over windows [n, T + 2]."""
    sums = torch.zeros(4, dtype=torch.float64)
    count = 0
    for chunk in windows.split(cfg.eval_batch):
        with _autocast(cfg):
            (main_ce, main_hit), (mtp_ce, mtp_hit) = token_losses(model, chunk.to(cfg.device))
        parts = (main_ce.sum(), main_hit.sum(), mtp_ce.sum(), mtp_hit.sum())
        sums += torch.tensor([float(p) for p in parts], dtype=torch.float64)
        count += main_ce.numel()
    main_bpb, main_acc, mtp_bpb, mtp_acc = (sums / count).tolist()
    return {
        "main_bits_per_byte": main_bpb / LN2,
        "main_accuracy": main_acc,
        "mtp_bits_per_byte": mtp_bpb / LN2,
        "mtp_accuracy": mtp_acc,
        "eval_tokens": count,
    }


def train(
    cfg: TrainConfig,
    corpus: Corpus,
    out_dir: str | None = None,
    log_line: Callable[[str], None] = print,
) -> tuple[DSV4Reference, dict]:
    """Trains from ``build_model(cfg.seed)``; saves to ``out_dir`` when given. Returns the model
    and a summary (config, corpus sizes, losses, held-out figures)."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.seed, cfg.device, cfg.num_layers).train()
    opt, balancer = make_optimizer(model, cfg), BiasBalancer(model, cfg.bias_update_rate)
    gen = torch.Generator().manual_seed(cfg.seed)
    windows = eval_windows(corpus.held_out, cfg.eval_windows, cfg.seq_len)
    losses, start = [], time.perf_counter()
    for step in range(cfg.steps):
        batch = sample_batch(corpus.train, cfg.batch_size, cfg.seq_len, gen).to(cfg.device)
        losses.append(train_step(model, opt, balancer, batch, cfg, step))
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            log_line(_progress(cfg, step, losses, time.perf_counter() - start))
    model.eval()
    summary = _summary(cfg, corpus, losses, time.perf_counter() - start)
    summary["held_out_fp32_master"] = evaluate(model, windows, cfg)
    log_line(_figures("held-out, fp32 master weights", summary["held_out_fp32_master"]))
    if out_dir is not None:
        save_checkpoint(model, out_dir, summary)
        saved = load_reference(out_dir, torch.float32, cfg.device)
        summary["held_out"] = evaluate(saved, windows, cfg)
        log_line(_figures("held-out, saved checkpoint", summary["held_out"]))
        _write_summary(out_dir, summary)
    return model, summary


def _progress(cfg: TrainConfig, step: int, losses, elapsed: float) -> str:
    recent = losses[-cfg.log_every :]
    main = sum(m for m, _ in recent) / len(recent)
    mtp = sum(t for _, t in recent) / len(recent)
    rate = (step + 1) * cfg.batch_size * cfg.seq_len / elapsed
    return (
        f"step {step + 1}/{cfg.steps}  loss {main / LN2:.3f} bits/byte  mtp {mtp / LN2:.3f}  "
        f"lr {lr_at(cfg, step):.2e}  {rate:,.0f} tok/s  {elapsed:.0f}s"
    )


def _figures(label: str, m: dict) -> str:
    return (
        f"{label}: main {m['main_bits_per_byte']:.3f} bits/byte, accuracy "
        f"{m['main_accuracy']:.3f}; mtp (t+2) {m['mtp_bits_per_byte']:.3f} bits/byte, "
        f"accuracy {m['mtp_accuracy']:.3f} ({m['eval_tokens']} bytes)"
    )


def _summary(cfg: TrainConfig, corpus: Corpus, losses, elapsed: float) -> dict:
    return {
        "train_config": asdict(cfg),
        "model_overrides": trained_overrides(cfg.num_layers),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "corpus": {
            "root": corpus.root,
            "train_files": corpus.train.num_files,
            "train_bytes": corpus.train.num_bytes,
            "held_out_files": corpus.held_out.num_files,
            "held_out_bytes": corpus.held_out.num_bytes,
        },
        # as the last progress line logged them: means of the last log_every steps
        "final_train_loss_bits": [sum(v) / len(v) / LN2 for v in zip(*losses[-cfg.log_every :])],
        "final_train_loss_note": f"mean of the last {min(cfg.log_every, len(losses))} steps "
        "(main, MTP), as logged",
        "train_seconds": round(elapsed, 1),
    }


# Matrices of linear layers and the embedding are stored bf16 (the checkpoint stays a few MB);
# the tensors the network keeps in fp32 (norms, sinks, biases, mHC mixers, position biases) stay
# fp32. Loading casts every tensor to its compute dtype.


def save_checkpoint(model: DSV4Reference, out_dir: str, summary: dict) -> None:
    """config.json (official keys, compute dtype fp32), model.safetensors (official names),
    the byte tokenizer and training.json (the summary)."""
    os.makedirs(out_dir, exist_ok=True)
    tensors = {}
    for name, t in model.state_dict().items():
        t = t.detach().cpu()
        matrix = name.endswith(".weight") and t.dim() == 2
        tensors[name] = t.to(torch.bfloat16) if matrix else t
    save_state(tensors, out_dir)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(model.cfg.to_official_dict(), f, indent=2)
    write_byte_tokenizer(out_dir)
    _write_summary(out_dir, summary)


def _write_summary(out_dir: str, summary: dict) -> None:
    with open(os.path.join(out_dir, "training.json"), "w") as f:
        json.dump(summary, f, indent=2)
