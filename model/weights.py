"""Safetensors checkpoints under the official key names, with transformers' spelling accepted and
block-quantised release weights dequantised at load.

One mapping table turns transformers' names into the official ones (``model.`` prefix dropped,
``embed_tokens`` -> ``embed``, ``hc_head.hc_fn`` -> ``hc_head_fn``, the attention's ``norm`` ->
``kv_norm``, ``weight_scale_inv`` -> ``scale``); the reference module's parameters carry the
official names, so loading is a name check, a shape check and a copy. A weight stored as
float8_e4m3fn (or, for routed experts with ``expert_dtype`` "fp4", as packed int8) is paired with
its ``scale`` tensor, wherever the shard index puts it, and dequantised straight into the
parameter (see ``dsv4ray.model.quant``). Missing, unexpected and mis-shaped tensors, a quantised
weight without its scale and a scale of the wrong shape fail with the tensor named.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from safetensors import safe_open

from dsv4ray.config import QuantConfig
from dsv4ray.config_quant import FP4_MAX_SCALE_BYTE
from dsv4ray.model.checkpoint_check import CheckpointError
from dsv4ray.model.quant import QuantizedWeight, scale_to_float

log = logging.getLogger("dsv4ray.model")

_RENAMES = (
    (re.compile(r"^embed_tokens\.weight$"), "embed.weight"),
    (re.compile(r"^lm_head\.weight$"), "head.weight"),
    (re.compile(r"^hc_head\.hc_(fn|base|scale)$"), r"hc_head_\1"),
    (re.compile(r"^(layers\.\d+\.attn)\.norm\.weight$"), r"\1.kv_norm.weight"),
    (re.compile(r"^(mtp\.\d+\.attn)\.norm\.weight$"), r"\1.kv_norm.weight"),
    (re.compile(r"\.weight_scale_inv$"), ".scale"),
)
SCALE_SUFFIX = ".scale"
_EXPERT = re.compile(r"(^|\.)experts\.\d+\.w[123]\.weight$")
_FP8, _PACKED = ("F8_E4M3",), ("I8", "U8", "F4")
_QUANTISED = _FP8 + _PACKED + ("F8_E5M2",)
_SCALE_DTYPES = ("F32", "BF16", "F16", "U8", "F8_E8M0")  # safetensors' names


def canonical_name(key: str) -> str:
    """Official name of a checkpoint key written in either spelling."""
    if key.startswith("model."):
        key = key[len("model.") :]
    for pattern, repl in _RENAMES:
        key = pattern.sub(repl, key)
    return key


def checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, s) for s in shards]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"no .safetensors files in {path!r}")
    return [os.path.join(path, f) for f in found]


@dataclass(frozen=True)
class _Entry:
    file: str
    key: str
    dtype: str  # safetensors dtype string, e.g. "F8_E4M3"


def checkpoint_index(path: str) -> dict[str, _Entry]:
    """Official name -> where the tensor lives, in file order (reads only the headers)."""
    index: dict[str, _Entry] = {}
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                name = canonical_name(key)
                if name in index:
                    raise CheckpointError(
                        f"tensor {name!r} appears twice ({index[name].key!r} and {key!r})"
                    )
                index[name] = _Entry(file, key, f.get_slice(key).get_dtype())
    return index


def iter_tensors(
    path: str, want=None, quant: QuantConfig | None = None
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Yields (official name, tensor) for every tensor whose official name passes ``want``; a
    quantised weight comes as a ``QuantizedWeight`` holding its scale, scales never alone."""
    index = checkpoint_index(path)
    _check_scales(index, want)
    shards = _Shards()
    for name, entry in index.items():
        if name.endswith(SCALE_SUFFIX) or (want is not None and not want(name)):
            continue
        kind = _quant_kind(name, entry, quant)
        if kind is None:
            item = shards.read(entry)
        else:
            scale_name = name[: -len(".weight")] + SCALE_SUFFIX
            if scale_name not in index:
                raise CheckpointError(
                    f"checkpoint is missing tensor {scale_name!r}, the scale of the quantised "
                    f"{name!r} ({entry.dtype})"
                )
            data, scale = shards.read(entry), shards.read(index[scale_name])
            if data.dim() != 2:
                raise CheckpointError(f"tensor {name!r} has shape {tuple(data.shape)}: a "
                                      "quantised weight is a matrix [rows, columns]")  # fmt: skip
            item = QuantizedWeight(name, data, scale, kind, quant.weight_block_size)
        yield name, item
        del item  # the next tensor is read while this one could still be referenced


