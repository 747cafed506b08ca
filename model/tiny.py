"""Tiny random checkpoints for tests and benchmarks: ``make_tiny(out_dir, preset, seed, **kw)``.

Writes ``config.json`` (official keys), ``model.safetensors`` (official names, ``mtp.0.*``
included) and a byte-level tokenizer. With ``quantize`` ("fp8" or "fp8+fp4-experts") the weights
are written as the release stores them instead (``dsv4ray.model.release``): FP8 block-quantised
linears with their scales, FP4 or FP8 experts, bf16 exceptions, sharded with an index, and a
``quantization_config`` in ``config.json``; the config's ``torch_dtype`` (the compute dtype the
engine picks by default) stays the preset's. Every tensor that transformers' init leaves constant
(sinks, position biases, router biases, hash tables, mHC base/scale, norm weights) is randomised,
and the lm head is scaled so the mean top-1 probability on random prompts is about 0.3: KL gates
on near-uniform distributions could not fail.
"""

from __future__ import annotations

import json
import logging
import os

import torch

from dsv4ray.config import ModelConfig
from dsv4ray.model.mtp import MTPBlock
from dsv4ray.model.reference import DSV4Reference
from dsv4ray.model.release import release_quant_fields, release_tensors, save_sharded
from dsv4ray.model.weights import save_state
from dsv4ray.text.tokenizer_files import write_byte_tokenizer

log = logging.getLogger("dsv4ray.model")

_YARN = {
    "type": "yarn",
    "factor": 16,
    "original_max_position_embeddings": 65536,
    "beta_fast": 32,
    "beta_slow": 1,
}
PRESETS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=512,
        hidden_size=256,
        num_hidden_layers=6,
        num_attention_heads=4,
        head_dim=512,
        qk_rope_head_dim=64,
        q_lora_rank=128,
        o_groups=2,
        o_lora_rank=64,
        hc_mult=2,
        index_n_heads=16,
        index_head_dim=128,
        index_topk=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        num_hash_layers=2,
        compress_ratios=[0, 4, 128, 4, 4, 128, 0],
        torch_dtype="float32",
        rope_scaling=_YARN,
    ),
    "dsv4-mini": dict(
        vocab_size=129280,
        hidden_size=4096,
        num_hidden_layers=4,
        num_attention_heads=64,
        head_dim=512,
        qk_rope_head_dim=64,
        q_lora_rank=1024,
        o_groups=8,
        o_lora_rank=1024,
        hc_mult=4,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=512,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=2048,
        num_hash_layers=1,
        compress_ratios=[0, 4, 128, 4, 0],
        torch_dtype="bfloat16",
        rope_scaling=_YARN,
    ),
}
TARGET_TOP1 = 0.3


def tiny_config(preset: str = "tiny", **overrides) -> ModelConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    raw = {**PRESETS[preset], **overrides}
    return ModelConfig.from_hf(raw)


def make_tiny(
    out_dir: str,
    preset: str = "tiny",
    seed: int = 0,
    device: str = "cpu",
    quantize: str | None = None,
    **config_overrides,
) -> str:
    """Writes a random checkpoint to ``out_dir`` and returns the path."""
    if quantize is not None:
        config_overrides = {**config_overrides, **release_quant_fields(quantize)}
    cfg = tiny_config(preset, **config_overrides)
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, cfg.torch_dtype)
    model = DSV4Reference(cfg, torch.float32)
    if cfg.mtp_layer is not None:
        model.mtp.append(MTPBlock(cfg))
    randomise(model, gen)
    model = model.to(device)
    calibrate_head(model, gen)
    os.makedirs(out_dir, exist_ok=True)
    if cfg.quantization is None:
        save_state({k: _disk(v, dtype) for k, v in model.state_dict().items()}, out_dir)
    else:
        save_sharded(release_tensors(model.state_dict(), cfg.quantization), out_dir)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg.to_official_dict(), f, indent=2)
    write_byte_tokenizer(out_dir)
    log.info("wrote %s checkpoint (seed %d, %s) to %s", preset, seed, quantize, out_dir)
    return out_dir


def _disk(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.detach().cpu().to(dtype) if t.is_floating_point() else t.detach().cpu()


@torch.no_grad()
def randomise(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Random values for every parameter and buffer, scaled so activations stay O(1)."""
    num_experts = model.cfg.n_routed_experts
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("tid2eid"):
            rows = [
                torch.randperm(num_experts, generator=gen)[: p.shape[1]] for _ in range(p.shape[0])
            ]
            p.copy_(torch.stack(rows))
        else:
            p.copy_(_random_like(name, p, gen))


def _random_like(name: str, p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    def normal(std, mean=0.0):
        return torch.randn(p.shape, generator=gen) * std + mean

    if name.endswith("norm.weight"):
        return normal(0.1, 1.0)
    if name.endswith("attn_sink"):
        return normal(1.0)
    if name.endswith("ape"):
        return normal(0.5)
    if name.endswith("gate.bias"):
        return normal(0.1)
    if name.endswith("_scale"):
        return torch.rand(p.shape, generator=gen) + 0.5
    if name.endswith("_base"):
        return normal(0.5)
    if name.endswith("_fn"):
        return normal(0.02)
    if name == "embed.weight":
        return normal(1.0)
    fan_in = p.shape[-1] ** -0.5
    if name.endswith(("wo_b.weight", "w2.weight")):
        # Sub-block outputs well below the residual (as in trained models): a random deep
        # network with unit-gain outputs amplifies tiny perturbations, so lossy KV formats would
        # flip its argmax far more often than they flip a trained model's.
        return normal((0.2 if name.endswith("wo_b.weight") else 0.3) * fan_in)
    if name.endswith("ffn.gate.weight"):
        return normal(0.1 * fan_in)  # router margins that KV rounding does not flip
    return normal(fan_in)  # other linear weights: unit-gain fan-in init


@torch.no_grad()
def calibrate_head(model: DSV4Reference, gen: torch.Generator) -> float:
    """Scales ``head.weight`` so the mean top-1 probability on random prompts is TARGET_TOP1."""
    prompts = torch.randint(2, min(model.cfg.vocab_size, 258), (2, 48), generator=gen)
    logits = model(prompts.to(model.device))
    lo, hi = 0.01, 100.0
    for _ in range(40):
        mid = (lo * hi) ** 0.5
        top1 = torch.softmax(logits * mid, dim=-1).amax(-1).mean().item()
        lo, hi = (mid, hi) if top1 < TARGET_TOP1 else (lo, mid)
    model.head.weight.mul_(lo)
    return lo
