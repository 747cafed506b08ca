"""Model configuration: one frozen ``ModelConfig`` read from official or transformers config keys.

``ModelConfig.from_hf(path_or_dict)`` accepts a checkpoint folder, a ``config.json`` path, a plain
dict or a transformers config object. Official DeepSeek-V4 keys (``compress_ratios``,
``num_hash_layers``, ``rope_scaling``, ``qk_rope_head_dim``) and transformers' keys (``layer_types``
+ ``compress_rates``, ``mlp_layer_types``, nested ``rope_parameters``) are both understood. When a
config object comes from a folder, fields a config class drops or overwrites are read again from
the raw ``config.json`` (the IndexShare keys, ``qk_rope_head_dim``, the MTP ratio entry).

Per-layer facts (attention kind, compress ratio, RoPE, MoE kind, IndexShare) are derived once in
``ModelConfig.layers``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from dsv4ray.config_error import ConfigError
from dsv4ray.config_quant import QuantConfig
from dsv4ray.config_rope import (
    RopeScaling,
    RopeSpec,
    official_rope_keys,
    read_rope_tables,
    yarn_inv_freq_bounds,
)

log = logging.getLogger("dsv4ray.config")
# the dtypes the model computes in (its attention kernels take these); a float16 checkpoint
# computes in bfloat16, whose range holds every float16 value
COMPUTE_DTYPES = ("float32", "bfloat16")

__all__ = ["ConfigError", "LayerSpec", "ModelConfig", "QuantConfig", "RopeScaling", "RopeSpec"]
__all__ += ["yarn_inv_freq_bounds"]
VALID_RATIOS = (0, 4, 128)
WINDOW = 128
_LAYER_TYPE_RATIO = {
    "sliding_attention": 0,
    "compressed_sparse_attention": 4,
    "heavily_compressed_attention": 128,
}
_PATTERN_WORDS = ("compute", "share")
# Fields a config class may drop or clobber; re-read from the raw file when one is available.
_RAW_FIELDS = (
    "qk_rope_head_dim",
    "index_topk_freq",
    "index_topk_pattern",
    "index_skip_topk_offset",
    "compress_ratios",
    "num_hash_layers",
    "rope_scaling",
)
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "q_lora_rank",
    "o_lora_rank",
    "index_n_heads",
    "index_topk",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)


@dataclass(frozen=True)
class LayerSpec:
    """Derived facts of one decoder layer (or of the MTP block, ``is_mtp``)."""

    layer_id: int
    compress_ratio: int
    rope: RopeSpec
    moe_kind: str  # "hash" (token-id table) or "score" (sqrtsoftplus + bias)
    c4_ordinal: int | None = None  # ordinal among the model's C4 layers
    skip_topk: bool = False  # IndexShare: reuse the previous C4 layer's top-k
    next_skip_topk: bool = False
    is_mtp: bool = False

    @property
    def attn_kind(self) -> str:
        return {0: "window", 4: "c4", 128: "c128"}[self.compress_ratio]

    @property
    def has_indexer(self) -> bool:
        return self.compress_ratio == 4 and not self.skip_topk and not self.is_mtp


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    o_lora_rank: int
    index_n_heads: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    compress_ratios: tuple[int, ...]  # one per layer, then one per MTP layer
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    o_groups: int = 8
    sliding_window: int = WINDOW
    index_head_dim: int = 128
    index_topk_freq: int = 1
    index_topk_pattern: tuple[str, ...] | None = None
    index_skip_topk_offset: int | None = None
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    num_hash_layers: int = 3
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0  # base of the window-only layers' table ("main")
    compress_rope_theta: float = 160000.0  # base of the C4/C128 layers' table ("compress")
    main_scaling: RopeScaling | None = None  # only transformers' nested rope_parameters set it
    compress_scaling: RopeScaling | None = None  # official rope_scaling (YaRN in the release)
    num_nextn_predict_layers: int = 1
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    bos_token_id: int = 0
    eos_token_id: int = 1
    torch_dtype: str = "bfloat16"
    quantization: QuantConfig | None = None  # block-quantised release checkpoints

    def __post_init__(self) -> None:
        _validate(self)

    # ---- derived ---------------------------------------------------------------------------
    @property
    def layer_ratios(self) -> tuple[int, ...]:
        return self.compress_ratios[: self.num_hidden_layers]

    @property
    def mtp_ratio(self) -> int | None:
        n = self.num_hidden_layers
        return self.compress_ratios[n] if len(self.compress_ratios) > n else None

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @cached_property
    def layers(self) -> tuple[LayerSpec, ...]:
        return tuple(_layer_specs(self))

    @cached_property
    def mtp_layer(self) -> LayerSpec | None:
        if self.mtp_ratio is None:
            return None
        ratio = self.mtp_ratio
        return LayerSpec(
            layer_id=self.num_hidden_layers,
            compress_ratio=ratio,
            rope=self.rope_for(ratio),
            moe_kind="score",
            skip_topk=ratio == 4,
            is_mtp=True,
        )

    def rope_for(self, ratio: int) -> RopeSpec:
        if ratio == 0:
            return RopeSpec(self.rope_theta, self.qk_rope_head_dim, self.main_scaling)
        return RopeSpec(self.compress_rope_theta, self.qk_rope_head_dim, self.compress_scaling)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_official_dict(self) -> dict[str, Any]:
        """The official ``config.json`` keys (what ``make_tiny`` writes)."""
        d = dataclasses.asdict(self)
        for key in ("main_scaling", "compress_scaling", "quantization"):
            d.pop(key)
        d["compress_ratios"] = list(self.compress_ratios)
        if self.index_topk_pattern is not None:
            d["index_topk_pattern"] = list(self.index_topk_pattern)
        else:
            d.pop("index_topk_pattern")
        if self.index_skip_topk_offset is None:
            d.pop("index_skip_topk_offset")
        d.update(
            official_rope_keys(
                self.rope_theta, self.compress_rope_theta, self.main_scaling, self.compress_scaling
            )
        )
        if self.quantization is not None:
            d["quantization_config"] = self.quantization.to_dict()
            d["expert_dtype"] = self.quantization.expert_dtype
        d["architectures"] = ["DeepseekV4ForCausalLM"]
        d["model_type"] = "deepseek_v4"
        return d

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def from_hf(cls, source: str | os.PathLike | dict | Any) -> ModelConfig:
        raw, file_raw = _raw_dicts(source)
        merged = dict(raw)
        for key in _RAW_FIELDS:
            if file_raw is not None and key in file_raw:
                merged[key] = file_raw[key]
        return cls(**_normalise(merged))


def _raw_dicts(source: Any) -> tuple[dict, dict | None]:
    """Returns (the config as given, the raw config.json it came from or None)."""
    if isinstance(source, dict):
        return dict(source), None
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json at {os.fspath(source)!r}")
        with open(path) as f:
            raw = json.load(f)
        return raw, raw
    if hasattr(source, "to_dict"):
        raw = source.to_dict()
        folder = getattr(source, "_name_or_path", "") or ""
        cfg_file = os.path.join(folder, "config.json") if folder else ""
        file_raw = None
        if cfg_file and os.path.isfile(cfg_file):
            with open(cfg_file) as f:
                file_raw = json.load(f)
        return raw, file_raw
    raise TypeError(f"from_hf takes a path, a dict or a transformers config, not {type(source)}")


def _normalise(raw: dict) -> dict[str, Any]:
    """Maps both key spellings onto ModelConfig's fields; unknown keys are ignored."""
    for key in _REQUIRED:
        if raw.get(key) is None:
            raise ConfigError(f"config is missing required key {key!r}")
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    out = {k: v for k, v in raw.items() if k in names and v is not None}
    _refuse_unsupported(raw)
    out["compress_ratios"] = _read_ratios(raw)
    out["num_hash_layers"] = _read_num_hash_layers(raw)
    if "qk_rope_head_dim" not in raw and raw.get("partial_rotary_factor") is not None:
        # transformers truncates: int(head_dim * partial_rotary_factor)
        out["qk_rope_head_dim"] = int(raw.get("head_dim", 512) * raw["partial_rotary_factor"])
    out.update(read_rope_tables(raw, out.get("qk_rope_head_dim", 64)))
    if raw.get("index_topk_pattern") is not None:
        out["index_topk_pattern"] = tuple(raw["index_topk_pattern"])
    out["torch_dtype"] = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")
    if out["torch_dtype"] not in COMPUTE_DTYPES:
        log.warning("the checkpoint's torch_dtype is %s: computing in bfloat16", out["torch_dtype"])
        out["torch_dtype"] = "bfloat16"
    out["quantization"] = QuantConfig.from_raw(raw)
    if isinstance(out.get("eos_token_id"), list):
        out["eos_token_id"] = out["eos_token_id"][0]
    return out


