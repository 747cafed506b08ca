"""Safetensors checkpoints under the official key names, with transformers' spelling accepted.

One mapping table turns transformers' names into the official ones (``model.`` prefix dropped,
``embed_tokens`` -> ``embed``, ``hc_head.hc_fn`` -> ``hc_head_fn``, the attention's ``norm`` ->
``kv_norm``); the reference module's parameters carry the official names, so loading is a name
check, a shape check and a copy. Missing, unexpected and mis-shaped tensors fail with the key.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator

import torch
from safetensors import safe_open

_RENAMES = (
    (re.compile(r"^embed_tokens\.weight$"), "embed.weight"),
    (re.compile(r"^lm_head\.weight$"), "head.weight"),
    (re.compile(r"^hc_head\.hc_(fn|base|scale)$"), r"hc_head_\1"),
    (re.compile(r"^(layers\.\d+\.attn)\.norm\.weight$"), r"\1.kv_norm.weight"),
    (re.compile(r"^(mtp\.\d+\.attn)\.norm\.weight$"), r"\1.kv_norm.weight"),
)


class CheckpointError(ValueError):
    """A checkpoint tensor is missing, unexpected, mis-shaped or quantised; the message names it."""


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


def iter_tensors(path: str, want=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (official name, tensor) for every tensor whose official name passes ``want``."""
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                name = canonical_name(key)
                if want is None or want(name):
                    yield name, f.get_tensor(key)


def has_mtp(path: str) -> bool:
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            if any(canonical_name(k).startswith("mtp.") for k in f.keys()):
                return True
    return False


def load_state(
    module: torch.nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor]],
    prefix: str = "",
    allow_unexpected=None,
) -> None:
    """Copies named tensors into ``module`` (names relative to ``prefix``); every parameter and
    buffer must be given exactly once with its shape."""
    expected = module.state_dict()
    seen, quantised = set(), []
    for name, tensor in tensors:
        if not name.startswith(prefix):
            continue
        local = name[len(prefix) :]
        if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) or local.endswith("scale_inv"):
            quantised.append(name)
            continue
        if local not in expected:
            if allow_unexpected is not None and allow_unexpected(name):
                continue
            raise CheckpointError(f"unexpected tensor {name!r} in the checkpoint")
        target = expected[local]
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
                f"{tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(tensor.to(target.dtype))
        seen.add(local)
    if quantised:
        raise CheckpointError(
            f"{len(quantised)} tensors are quantised (e.g. {quantised[:3]}); dequantise the "
            "checkpoint to bf16 first: fp8/fp4 block-scaled weights are not loaded yet"
        )
    missing = sorted(set(expected) - seen)
    if missing:
        raise CheckpointError(
            f"checkpoint is missing tensor {prefix + missing[0]!r}"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
        )


def save_state(tensors: dict[str, torch.Tensor], path: str) -> None:
    from safetensors.torch import save_file

    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        os.path.join(path, "model.safetensors"),
        metadata={"format": "pt"},
    )
