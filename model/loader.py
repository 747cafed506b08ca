"""Building modules from a checkpoint: the whole reference, or one pipeline stage's slice.

Parameters are given their final dtypes while still on the meta device and only then allocated,
and checkpoint tensors are read (and dequantised) one at a time, so loading a stage holds the
stage's own parameters plus one checkpoint tensor: never another stage's layers, never a second
copy of the stage.
"""

from __future__ import annotations

import functools
import logging

import torch

from dsv4ray.config import ModelConfig
from dsv4ray.model.layers.moe import MoE
from dsv4ray.model.layers.quant_linear import QuantLinear
from dsv4ray.model.mtp import DraftModel, MTPBlock
from dsv4ray.model.reference import DSV4Reference
from dsv4ray.model.stage import StageModel
from dsv4ray.model.weights import (
    CheckpointError,
    checkpoint_index,
    has_mtp,
    iter_tensors,
    load_state,
    quantized_weights,
)

log = logging.getLogger("dsv4ray.model")

WEIGHT_FORMATS = ("dequantized", "native")
# Kept in fp32 whatever the model dtype (as the release and transformers keep them).
_FP32_SUFFIXES = ("norm.weight", "attn_sink", "ape", "gate.bias", "_base", "_scale", "_fn")


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def load_reference(
    path: str, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu"
) -> DSV4Reference:
    """Builds the reference module from ``path`` (config.json + safetensors, either key spelling).

    A checkpoint without ``mtp.*`` tensors loads with ``module.draft_block = None`` (no
    speculative decoding); fp8/fp4 block-quantised weights are dequantised into ``dtype``.
    """
    dtype = _dtype(dtype)
    cfg = ModelConfig.from_hf(path)
    with torch.device("meta"):
        module = DSV4Reference(cfg, dtype)
        with_mtp = cfg.mtp_layer is not None and has_mtp(path)
        if with_mtp:
            module.mtp.append(MTPBlock(cfg))
    _materialise(
        module,
        path,
        dtype,
        device,
        want=None if with_mtp else (lambda name: not name.startswith("mtp.")),
    )
    if not with_mtp:
        log.info("checkpoint %s has no mtp.* tensors: speculative decoding unavailable", path)
    return module


def load_stage(
    path: str,
    start: int,
    end: int,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    cfg: ModelConfig | None = None,
    weight_format: str = "dequantized",
) -> StageModel:
    """Loads only the tensors of layers [start, end) (plus embed / head on the end stages).

    weight_format "native": every linear whose weight the checkpoint stores quantised becomes a
    ``QuantLinear`` holding the stored bytes and scale; "dequantized": all are dequantised into
    ``dtype``. Tensors stored in bf16 or fp32 load the same way in both.
    """
    cfg = cfg or ModelConfig.from_hf(path)
    build = functools.partial(StageModel, cfg, start, end)
    return _load_in_format(build, path, dtype, device, cfg, weight_format)


