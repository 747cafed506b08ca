"""Block-quantised weights as the release stores them, and their dequantisation.

Byte layouts (a linear weight is [N, K]: N output rows, K input columns):

- FP8: ``weight`` float8_e4m3fn [N, K]; ``scale`` [ceil(N / bn), ceil(K / bk)] for
  ``weight_block_size`` (bn, bk), either float32 or ue8m0 (float8_e8m0fnu, or raw uint8 exponent
  bytes b meaning 2^(b - 127)). Value = fp8 * scale of its block.
- FP4 (routed experts, ``expert_dtype`` "fp4"): ``weight`` int8 [N, K / 2], two e2m1 codes per
  byte, the LOW nibble holding the even column; ``scale`` ue8m0 [N, K / 32], one per 32 values of a
  row. Value = e2m1 * scale.

``QuantizedWeight.dequantize_into`` writes fp32 products (``float(code) * float(scale)``, exact
for power-of-two scales) cast to the destination's dtype, a band of rows at a time, so loading
holds one weight's quantised bytes plus one band of fp32 beyond the destination.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dsv4ray.config_quant import FP4_GROUP

FP8_MAX = 448.0  # largest finite float8_e4m3fn
# e2m1 code -> value; bit 3 is the sign, bits 2..1 the exponent, bit 0 the mantissa.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES += tuple(-v for v in E2M1_VALUES)
BAND_ROWS = 128  # rows dequantised per step


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Scales in any stored form -> fp32 multipliers (uint8 holds ue8m0 exponent bytes)."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


def _byte_pairs(device) -> torch.Tensor:
    """[256, 2] fp32: byte b -> (value of its low nibble, value of its high nibble)."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.stack((lut.repeat(16), lut.repeat_interleave(16)), dim=-1)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K / 2] packed e2m1 pairs -> [..., K] fp32 (low nibble first)."""
    codes = packed.contiguous().view(torch.uint8)
    pairs = _byte_pairs(packed.device).index_select(0, codes.flatten().long())
    return pairs.view(*codes.shape[:-1], 2 * codes.shape[-1])


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] e2m1 codes (0..15) -> [..., K / 2] int8, the even column in the low nibble."""
    codes = codes.to(torch.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.int8)


@dataclass
class QuantizedWeight:
    """One quantised checkpoint weight with its scale; ``kind`` is "fp8" or "fp4"."""

    name: str
    data: torch.Tensor
    scale: torch.Tensor
    kind: str
    block: tuple[int, int] = (128, 128)  # fp8 only

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.data.shape
        return (rows, 2 * cols) if self.kind == "fp4" else (rows, cols)

    def expected_scale_shape(self) -> tuple[int, int]:
        rows, cols = self.shape
        if self.kind == "fp4":
            return rows, cols // FP4_GROUP
        return math.ceil(rows / self.block[0]), math.ceil(cols / self.block[1])

    def dequantize_band(self, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) -> fp32 [end - start, K]."""
        if self.kind == "fp4":
            values = unpack_fp4(self.data[start:end])
            scale = scale_to_float(self.scale[start:end])
            return values * scale.repeat_interleave(FP4_GROUP, dim=1)
        block_rows, block_cols = self.block
        values = self.data[start:end].float()
        row_blocks = torch.arange(start, end, device=values.device) // block_rows
        scale = scale_to_float(self.scale)[row_blocks]  # [rows, K-blocks]
        return values * scale.repeat_interleave(block_cols, dim=1)[:, : values.shape[1]]

    @torch.no_grad()
    def dequantize_into(self, out: torch.Tensor) -> None:
        for start in range(0, out.shape[0], BAND_ROWS):
            end = min(start + BAND_ROWS, out.shape[0])
            out[start:end].copy_(self.dequantize_band(start, end))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=dtype, device=self.data.device)
        self.dequantize_into(out)
        return out


def quantize_fp8(
    weight: torch.Tensor, block: tuple[int, int], scale_fmt: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (float8_e4m3fn [N, K], scale [ceil(N / bn), ceil(K / bk)]) on weight's device:
    each block's scale maps its largest magnitude to FP8_MAX (rounded up to a power of two for
    "ue8m0")."""
    rows, cols = weight.shape
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    padded = torch.zeros(
        grid[0] * block[0], grid[1] * block[1], dtype=torch.float32, device=weight.device
    )
    padded[:rows, :cols] = weight.float()
    tiles = padded.view(grid[0], block[0], grid[1], block[1])
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # [grid rows, grid cols]
    scale = amax / FP8_MAX
    if scale_fmt == "ue8m0":
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    codes = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    codes = codes.view(padded.shape)[:rows, :cols].contiguous()
    stored = scale.to(torch.float8_e8m0fnu) if scale_fmt == "ue8m0" else scale
    return codes, stored


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (int8 [N, K / 2], float8_e8m0fnu [N, K / 32]) on weight's device: a power-of-two
    scale per 32 values maps their largest magnitude to at most 6, then each value takes the
    nearest code."""
    rows, cols = weight.shape
    groups = weight.float().view(rows, cols // FP4_GROUP, FP4_GROUP)
    amax = groups.abs().amax(dim=-1).clamp(min=1e-12)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 6.0)))  # [N, K / 32]
    scaled = (groups / scale[..., None]).view(rows, cols)
    magnitudes = torch.tensor(E2M1_VALUES[:8], device=weight.device)
    midpoints = (magnitudes[1:] + magnitudes[:-1]) / 2
    codes = torch.bucketize(scaled.abs(), midpoints)  # nearest magnitude code 0..7
    codes |= (scaled < 0).to(torch.long) << 3
    return pack_fp4(codes), scale.to(torch.float8_e8m0fnu)
