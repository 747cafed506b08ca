"""A linear layer that keeps a release checkpoint's quantised weight as stored.

``QuantLinear`` holds the checkpoint's bytes as buffers under the checkpoint's names: ``weight``
(FP8: float8_e4m3fn [N, K]; FP4: int8 [N, K / 2], two e2m1 codes per byte, the even column in the
low nibble) and ``scale`` (FP8: [ceil(N / bn), ceil(K / bk)], fp32, or uint8 ue8m0 exponent bytes
when the release stores ue8m0; FP4: uint8 [N, K / 32]). See ``dsv4ray.model.quant``.

``groups`` > 1 makes it block-diagonal, as the attention's grouped output projection (wo_a) is: an
input [..., G * K] gives [..., N], rows [g N / G, (g + 1) N / G) of the weight applied to input
block g.

Forward runs ``matmul(x, weight, scale, block, groups)`` when the worker installed one (the Triton
kernel on GPUs), else the torch reference: the weight dequantised into x's dtype exactly as the
loader dequantises it, then the dequantised model's own product, so on the torch backend both
formats give the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dsv4ray.config_quant import FP4_GROUP
from dsv4ray.model.quant import QuantizedWeight


class QuantLinear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        kind: str,
        block: tuple[int, int] = (128, 128),
        scale_bytes: bool = True,
        groups: int = 1,
    ) -> None:
        super().__init__()
        if kind not in ("fp8", "fp4"):
            raise ValueError(f"kind must be 'fp8' or 'fp4', got {kind!r}")
        self.in_features, self.out_features = in_features, out_features
        self.kind, self.block, self.groups = kind, tuple(block), groups
        if kind == "fp4":
            weight = torch.empty(out_features, in_features // 2, dtype=torch.int8)
            scale = torch.empty(out_features, in_features // FP4_GROUP, dtype=torch.uint8)
        else:
            weight = torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn)
            grid = (-(-out_features // block[0]), -(-in_features // block[1]))
            scale = torch.empty(grid, dtype=torch.uint8 if scale_bytes else torch.float32)
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        self.matmul: Callable | None = None

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"kind={self.kind}, block={self.block}, groups={self.groups}"
        )

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The [N, K] weight in ``dtype``, as the loader's dequantisation writes it."""
        weight = QuantizedWeight("weight", self.weight, self.scale, self.kind, self.block)
        return weight.dequantize(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., groups * in_features] -> [..., out_features] in x's dtype."""
        flat = x.reshape(-1, x.shape[-1])
        if self.matmul is not None:
            y = self.matmul(flat, self.weight, self.scale, self.block, self.groups)
        else:
            y = self._reference(flat)
        return y.view(*x.shape[:-1], self.out_features)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        w = self.dequantized(x.dtype)
        if self.groups == 1:
            return F.linear(x, w)
        grouped = x.view(x.shape[0], self.groups, -1).transpose(0, 1)  # [G, M, K]
        w = w.view(self.groups, -1, w.shape[1])  # [G, N / G, K]
        return torch.bmm(grouped, w.transpose(1, 2)).transpose(0, 1).reshape(x.shape[0], -1)
