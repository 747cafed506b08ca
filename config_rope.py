"""RoPE settings of the two rotary tables (``main``: window-only layers, ``compress``: C4/C128
layers), read with transformers 5.23's meaning and defaults for ``DeepseekV4Config``.

Two spellings reach us:

- flat (official ``rope_scaling``, or a flat ``rope_parameters``): ``main`` is plain RoPE with
  ``rope_theta``; ``compress`` takes the flat dict with ``compress_rope_theta`` as its base, and a
  YaRN entry without ``attention_factor`` gets 1.0 (the release does not scale cos/sin).
- nested (transformers' ``rope_parameters = {"main": {...}, "compress": {...}}``): each entry is
  used as written. Its ``rope_theta`` defaults to the top-level ``rope_theta`` (not
  ``compress_rope_theta``), and a YaRN entry without ``attention_factor`` gets YaRN's own default
  ``0.1 * mscale * ln(factor) + 1`` (divided by the same with ``mscale_all_dim`` when both are
  set), which multiplies cos and sin.

Supported rope types: ``default``, ``linear`` and ``yarn``. The others (``dynamic`` and
``longrope`` depend on the sequence length, ``llama3`` and ``proportional`` are not DeepSeek's) are
refused with the field named. An entry's ``partial_rotary_factor`` must give the model's
``qk_rope_head_dim`` (DSV4 rotates the same trailing channels in every layer); an entry without
one uses the top-level factor, as transformers does once it has standardised the entries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dsv4ray.config_error import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn")
DEFAULT_ROPE_THETA = 10000.0
DEFAULT_COMPRESS_ROPE_THETA = 160000.0
DEFAULT_MAX_POSITION_EMBEDDINGS = 1048576


@dataclass(frozen=True)
class RopeScaling:
    """A scaled rotary table: ``linear`` divides every frequency by ``factor``; ``yarn`` blends
    interpolated and extrapolated frequencies over the correction range. ``attention_factor``
    multiplies cos and sin (1.0 leaves them unscaled)."""

    rope_type: str
    factor: float
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.rope_type not in ("linear", "yarn"):
            raise ConfigError(f"rope_type must be 'linear' or 'yarn', got {self.rope_type!r}")
        for name in ("factor", "attention_factor", "beta_fast", "beta_slow"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"rope {name} must be a positive number, got {value!r}")
        if self.original_max_position_embeddings <= 0:
            raise ConfigError(
                "rope original_max_position_embeddings must be positive, got "
                f"{self.original_max_position_embeddings!r}"
            )


@dataclass(frozen=True)
class RopeSpec:
    """One rotary table: base ``theta`` over the trailing ``dim`` channels, optionally scaled."""

    theta: float
    dim: int
    scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        if not self.theta > 0:
            raise ConfigError(f"rope_theta must be positive, got {self.theta!r}")
        if self.dim <= 0 or self.dim % 2:
            raise ConfigError(f"the rotary dim must be even and positive, got {self.dim}")

    @property
    def yarn(self) -> RopeScaling | None:
        return self.scaling if self.scaling and self.scaling.rope_type == "yarn" else None

    @property
    def attention_factor(self) -> float:
        return self.scaling.attention_factor if self.scaling else 1.0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's default attention factor for one (factor, mscale) pair."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def read_rope_tables(raw: dict, rope_dim: int) -> dict[str, Any]:
    """Raw config -> ModelConfig fields ``rope_theta``, ``compress_rope_theta``,
    ``main_scaling``, ``compress_scaling``."""
    theta = float(raw.get("rope_theta") or DEFAULT_ROPE_THETA)
    compress_theta = float(raw.get("compress_rope_theta") or DEFAULT_COMPRESS_ROPE_THETA)
    field, entries = _rope_entries(raw)
    if entries is None:  # flat spelling
        return {
            "rope_theta": theta,
            "compress_rope_theta": compress_theta,
            "main_scaling": None,
            "compress_scaling": _scaling(_flat_entry(raw), field, raw, flat_yarn=True),
        }
    out = {}
    for kind, out_theta in (("main", "rope_theta"), ("compress", "compress_rope_theta")):
        entry, name = entries[kind], f"rope_parameters.{kind}"
        _check_partial_rotary(entry, name, raw, rope_dim)
        out[out_theta] = float(entry.get("rope_theta") or theta)
        out[f"{kind}_scaling"] = _scaling(entry, name, raw, flat_yarn=False)
    return out


def _flat_entry(raw: dict) -> dict:
    """The flat scaling dict: ``rope_scaling`` wins over a flat ``rope_parameters``."""
    if raw.get("rope_scaling"):
        return raw["rope_scaling"]
    params = raw.get("rope_parameters") or {}
    return {k: v for k, v in params.items() if k not in ("main", "compress")}


def _rope_entries(raw: dict) -> tuple[str, dict | None]:
    if raw.get("rope_scaling"):
        return "rope_scaling", None
    params = raw.get("rope_parameters") or {}
    nested = [k for k in ("main", "compress") if isinstance(params.get(k), dict)]
    if not nested:
        return "rope_parameters", None
    if len(nested) == 1:
        missing = "compress" if nested == ["main"] else "main"
        raise ConfigError(
            f"rope_parameters has a nested {nested[0]!r} entry but no {missing!r} entry "
            "(transformers would silently ignore the nesting)"
        )
    return "rope_parameters", params


def _rope_type(entry: dict, field: str) -> str:
    kind = entry.get("rope_type", entry.get("type", "default")) or "default"
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{field}.rope_type = {kind!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
        )
    return kind


def _scaling(entry: dict, field: str, raw: dict, flat_yarn: bool) -> RopeScaling | None:
    kind = _rope_type(entry, field)
    if kind == "default":
        return None
    factor = entry.get("factor")
    if kind == "linear":
        if factor is None:
            raise ConfigError(f"{field}.factor is required for linear RoPE")
        return RopeScaling("linear", float(factor))
    max_pos = int(raw.get("max_position_embeddings") or DEFAULT_MAX_POSITION_EMBEDDINGS)
    original = int(entry.get("original_max_position_embeddings") or max_pos)
    if entry.get("truncate") is False:
        raise ConfigError(
            f"{field}.truncate = false is not supported: transformers ignores it for DeepSeek-V4 "
            "and the release truncates the YaRN correction range"
        )
    factor = float(factor) if factor is not None else max_pos / original
    return RopeScaling(
        "yarn",
        factor,
        original_max_position_embeddings=original,
        beta_fast=float(entry.get("beta_fast") or 32),
        beta_slow=float(entry.get("beta_slow") or 1),
        attention_factor=_attention_factor(entry, factor, flat_yarn),
    )


def _attention_factor(entry: dict, factor: float, flat_yarn: bool) -> float:
    if entry.get("attention_factor") is not None:
        return float(entry["attention_factor"])
    if flat_yarn:
        return 1.0
    mscale, mscale_all_dim = entry.get("mscale"), entry.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def _check_partial_rotary(entry: dict, field: str, raw: dict, rope_dim: int) -> None:
    factor = entry.get("partial_rotary_factor")
    if factor is None:
        return
    head_dim = int(raw.get("head_dim") or 512)
    if int(head_dim * factor) != rope_dim:
        raise ConfigError(
            f"{field}.partial_rotary_factor = {factor} rotates {int(head_dim * factor)} of "
            f"head_dim {head_dim} channels; DSV4 rotates qk_rope_head_dim = {rope_dim} in "
            "every layer"
        )


def yarn_inv_freq_bounds(rope: RopeSpec) -> tuple[float, float]:
    """YaRN correction range [low, high] over the frequency index (floor/ceil, clamped)."""
    y = rope.yarn
    assert y is not None
    dim, base = rope.dim, rope.theta

    def corr_dim(rotations: float) -> float:
        return (
            dim
            * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(base))
        )

    low = max(math.floor(corr_dim(y.beta_fast)), 0)
    high = min(math.ceil(corr_dim(y.beta_slow)), dim - 1)
    return float(low), float(high)


def official_rope_keys(
    theta: float,
    compress_theta: float,
    main: RopeScaling | None,
    compress: RopeScaling | None,
) -> dict[str, Any]:
    """The rope keys of an official ``config.json``: ``rope_scaling`` for the compress table when
    the main table is plain, else transformers' nested ``rope_parameters`` (which the official
    keys cannot express)."""
    if main is None:
        return {"rope_scaling": _scaling_dict(compress)} if compress else {}
    nested = {}
    for kind, base, scaling in (("main", theta, main), ("compress", compress_theta, compress)):
        entry = _scaling_dict(scaling) if scaling else {"type": "default"}
        entry["rope_type"] = entry.pop("type")
        nested[kind] = {**entry, "rope_theta": base}
    return {"rope_parameters": nested}


def _scaling_dict(scaling: RopeScaling) -> dict[str, Any]:
    if scaling.rope_type == "linear":
        return {"type": "linear", "factor": scaling.factor}
    return {
        "type": "yarn",
        "factor": scaling.factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
        "beta_fast": scaling.beta_fast,
        "beta_slow": scaling.beta_slow,
        "attention_factor": scaling.attention_factor,
    }