def _refuse_unsupported(raw: dict) -> None:
    """Fields transformers honours that this network does not implement."""
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act must be 'silu' (SwiGLU experts), got {raw['hidden_act']!r}")
    for key in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
        if raw.get(key):
            raise ConfigError(f"{key} = true is not supported (the release has none)")


def _read_ratios(raw: dict) -> tuple[int, ...]:
    if raw.get("compress_ratios") is not None:
        return tuple(int(r) for r in raw["compress_ratios"])
    layer_types = raw.get("layer_types")
    if layer_types is None:
        raise ConfigError("config needs 'compress_ratios' (or transformers' 'layer_types')")
    rates = dict(raw.get("compress_rates") or {})
    for key, kind in (
        ("compress_rate_csa", "compressed_sparse_attention"),
        ("compress_rate_hca", "heavily_compressed_attention"),
    ):
        if raw.get(key) is not None:  # transformers folds these legacy keys into compress_rates
            rates[kind] = raw[key]
    ratios = []
    for i, t in enumerate(layer_types):
        if t not in _LAYER_TYPE_RATIO:
            raise ConfigError(f"layer_types[{i}] = {t!r} is not one of {list(_LAYER_TYPE_RATIO)}")
        ratios.append(int(rates.get(t, _LAYER_TYPE_RATIO[t])))
    # transformers drops the MTP entry; the release's MTP block is window-only.
    ratios += [0] * int(raw.get("num_nextn_predict_layers", 1))
    return tuple(ratios)