class _Shards:
    """Open shard files, at most two at a time (the current one and the one holding a scale):
    a read tensor is a view of its file's mapping, which lives until the view and the handle go."""

    def __init__(self) -> None:
        self.open: dict[str, object] = {}

    def read(self, entry: _Entry) -> torch.Tensor:
        handle = self.open.pop(entry.file, None)
        if handle is None:
            while len(self.open) > 1:  # close before mapping another file
                self.open.pop(next(iter(self.open)))
            handle = safe_open(entry.file, framework="pt")
        self.open[entry.file] = handle  # most recently used last
        return handle.get_tensor(entry.key)


def _quant_kind(name: str, entry: _Entry, quant: QuantConfig | None) -> str | None:
    """None for a plain tensor, else "fp8" or "fp4"; impossible combinations are errors."""
    if entry.dtype not in _QUANTISED:
        return None
    if quant is None:
        raise CheckpointError(
            f"tensor {name!r} is stored as {entry.dtype} but config.json has no "
            "quantization_config (its block size and scale format are unknown)"
        )
    if entry.dtype == "F8_E5M2":
        raise CheckpointError(f"tensor {name!r} is float8_e5m2; only e4m3 weights are supported")
    is_expert = bool(_EXPERT.search(name))
    kind = "fp8" if entry.dtype in _FP8 else "fp4"
    if kind == "fp4" and not is_expert:
        raise CheckpointError(
            f"tensor {name!r} is stored as {entry.dtype}: only routed experts may be packed FP4"
        )
    if is_expert and kind != quant.expert_dtype:
        raise CheckpointError(
            f"tensor {name!r} is stored as {entry.dtype} ({kind}) but quantization_config."
            f"expert_dtype is {quant.expert_dtype!r}"
        )
    return kind


def _check_scales(index: dict[str, _Entry], want) -> None:
    for name in index:
        if not name.endswith(SCALE_SUFFIX) or (want is not None and not want(name)):
            continue
        weight_name = name[: -len(SCALE_SUFFIX)] + ".weight"
        weight = index.get(weight_name)
        if weight is None:
            raise CheckpointError(f"checkpoint is missing tensor {weight_name!r}, the weight "
                                  f"of the scale {name!r}")  # fmt: skip
        if weight.dtype not in _QUANTISED:
            raise CheckpointError(
                f"unexpected tensor {name!r} in the checkpoint: no quantised weight beside it"
            )
        if index[name].dtype not in _SCALE_DTYPES:
            raise CheckpointError(
                f"tensor {name!r} is stored as {index[name].dtype}: scales are F32, BF16, F16 "
                "multipliers or U8 / F8_E8M0 exponent bytes"
            )


def quantized_weights(path: str, quant: QuantConfig | None, want=None) -> dict[str, str]:
    """Official name -> "fp8" or "fp4" of every weight the checkpoint stores quantised."""
    index = checkpoint_index(path)
    kinds = {}
    for name, entry in index.items():
        if name.endswith(SCALE_SUFFIX) or (want is not None and not want(name)):
            continue
        kind = _quant_kind(name, entry, quant)
        if kind is not None:
            kinds[name] = kind
    return kinds


def has_mtp(path: str) -> bool:
    return any(name.startswith("mtp.") for name in checkpoint_index(path))


def load_state(
    module: torch.nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
    prefix: str = "",
) -> None:
    """Copies named tensors into ``module`` (names relative to ``prefix``), dequantising
    quantised weights in place; every parameter and buffer must be given exactly once."""
    expected = module.state_dict()
    seen = set()
    for name, tensor in tensors:
        if not name.startswith(prefix):
            continue
        local = name[len(prefix) :]
        if local not in expected:
            raise CheckpointError(f"unexpected tensor {name!r} in the checkpoint")
        target = expected[local]
        if isinstance(tensor, QuantizedWeight) and target.element_size() == 1:
            scale_local = local[: -len(".weight")] + SCALE_SUFFIX  # a layer kept quantised
            _load_stored(tensor, target, expected[scale_local])
            seen.update((local, scale_local))
            continue
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
                f"{tuple(target.shape)}"
            )
        with torch.no_grad():
            if isinstance(tensor, QuantizedWeight):
                _check_scale_shape(tensor)
                tensor.dequantize_into(target)
            else:
                target.copy_(tensor)
        seen.add(local)
        del tensor
    missing = sorted(set(expected) - seen)
    if missing:
        raise CheckpointError(
            f"checkpoint is missing tensor {prefix + missing[0]!r}"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
        )


