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
from dsv4ray.model.weights import clear_checkpoint, save_state
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
# V4-Flash's per-layer shapes (its attention is dsv4-mini's; 256 routed experts, top-6), C4 and
# C128 layers alternating, no MTP layer and no hash layers unless overridden. Written tensor by
# tensor on the device (`write_streamed`): a 4-layer fp32 model would take 100 GB of host memory.
PRESETS["dsv4-flash-layers"] = dict(
    PRESETS["dsv4-mini"],
    n_routed_experts=256,
    num_experts_per_tok=6,
    num_hash_layers=0,
    num_nextn_predict_layers=0,
    compress_ratios=None,
    compress_pattern=(4, 128),
)
STREAMED = ("dsv4-flash-layers",)
SHARD_BYTES = 4 << 30
TARGET_TOP1 = 0.3


def tiny_config(preset: str = "tiny", **overrides) -> ModelConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    base = PRESETS[preset]
    raw = {**base, **overrides}
    pattern = (
        raw.pop("compress_pattern", None) or base["compress_ratios"][: base["num_hidden_layers"]]
    )
    resized = any(
        raw.get(key, 1) != base.get(key, 1)
        for key in ("num_hidden_layers", "num_nextn_predict_layers")
    )
    if "compress_ratios" not in overrides and (base["compress_ratios"] is None or resized):
        # the layers cycle the preset's pattern; MTP layers attend densely
        layers = [pattern[i % len(pattern)] for i in range(raw["num_hidden_layers"])]
        raw["compress_ratios"] = layers + [0] * raw.get("num_nextn_predict_layers", 1)
    cfg = ModelConfig.from_hf(raw)
    # from_hf ignores keys it does not know (as a real config.json may hold): a misspelt
    # override would be dropped without a word
    unknown = sorted(set(overrides) - set(cfg.to_official_dict()) - {"compress_pattern"})
    if unknown:
        raise ValueError(f"unknown model option {unknown[0]!r} for the {preset!r} preset")
    return cfg


def make_tiny(
    out_dir: str,
    preset: str = "tiny",
    seed: int = 0,
    device: str = "cpu",
    quantize: str | None = None,
    **config_overrides,
) -> str:
    """Writes a random checkpoint to ``out_dir`` and returns the path (the STREAMED presets through
    `write_streamed` on ``device``)."""
    if quantize is not None:
        config_overrides = {**config_overrides, **release_quant_fields(quantize)}
    cfg = tiny_config(preset, **config_overrides)
    if preset in STREAMED:
        write_streamed(out_dir, cfg, seed, device)
        log.info("wrote %s checkpoint (seed %d, %s) to %s", preset, seed, quantize, out_dir)
        return out_dir
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


def write_streamed(out_dir: str, cfg: ModelConfig, seed: int, device: str) -> None:
    """A random checkpoint of any size, one tensor at a time: each is drawn on ``device`` with
    `randomise`'s scales, stored as the release stores it (or in the config's dtype) and appended
    to the current shard; a shard is written once it holds SHARD_BYTES. Host memory holds one
    shard, the device one tensor. The lm head keeps the fan-in scale (not calibrated: a forward
    pass would need the whole model), and hash tables are drawn as a batch of permutations."""
    with torch.device("meta"):
        model = DSV4Reference(cfg, torch.float32)
        if cfg.mtp_layer is not None:
            model.mtp.append(MTPBlock(cfg))
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, cfg.torch_dtype)
    os.makedirs(out_dir, exist_ok=True)
    clear_checkpoint(out_dir)  # in place of any checkpoint written there before
    shards: list[list[str]] = []
    shard: dict[str, torch.Tensor] = {}
    total = shard_bytes = 0
    for name, meta in model.state_dict().items():
        value = _random_streamed(name, meta, gen, cfg.n_routed_experts)
        stored = (
            release_tensors({name: value}, cfg.quantization)
            if cfg.quantization is not None
            else {name: _disk(value, dtype)}
        )
        shard.update(stored)
        size = sum(t.numel() * t.element_size() for t in stored.values())
        total, shard_bytes = total + size, shard_bytes + size
        if shard_bytes >= SHARD_BYTES:
            shards.append(_write_shard(out_dir, shard, len(shards), shard_bytes))
            shard, shard_bytes = {}, 0
    if shard:
        shards.append(_write_shard(out_dir, shard, len(shards), shard_bytes))
    _name_shards(out_dir, shards, total)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg.to_official_dict(), f, indent=2)
    write_byte_tokenizer(out_dir)


def _random_streamed(name: str, meta: torch.Tensor, gen: torch.Generator, num_experts: int):
    if name.endswith("tid2eid"):
        rows, k = meta.shape
        keys = torch.rand(rows, num_experts, generator=gen, device=gen.device)
        return keys.argsort(dim=1)[:, :k].contiguous()
    return _random_like(name, meta, gen)


def _write_shard(out_dir: str, shard: dict[str, torch.Tensor], index: int, size: int) -> list[str]:
    from safetensors.torch import save_file

    save_file(shard, os.path.join(out_dir, f".shard-{index}"), metadata={"format": "pt"})
    log.info("wrote shard %d: %d tensors, %.2f GiB", index + 1, len(shard), size / 2**30)
    return list(shard)


def _name_shards(out_dir: str, shards: list[list[str]], total: int) -> None:
    """Renames the written shards to model-0000i-of-0000n.safetensors and writes the index."""
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(os.path.join(out_dir, f".shard-{i}"), os.path.join(out_dir, file))
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)


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
        return torch.randn(p.shape, generator=gen, device=gen.device) * std + mean

    if name.endswith("norm.weight"):
        return normal(0.1, 1.0)
    if name.endswith("attn_sink"):
        return normal(1.0)
    if name.endswith("ape"):
        return normal(0.5)
    if name.endswith("gate.bias"):
        return normal(0.1)
    if name.endswith("_scale"):
        return torch.rand(p.shape, generator=gen, device=gen.device) + 0.5
    if name.endswith("_base"):
        return normal(0.5)
    if name.endswith("_fn"):
        return normal(0.02)
    if name == "embed.weight":
        return normal(1.0)
    if p.numel() == 0:  # e.g. no shared expert
        return torch.empty_like(p)
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
