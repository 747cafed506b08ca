"""A checkpoint folder checked before anything loads it, in seconds (headers only): each problem
is one ``CheckpointError`` (a ValueError) whose message names the file and what is wrong.

    config.json                      present, a JSON object, every field readable (ModelConfig)
    tokenizer.json                   present and readable by ``tokenizers``
    tokenizer_config.json            a JSON object when present
    model.safetensors.index.json     a JSON object with a ``weight_map`` of tensor -> shard file;
                                     every shard it names exists, and no other shard lies beside
    *.safetensors                    each header readable and the file as long as it declares;
                                     no ``layers.N`` tensor past config.json's layers (a
                                     config.json with fewer layers would drop them silently)
    the tokenizer                    no token id past config.json's vocab_size
"""

from __future__ import annotations

import json
import os

INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint file or tensor is missing, unexpected, mis-shaped or badly quantised; the
    message names it. Defined here, beside the checks that need no torch, so that importing
    the engine builder (every Serve replica, the HTTP ingress included) does not load torch."""


def check_checkpoint(path: str) -> None:
    """CheckpointError naming the first broken file of the folder ``path``."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a folder (a checkpoint is a folder with config.json)")
    cfg = _check_config(path)
    num_ids = _check_tokenizer(path)
    if num_ids > cfg.vocab_size:
        raise CheckpointError(
            f"{os.path.join(path, 'tokenizer.json')}: token ids up to {num_ids - 1}, past the "
            f"model's vocab_size {cfg.vocab_size} (config.json): prompts could hold ids it has no "
            "embedding for"
        )
    for shard in _shards(path):
        _check_layers(shard, _check_shard(shard), cfg.num_hidden_layers)


def _check_config(path: str) -> None:
    from dsv4ray.config import ModelConfig

    file = os.path.join(path, "config.json")
    _json_object(file, "the model's config")
    try:
        return ModelConfig.from_hf(path)
    except (ValueError, TypeError, KeyError) as exc:  # a field missing or of the wrong type
        raise CheckpointError(f"{file}: {_one_line(exc)}") from None


def _check_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer

    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        raise CheckpointError(f"{file}: missing (the checkpoint's tokenizer)")
    try:
        tokenizer = Tokenizer.from_file(file)
    except Exception as exc:  # tokenizers raises its own exception types
        raise CheckpointError(f"{file}: not a readable tokenizer ({_one_line(exc)})") from None
    config = os.path.join(path, "tokenizer_config.json")
    if os.path.exists(config):
        _json_object(config, "the tokenizer's config")
    return max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1


def _shards(path: str) -> list[str]:
    """The shard files the checkpoint loads, each present; refuses shards no index names."""
    index_file = os.path.join(path, INDEX)
    found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not os.path.exists(index_file):
        if not found:
            raise CheckpointError(f"{path}: no .safetensors file (the model's weights)")
        return [os.path.join(path, f) for f in found]
    index = _json_object(index_file, "the shard index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_file}: 'weight_map' must map tensor names to shard files")
    named = sorted(set(weight_map.values()))
    for shard in named:
        if not os.path.isfile(os.path.join(path, shard)):
            tensor = next(k for k, v in weight_map.items() if v == shard)
            raise CheckpointError(
                f"{os.path.join(path, shard)}: missing (the shard index names it for {tensor!r})"
            )
    extra = sorted(set(found) - set(named))
    if extra:
        raise CheckpointError(
            f"{os.path.join(path, extra[0])}: a shard the index ({INDEX}) does not name; "
            "remove it or list its tensors"
        )
    return [os.path.join(path, shard) for shard in named]


def _check_shard(file: str) -> list[str]:
    """The header parses and every tensor it declares lies inside the file; its tensor names."""
    from safetensors import safe_open

    try:  # numpy: the same header checks without loading torch in the driver
        with safe_open(file, framework="numpy") as f:
            return list(f.keys())
    except Exception as exc:  # SafetensorError, OSError, ...
        raise CheckpointError(
            f"{file}: not a readable safetensors file, truncated or corrupt ({_one_line(exc)})"
        ) from None


def _check_layers(file: str, names: list[str], num_layers: int) -> None:
    for name in names:
        parts = name.split(".")
        if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit():
            if int(parts[1]) >= num_layers:
                raise CheckpointError(
                    f"{file}: tensor {name!r} belongs to layer {parts[1]}, but config.json has "
                    f"num_hidden_layers {num_layers}"
                )


def _json_object(file: str, what: str) -> dict:
    if not os.path.isfile(file):
        raise CheckpointError(f"{file}: missing ({what})")
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file}: not valid JSON ({_one_line(exc)})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: must be a JSON object, got {type(data).__name__}")
    return data


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]