@torch.no_grad()
def _load_stored(weight: QuantizedWeight, target: torch.Tensor, scale: torch.Tensor) -> None:
    """Copies a quantised weight's bytes and scale into a layer that keeps them (QuantLinear)."""
    _check_scale_shape(weight)
    packed = torch.float8_e4m3fn if weight.kind == "fp8" else torch.int8
    if target.dtype != packed or tuple(weight.data.shape) != tuple(target.shape):
        raise CheckpointError(
            f"tensor {weight.name!r} ({weight.kind}, {tuple(weight.data.shape)}) does not fit "
            f"the layer's {target.dtype} {tuple(target.shape)}"
        )
    target.copy_(weight.data.view(target.dtype))
    stored = _scale_as(weight, scale.dtype)
    if weight.kind == "fp4" and bool((stored > FP4_MAX_SCALE_BYTE).any()):
        raise CheckpointError(
            f"scale tensor {weight.name[: -len('.weight')] + SCALE_SUFFIX!r} holds scales above "
            f"2^{FP4_MAX_SCALE_BYTE - 127}, beyond what the native FP4 kernels decode; load it "
            "with weight_format='dequantized'"
        )
    scale.copy_(stored)


def _scale_as(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight's scale as fp32 multipliers or as uint8 ue8m0 exponent bytes (b: 2^(b-127))."""
    values = scale_to_float(weight.scale)
    if dtype == torch.float32:
        return values
    if weight.scale.dtype in (torch.uint8, torch.float8_e8m0fnu):
        return weight.scale.view(torch.uint8)
    exponent = torch.log2(values).round()
    if (
        not torch.equal(torch.exp2(exponent), values)
        or not ((exponent > -127) & (exponent < 128)).all()
    ):
        raise CheckpointError(
            f"scale tensor {weight.name[: -len('.weight')] + SCALE_SUFFIX!r} holds values that "
            "are not powers of two between 2^-126 and 2^127 (ue8m0 exponent bytes)"
        )
    return (exponent + 127).to(torch.uint8)


def _check_scale_shape(weight: QuantizedWeight) -> None:
    scale_name = weight.name[: -len(".weight")] + SCALE_SUFFIX
    if weight.kind == "fp4" and weight.shape[1] % 32:
        raise CheckpointError(
            f"tensor {weight.name!r} holds {weight.shape[1]} FP4 values per row; the release "
            "format needs a multiple of 32 (one ue8m0 scale per 32)"
        )
    want = weight.expected_scale_shape()
    finite = bool(scale_to_float(weight.scale).isfinite().all())
    if tuple(weight.scale.shape) == want and not finite:
        raise CheckpointError(  # every value of its block would decode to NaN or inf
            f"scale tensor {scale_name!r} holds NaN or infinite scales (ue8m0 byte 255, or a "
            "multiplier that is not finite)"
        )
    if tuple(weight.scale.shape) != want:
        layout = (
            "one scale per 32 values of a row"
            if weight.kind == "fp4"
            else f"quantization_config.weight_block_size {list(weight.block)}"
        )
        raise CheckpointError(
            f"scale tensor {scale_name!r} has shape {tuple(weight.scale.shape)}; "
            f"{weight.name!r} {list(weight.shape)} with {layout} needs {want}"
        )


_STALE_FILES = ("model.safetensors", "model.safetensors.index.json", "training.json")
_SHARD = re.compile(r"model-\d+-of-\d+\.safetensors")


def clear_checkpoint(path: str) -> None:
    """Removes the weight files (one file, an index, shards) and training summary a checkpoint
    written to ``path`` before left there: the loader prefers an index to a single file, so a
    new checkpoint of the other layout would load the old one's shards."""
    if not os.path.isdir(path):
        return
    stale = [f for f in os.listdir(path) if f in _STALE_FILES or _SHARD.fullmatch(f)]
    for name in stale:
        os.remove(os.path.join(path, name))
    if stale:
        log.info("replaced the checkpoint in %s (removed %s)", path, ", ".join(sorted(stale)))


def save_state(tensors: dict[str, torch.Tensor], path: str) -> None:
    """tensors into path/model.safetensors, in place of any checkpoint written there before."""
    from safetensors.torch import save_file

    clear_checkpoint(path)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        os.path.join(path, "model.safetensors"),
        metadata={"format": "pt"},
    )