def _load_in_format(build, path, dtype, device, cfg: ModelConfig, weight_format: str):
    """build(dtype) on meta (an owning module: ``owns(name)``), its quantised linears kept when
    weight_format is "native", then its tensors loaded from path."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    dtype = _dtype(dtype)
    with torch.device("meta"):
        module = build(dtype)
        if weight_format == "native":
            keep_quantized(module, path, cfg, module.owns)
    _materialise(module, path, dtype, device, want=module.owns)
    return module


def keep_quantized(module: torch.nn.Module, path: str, cfg: ModelConfig, want=None) -> int:
    """Replaces each linear whose weight ``path`` stores quantised by a ``QuantLinear`` of the
    stored kind (on the module's device, normally meta); returns how many."""
    quant = cfg.quantization
    if quant is None:
        raise ValueError(f"weight_format 'native' needs a quantized checkpoint; {path!r} has none")
    kinds = quantized_weights(path, quant, want)
    if not kinds and not quantized_weights(path, quant):
        raise ValueError(f"weight_format 'native' needs quantised weights; {path!r} stores none "
                         "(its config.json has a quantization_config)")  # fmt: skip
    for name, kind in kinds.items():
        parent_name, _, attr = name[: -len(".weight")].rpartition(".")
        try:
            parent = module.get_submodule(parent_name)
        except AttributeError:
            raise CheckpointError(f"unexpected tensor {name!r} in the checkpoint") from None
        old = getattr(parent, attr, None)
        if not isinstance(old, torch.nn.Linear):
            raise CheckpointError(f"tensor {name!r} is stored quantised but is no linear's weight")
        if name == "head.weight":  # the head's logits are computed from its plain weight
            raise CheckpointError("tensor 'head.weight' is stored quantised, which native weights "
                                  "do not take for the head: load with "
                                  "weight_format='dequantized'")  # fmt: skip
        groups = cfg.o_groups if attr == "wo_a" else 1  # the grouped output projection
        scale_bytes = kind == "fp4" or quant.scale_fmt == "ue8m0"
        layer = QuantLinear(old.in_features, old.out_features, kind, quant.weight_block_size,
                            scale_bytes, groups)  # fmt: skip
        setattr(parent, attr, layer)
    _check_expert_formats(module)
    log.info("%d linear layers keep their quantised weights", len(kinds))
    return len(kinds)


def _check_expert_formats(module: torch.nn.Module) -> None:
    """The routed experts of a layer run as one stack, so native weights need them stored
    alike (a dequantized load takes any mix)."""
    for name, moe in module.named_modules():
        if not isinstance(moe, MoE):
            continue
        first = _expert_format(moe.experts[0])
        for i, expert in enumerate(moe.experts):
            if _expert_format(expert) != first:
                raise CheckpointError(
                    f"the routed experts of {name!r} are stored in different formats (expert 0 "
                    f"{first}, expert {i} {_expert_format(expert)}): native weights need one "
                    "format for a layer's experts; load with weight_format='dequantized'"
                )


def _expert_format(expert: torch.nn.Module) -> tuple:
    """The storage kind of an expert's w1, w2 and w3 ("fp8", "fp4" or "plain")."""
    return tuple(getattr(getattr(expert, w), "kind", "plain") for w in ("w1", "w2", "w3"))


def missing_draft_tensors(path: str, cfg: ModelConfig | None = None) -> list[str]:
    """The MTP layer's tensors (``mtp.0.*``) the checkpoint lacks, sorted (all of them when the
    config has no MTP layer)."""
    cfg = cfg or ModelConfig.from_hf(path)
    if cfg.mtp_layer is None:
        return []
    with torch.device("meta"):
        names = {f"mtp.0.{name}" for name in MTPBlock(cfg).state_dict()}
    return sorted(names - set(checkpoint_index(path)))


def load_draft(
    path: str,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    cfg: ModelConfig | None = None,
    weight_format: str = "dequantized",
) -> DraftModel:
    """Loads the draft worker's tensors: ``mtp.0.*``, ``embed.weight`` and ``head.weight``;
    weight_format as ``load_stage`` takes it (the MTP block's quantised linears and experts)."""
    cfg = cfg or ModelConfig.from_hf(path)
    if cfg.mtp_layer is None:
        raise ValueError(f"the config of {path!r} has no MTP layer (num_nextn_predict_layers)")
    return _load_in_format(functools.partial(DraftModel, cfg), path, dtype, device, cfg,
                           weight_format)  # fmt: skip


def _materialise(module, path, dtype, device, want=None) -> None:
    cast_params(module, dtype)  # on meta: allocation below happens once, in the final dtypes
    allocate(module, device)
    load_state(module, iter_tensors(path, want, module.cfg.quantization))
    module.eval()


def allocate(module: torch.nn.Module, device) -> None:
    """``module.to_empty(device)`` without dispatching on the meta tensors: empty_like of a meta
    tensor runs torch's Python reference, which imports sympy (0.6 s of every stage's start)."""
    module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def cast_params(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Casts floating parameters to ``dtype`` except the ones the network keeps in fp32."""
    for name, param in module.named_parameters():
        keep = name.endswith(_FP32_SUFFIXES)
        param.data = param.data.to(torch.float32 if keep else dtype)
