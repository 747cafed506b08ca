"""Writing a state dict in the layout of the published DeepSeek-V4 checkpoints.

Per tensor (official names):

- float8_e4m3fn with a ``scale`` per 128x128 block: attention wq_a, wq_b, wkv, wo_a, wo_b, the
  indexer's wq_b, the shared experts, the MTP block's e_proj / h_proj, and the routed experts
  ``experts.E.w{1,2,3}`` unless ``expert_dtype`` is "fp4": then packed e2m1 int8 with a ue8m0
  ``scale`` per 32 values of a row;
- bfloat16: compressor and indexer-compressor wkv / wgate, the indexer's weights_proj, the router's
  ``gate.weight``, embed, head and the norms;
- float32: attn_sink, ape, the router's ``gate.bias`` and the hc_* mixers; int64: ``tid2eid``.

Shards are ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import math
import os
import re

import torch

from dsv4ray.config import QuantConfig
from dsv4ray.config_quant import RELEASE_LAYOUTS
from dsv4ray.model.quant import quantize_fp4, quantize_fp8
from dsv4ray.model.weights import clear_checkpoint

_EXPERT = re.compile(r"(^|\.)experts\.\d+\.w[123]\.weight$")
_BF16_LINEAR = re.compile(
    r"(^embed\.weight|^head\.weight|\.compressor\.(wkv|wgate)\.weight|"
    r"\.indexer\.weights_proj\.weight|\.ffn\.gate\.weight)$"
)
_FP32 = re.compile(r"(attn_sink|\.ape|\.gate\.bias|hc_(attn|ffn|head)_(fn|base|scale))$")


def release_quant_fields(quantize: str) -> dict:
    """Config keys of a release checkpoint in one of ``RELEASE_LAYOUTS``."""
    if quantize not in RELEASE_LAYOUTS:
        raise ValueError(f"quantize must be one of {list(RELEASE_LAYOUTS)}, got {quantize!r}")
    scale_fmt, expert_dtype = RELEASE_LAYOUTS[quantize]
    return {
        "quantization_config": QuantConfig(scale_fmt=scale_fmt).to_dict(),
        "expert_dtype": expert_dtype,
    }


def release_format(name: str, tensor: torch.Tensor, quant: QuantConfig) -> str:
    """One of "int", "fp32", "bf16", "fp8", "fp4" for the tensor ``name``."""
    if not tensor.is_floating_point():
        return "int"
    if _FP32.search(name):
        return "fp32"
    if tensor.ndim != 2 or not name.endswith(".weight") or _BF16_LINEAR.search(name):
        return "bf16"
    return quant.expert_dtype if _EXPERT.search(name) else "fp8"


def release_tensors(state: dict[str, torch.Tensor], quant: QuantConfig) -> dict[str, torch.Tensor]:
    """Official-name state dict -> the tensors a release checkpoint stores (scales included), on
    the host; the quantisation runs on each tensor's device."""
    out = {}
    for name, tensor in state.items():
        tensor = tensor.detach()
        fmt = release_format(name, tensor, quant)
        scale_name = name[: -len(".weight")] + ".scale"
        if fmt == "fp8":
            out[name], out[scale_name] = quantize_fp8(
                tensor, quant.weight_block_size, quant.scale_fmt
            )
        elif fmt == "fp4":
            out[name], out[scale_name] = quantize_fp4(tensor)
        elif fmt == "int":
            out[name] = tensor.to(torch.int64)
        else:
            out[name] = tensor.to(torch.float32 if fmt == "fp32" else torch.bfloat16)
    return {name: t.cpu() for name, t in out.items()}


def save_sharded(tensors: dict[str, torch.Tensor], path: str, num_shards: int = 4) -> None:
    """Contiguous runs of tensors (in the given order) into ``num_shards`` files of similar
    size, plus the index that maps every tensor to its file."""
    from safetensors.torch import save_file

    clear_checkpoint(path)  # in place of any checkpoint written there before
    sizes = {k: v.numel() * v.element_size() for k, v in tensors.items()}
    total = sum(sizes.values())
    per_shard = math.ceil(total / num_shards)
    groups: list[list[str]] = [[]]
    filled = 0
    for name in tensors:
        if filled >= per_shard * len(groups) and len(groups) < num_shards:
            groups.append([])
        groups[-1].append(name)
        filled += sizes[name]
    weight_map = {}
    for i, names in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {k: tensors[k].contiguous() for k in names}
        save_file(shard, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
