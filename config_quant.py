"""``quantization_config`` of block-quantised release checkpoints (dequantised at load).

The release ships FP8 e4m3 linear weights with one scale per ``weight_block_size`` block
(``scale_fmt`` "ue8m0": one exponent byte per block; "float": fp32 scales), bf16 compressor and
indexer projections beside them, and routed experts in FP8 (the same blocks) or, with
``expert_dtype`` "fp4", as e2m1 pairs packed into int8 bytes with one ue8m0 scale per 32 values of
a row. ``expert_dtype`` may sit at the top level of ``config.json`` (V4) or inside
``quantization_config`` (V4.1); as in transformers, the one inside wins.

Keys that only steer how transformers builds FP8 modules (``modules_to_not_convert``,
``dequantize``) do not change what dequantisation at load computes: a weight is dequantised when
it is stored quantised with its scale beside it, whatever module it belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsv4ray.config_error import ConfigError

SCALE_FORMATS = ("float", "ue8m0")
EXPERT_DTYPES = ("fp8", "fp4")
FP4_GROUP = 32  # e2m1 values sharing one ue8m0 scale along a row
# The largest ue8m0 byte of an FP4 scale the native kernels decode (2^1, groups of magnitude up to
# 12: they take 2^126 of each code's value into a bf16 scale); no trained weight comes near it.
FP4_MAX_SCALE_BYTE = 128
# Layouts make_tiny writes -> (scale_fmt, expert_dtype): "fp8" is the all-FP8 layout with fp32
# scales (V4 base models), "fp8+fp4-experts" the V4-Flash one (ue8m0 scales, FP4 experts).
RELEASE_LAYOUTS = {"fp8": ("float", "fp8"), "fp8+fp4-experts": ("ue8m0", "fp4")}


@dataclass(frozen=True)
class QuantConfig:
    weight_block_size: tuple[int, int] = (128, 128)  # (rows, cols) of one fp8 scale block
    scale_fmt: str = "float"
    expert_dtype: str = "fp8"
    fmt: str = "e4m3"
    activation_scheme: str = "dynamic"
    quant_method: str = "fp8"

    def __post_init__(self) -> None:
        block = self.weight_block_size
        if len(block) != 2 or not all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block
        ):
            raise ConfigError(
                f"quantization_config.weight_block_size must be two positive integers, got {block}"
            )
        _one_of("quant_method", self.quant_method, ("fp8",))
        _one_of("fmt", self.fmt, ("e4m3",))
        _one_of("scale_fmt", self.scale_fmt, SCALE_FORMATS)
        _one_of("expert_dtype", self.expert_dtype, EXPERT_DTYPES)
        _one_of("activation_scheme", self.activation_scheme, ("dynamic",))

    @classmethod
    def from_raw(cls, raw: dict) -> QuantConfig | None:
        """The ``quantization_config`` of a raw config dict (None when absent)."""
        qcfg = raw.get("quantization_config")
        if not qcfg:
            if raw.get("expert_dtype") not in (None, "bf16", "bfloat16"):
                raise ConfigError(
                    f"expert_dtype = {raw['expert_dtype']!r} needs a quantization_config"
                )
            return None
        if not isinstance(qcfg, dict):
            raise ConfigError(f"quantization_config must be a mapping, got {type(qcfg).__name__}")
        expert_dtype = qcfg.get("expert_dtype") or raw.get("expert_dtype") or "fp8"
        block = qcfg.get("weight_block_size") or (128, 128)
        return cls(
            weight_block_size=tuple(block),
            scale_fmt=str(qcfg.get("scale_fmt") or "float"),
            expert_dtype=str(expert_dtype),
            fmt=str(qcfg.get("fmt") or "e4m3"),
            activation_scheme=str(qcfg.get("activation_scheme") or "dynamic").lower(),
            quant_method=str(qcfg.get("quant_method") or "fp8"),
        )

    def to_dict(self) -> dict[str, Any]:
        """The release's spelling (``expert_dtype`` goes to the top level, as in V4)."""
        return {
            "quant_method": self.quant_method,
            "fmt": self.fmt,
            "weight_block_size": list(self.weight_block_size),
            "scale_fmt": self.scale_fmt,
            "activation_scheme": self.activation_scheme,
        }


def _one_of(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(
            f"quantization_config.{name} = {value!r} is not supported (supported: {list(allowed)})"
        )
