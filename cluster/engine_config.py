"""EngineConfig: every LLM option, validated once, with the option named in each error."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

KV_DTYPES = ("fp8", "bf16", "fp32")
CPU_MAX_TOTAL_TOKENS = 65536
_NOT_YET = {
    "enable_hisparse": "HiSparse",
}
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    pp_size: int = 1
    kv_cache_dtype: str = "fp8"
    max_total_tokens: int | None = None  # cap on logical full-token capacity of the device pools
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill)
    max_running_requests: int = 64
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_hicache: bool = False
    host_cache_tokens: int | None = None  # None: twice the device pool capacity
    hicache_write_policy: str = "write_through"
    enable_hisparse: bool = False
    speculative_num_steps: int = 0
    dtype: str | None = None  # model compute dtype; None = the checkpoint's
    device: str | None = None  # None = cuda when available, else cpu
    memory_fraction: float = 0.85
    use_ray: str | bool = "auto"
    execution_timeout_s: float = 600.0  # a step that takes longer means a stage is stuck

    @classmethod
    def build(cls, model: str, **options) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ValueError(f"unknown LLM option {unknown[0]!r}; known options: {sorted(names)}")
        return cls(model=model, **options)

    def __post_init__(self) -> None:
        if not os.path.isfile(os.path.join(str(self.model), "config.json")):
            raise ValueError(f"model: no config.json in {self.model!r}")
        _int_at_least(self, "pp_size", 1)
        _int_at_least(self, "max_num_batched_tokens", 256)
        _int_at_least(self, "max_running_requests", 1)
        _int_at_least(self, "speculative_num_steps", 0)
        for name in ("max_total_tokens", "max_model_len", "host_cache_tokens"):
            if getattr(self, name) is not None:
                _int_at_least(self, name, 256 if name == "max_total_tokens" else 1)
        if self.kv_cache_dtype not in KV_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.use_ray not in ("auto", True, False):
            raise ValueError(f"use_ray must be 'auto', True or False, got {self.use_ray!r}")
        if self.dtype is not None and self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        self._check_unavailable()
        if self.device is None:
            object.__setattr__(self, "device", "cuda" if torch.cuda.is_available() else "cpu")

    def _check_unavailable(self) -> None:
        for name, what in _NOT_YET.items():
            if getattr(self, name):
                raise ValueError(f"{name}=True needs {what}, which this build does not include")
        if self.speculative_num_steps:
            raise ValueError(
                "speculative_num_steps > 0 needs the MTP draft worker, which this "
                "build does not include"
            )
        if self.pp_size > 1 and self.use_ray is False:
            raise ValueError(
                f"pp_size={self.pp_size} runs its stages as Ray actors; use_ray=False allows "
                "only pp_size 1"
            )
        if self.host_cache_tokens is not None and not self.enable_hicache:
            raise ValueError("host_cache_tokens is set but enable_hicache is False")
        if self.hicache_write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"hicache_write_policy must be one of {WRITE_POLICIES}, got "
                f"{self.hicache_write_policy!r}"
            )
        if self.enable_hicache and not self.enable_prefix_caching:
            raise ValueError(
                "enable_hicache needs enable_prefix_caching (the host tier extends "
                "the prefix cache)"
            )
        if self.enable_hicache and self.use_ray is False:
            raise ValueError("enable_hicache runs a host tier actor; use_ray=False is not allowed")

    @property
    def uses_ray(self) -> bool:
        """In-process when pp_size == 1 and no actor feature is on, Ray actors otherwise."""
        if self.use_ray == "auto":
            return self.pp_size > 1 or self.enable_hicache
        return bool(self.use_ray)

    @property
    def resolved_max_total_tokens(self) -> int | None:
        """None on GPUs means no cap; on CPU machines pools are sized from tokens, never RAM."""
        if self.max_total_tokens is not None or self.device != "cpu":
            return self.max_total_tokens
        return CPU_MAX_TOTAL_TOKENS


def _int_at_least(cfg: EngineConfig, name: str, low: int) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