def _read_num_hash_layers(raw: dict) -> int:
    if raw.get("num_hash_layers") is not None:
        return int(raw["num_hash_layers"])
    kinds = raw.get("mlp_layer_types")
    if kinds is None:
        return 3
    n = sum(1 for k in kinds if k == "hash_moe")
    if list(kinds[:n]) != ["hash_moe"] * n:
        raise ConfigError("mlp_layer_types: hash_moe layers must come first")
    return n


def _validate(c: ModelConfig) -> None:
    _positive(
        c,
        *_REQUIRED,
        "o_groups",
        "index_head_dim",
        "hc_mult",
        "hc_sinkhorn_iters",
        "head_dim",
        "index_topk_freq",
    )
    n = c.num_hidden_layers
    if len(c.compress_ratios) != n + c.num_nextn_predict_layers:
        raise ConfigError(
            f"compress_ratios has {len(c.compress_ratios)} entries; expected num_hidden_layers "
            f"({n}) + num_nextn_predict_layers ({c.num_nextn_predict_layers})"
        )
    bad = [r for r in c.compress_ratios if r not in VALID_RATIOS]
    if bad:
        raise ConfigError(f"compress_ratios values must be in {VALID_RATIOS}; got {bad}")
    if c.sliding_window != WINDOW:
        raise ConfigError(
            f"sliding_window must be {WINDOW} (page layouts assume it), got {c.sliding_window}"
        )
    if c.num_attention_heads % c.o_groups:
        raise ConfigError(
            f"o_groups ({c.o_groups}) must divide num_attention_heads ({c.num_attention_heads})"
        )
    if c.num_key_value_heads != 1:
        raise ConfigError(
            f"num_key_value_heads must be 1 (shared K=V MQA), got {c.num_key_value_heads}"
        )
    if c.qk_rope_head_dim % 2 or not 0 < c.qk_rope_head_dim <= c.head_dim:
        raise ConfigError(
            f"qk_rope_head_dim must be even and in (0, head_dim], got {c.qk_rope_head_dim}"
        )
    if c.num_experts_per_tok > c.n_routed_experts:
        raise ConfigError(
            f"num_experts_per_tok ({c.num_experts_per_tok}) exceeds n_routed_experts "
            f"({c.n_routed_experts})"
        )
    if c.scoring_func != "sqrtsoftplus":
        raise ConfigError(f"scoring_func must be 'sqrtsoftplus', got {c.scoring_func!r}")
    if not 0 <= c.num_hash_layers <= n:
        raise ConfigError(f"num_hash_layers must be in [0, {n}], got {c.num_hash_layers}")
    _validate_index_share(c)


def _positive(c: ModelConfig, *names: str) -> None:
    for name in names:
        value = getattr(c, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _validate_index_share(c: ModelConfig) -> None:
    offset = c.index_skip_topk_offset
    if offset is not None and (not isinstance(offset, int) or offset <= 0):
        raise ConfigError(
            f"index_skip_topk_offset must be a positive integer, got {offset!r} (offset <= 0 "
            "would make the first C4 layer share a top-k that no layer computed)"
        )
    pattern = c.index_topk_pattern
    if pattern is None:
        return
    num_c4 = sum(1 for r in c.layer_ratios if r == 4)
    if len(pattern) != num_c4:
        raise ConfigError(
            f"index_topk_pattern has {len(pattern)} entries; the model has {num_c4} C4 layers"
        )
    unknown = sorted({w for w in pattern if w not in _PATTERN_WORDS})
    if unknown:
        raise ConfigError(f"index_topk_pattern words must be 'compute' or 'share'; got {unknown}")
    if pattern and pattern[0] == "share":
        raise ConfigError(
            "index_topk_pattern[0] is 'share': the first C4 layer has no top-k to reuse"
        )


def skip_topk_at(c: ModelConfig, ordinal: int) -> bool:
    """IndexShare rule at C4 ordinal ``ordinal`` (c is the layer's ordinal among the C4 layers)."""
    if c.index_topk_pattern is not None:
        if ordinal >= len(c.index_topk_pattern):
            return False
        return c.index_topk_pattern[ordinal] == "share"
    freq = c.index_topk_freq
    if c.index_skip_topk_offset is not None:
        return max(ordinal - c.index_skip_topk_offset + 1, 0) % freq != 0
    return max(ordinal - 1, 0) % freq != 0


def _layer_specs(c: ModelConfig) -> list[LayerSpec]:
    specs, ordinal = [], 0
    for i, ratio in enumerate(c.layer_ratios):
        moe_kind = "hash" if i < c.num_hash_layers else "score"
        if ratio == 4:
            skips = (skip_topk_at(c, ordinal), skip_topk_at(c, ordinal + 1))
            specs.append(LayerSpec(i, ratio, c.rope_for(ratio), moe_kind, ordinal, *skips))
            ordinal += 1
        else:
            specs.append(LayerSpec(i, ratio, c.rope_for(ratio), moe_kind))
    return specs
