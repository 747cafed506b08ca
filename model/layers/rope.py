"""Interleaved RoPE on the trailing ``rope.dim`` channels, with YaRN on compressed layers.

One table per layer kind serves the query, the window kv, the compressed entries, the indexer
q/k and the output de-rotation. Pairs are channels (2i, 2i + 1).
A table's ``attention_factor`` multiplies cos and sin (as transformers applies YaRN's mscale),
so every rotation, the de-rotation included, scales by it; the release's tables use 1.0.
"""

from functools import lru_cache

import torch

from dsv4ray.config import RopeSpec, yarn_inv_freq_bounds


@lru_cache(maxsize=16)
def inv_freq(rope: RopeSpec) -> torch.Tensor:
    """[dim / 2] fp32 inverse frequencies (divided by a linear factor, or YaRN-blended)."""
    pos_freqs = rope.theta ** (torch.arange(0, rope.dim, 2, dtype=torch.float) / rope.dim)
    if rope.scaling is None:
        return 1.0 / pos_freqs
    if rope.yarn is None:  # linear
        return 1.0 / pos_freqs / rope.scaling.factor
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rope.yarn.factor * pos_freqs)
    low, high = yarn_inv_freq_bounds(rope)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope.dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # share of the unscaled (extrapolated) frequency
    return interpolation * (1 - keep) + extrapolation * keep


def cos_sin(rope: RopeSpec, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] int -> (cos, sin) [..., dim / 2] fp32."""
    freqs = positions[..., None].float() * inv_freq(rope).to(positions.device)
    if rope.attention_factor == 1.0:
        return freqs.cos(), freqs.sin()
    return freqs.cos() * rope.attention_factor, freqs.sin() * rope.attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates the last ``2 * cos.shape[-1]`` channels of x; cos/sin broadcast over x[..., :half].

    Pass ``-sin`` for the conjugate rotation (the attention output's de-rotation).
    """
    rope_dim = 2 * cos.shape[-1]
    nope, rot = x[..., :-rope_dim], x[..., -rope_dim:].float()
    x0, x1 = rot[..., 0::2], rot[..., 1::2]
    y0 = x0 * cos - x1 * sin
    y1 = x1 * cos + x0 * sin
    rotated = torch.stack((y0, y1), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def rope_tables(rope: RopeSpec, max_pos: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [max_pos, dim / 2] fp32 tables for the kernels."""
    return cos_sin(rope, torch.arange(max_pos, device=device))
