"""Ceilings measured on the GPU and the bytes and FLOPs a decode or prefill step must move.

Weight bytes of a decode step at batch B: every non-expert matrix of the layers, the lm head and
the hc head once, B embedding rows, and per MoE layer the routed experts that B tokens touch on
average under uniform routing, E * (1 - (1 - k/E)^B), plus the shared expert; in bf16, or with
weight_format "native" in the formats a release checkpoint stores them (FP8, FP4, bf16). KV bytes
of one request at context L per layer: the 128-entry window, then for C4 layers min(topk, L/4)
entries (and L/4 indexer keys where the layer runs the indexer), for C128 layers L/128 entries.
"""

from __future__ import annotations

import torch

from dsv4ray.cache.page_layout import layout_for
from dsv4ray.config import ModelConfig
from dsv4ray.config_quant import FP4_GROUP
from dsv4ray.model.release import release_format
from dsv4ray.model.stage import StageModel


def ceilings(size_bytes: int = 2 << 30, n: int = 8192) -> dict:
    """{"copy": device copy B/s (read + write), "matmul": bf16 FLOP/s}, medians of 10 runs."""
    a = torch.randn(size_bytes // 4, device="cuda")
    b = torch.empty_like(a)
    copy_s = median_s(lambda: b.copy_(a))
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    mm_s = median_s(lambda: x @ y)
    return {"copy": 2 * size_bytes / copy_s, "matmul": 2 * n**3 / mm_s}


def median_s(fn, reps: int = 10) -> float:
    """Median seconds of fn on the device (events), after one untimed call."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[reps // 2]


def _param_groups(cfg: ModelConfig, weight_format: str = "count") -> dict:
    """Parameter counts of the model by group ("count"), or the bytes a decode step reads of them:
    2 per value ("dequantized": bf16), except, with "native", the weights a release checkpoint
    stores quantised (FP8: 1 byte plus the value's share of its block scale; FP4: half a byte plus
    a ue8m0 byte per 32 values). Norms and mixers count 2 bytes either way."""
    with torch.device("meta"):
        model = StageModel(cfg)
    groups = {"embed": 0, "head": 0, "expert": 0, "other": 0}
    for name, p in model.named_parameters():
        size = p.numel() * _bytes_per_value(name, p, cfg, weight_format)
        if name.startswith("embed."):
            groups["embed"] += size
        elif name.startswith("head."):
            groups["head"] += size
        elif ".ffn.experts." in name:
            groups["expert"] += size
        else:
            groups["other"] += size
    return groups


def _bytes_per_value(name: str, p: torch.Tensor, cfg: ModelConfig, weight_format: str) -> float:
    if weight_format == "count":
        return 1
    quant = cfg.quantization
    fmt = release_format(name, p, quant) if weight_format == "native" and quant else "bf16"
    if fmt == "fp4":
        return 0.5 + 1 / FP4_GROUP
    if fmt == "fp8":
        scale = 1 if quant.scale_fmt == "ue8m0" else 4
        return 1 + scale / (quant.weight_block_size[0] * quant.weight_block_size[1])
    return 2


def weight_bytes_per_step(
    cfg: ModelConfig, batch: int, weight_format: str = "dequantized", touched: float | None = None
):
    """Weight bytes a decode step at `batch` reads (bf16, or the stored formats with "native"),
    with `touched` routed experts a layer (default: the mean under uniform routing)."""
    g = _param_groups(cfg, weight_format)
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    if touched is None:
        touched = e * (1 - (1 - k / e) ** batch)
    embed_rows = batch * cfg.hidden_size * 2
    return g["other"] + g["head"] + g["expert"] * touched / e + embed_rows


def kv_bytes_per_step(cfg: ModelConfig, context: int, kv_dtype: str) -> float:
    """KV bytes one request reads per decode step at `context` tokens."""
    entry = {kind: layout_for(kind, kv_dtype).bytes_per_entry
             for kind in ("window", "c4", "c128", "indexer")}  # fmt: skip
    total = 0.0
    for spec in cfg.layers[: cfg.num_hidden_layers]:
        total += min(128, context) * entry["window"]
        if spec.compress_ratio == 4:
            total += min(cfg.index_topk, context // 4) * entry["c4"]
            if not spec.skip_topk:
                total += (context // 4) * entry["indexer"]
        elif spec.compress_ratio == 128:
            total += (context // 128) * entry["c128"]
    return total


def active_params(cfg: ModelConfig) -> float:
    """Parameters one token multiplies by, without the embedding and the lm head."""
    g = _param_groups(cfg)
    routed = g["expert"] * cfg.num_experts_per_tok / cfg.n_routed_experts
    return g["other"] + routed
