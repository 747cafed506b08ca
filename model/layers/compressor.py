"""KV compressor: every ``ratio`` tokens become one entry.

Ratio 128 pools one block with a per-channel softmax. Ratio 4 overlaps: each token's 2d vector
splits into a first half feeding the NEXT block and a second half feeding its own block, so entry
w softmaxes over 8 slots (first halves of block w-1, second halves of block w). Entries are then
RMS-normed and roped at the block's first position.

State between calls (per request row): the rows of the current partial block and, for ratio 4,
the previous full block. Rows hold ``[kv | score + ape]`` in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dsv4ray.config import RopeSpec
from dsv4ray.model.layers.common import RMSNorm, linear, rms_norm
from dsv4ray.model.layers.rope import apply_rope, cos_sin


@dataclass
class CompressorState:
    """Per-layer compressor state for a batch whose rows share one length."""

    kv: torch.Tensor  # [B, n_pending, c*d] rows of the partial block
    score: torch.Tensor  # [B, n_pending, c*d] (ape already added)
    prev_kv: torch.Tensor | None  # [B, ratio, c*d] last full block (ratio 4 only)
    prev_score: torch.Tensor | None
    entries: torch.Tensor  # [B, n_entries, d] every entry produced so far
    num_entries: int = 0


class Compressor(nn.Module):
    """Parameters ``wkv``, ``wgate`` (hidden -> c*d), ``ape`` [ratio, c*d], ``norm`` (d)."""

    def __init__(self, hidden: int, dim: int, ratio: int, rope: RopeSpec, eps: float) -> None:
        super().__init__()
        self.ratio, self.dim, self.rope = ratio, dim, rope
        self.overlap = ratio == 4
        width = (2 if self.overlap else 1) * dim
        self.wkv = linear(hidden, width)
        self.wgate = linear(hidden, width)
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.norm = RMSNorm(dim, eps)

    def new_state(self, batch: int, device, dtype) -> CompressorState:
        width = self.wkv.out_features
        empty = torch.zeros(batch, 0, width, device=device, dtype=torch.float32)
        return CompressorState(
            empty,
            empty.clone(),
            None,
            None,
            torch.zeros(batch, 0, self.dim, device=device, dtype=dtype),
        )

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, state: CompressorState
    ) -> torch.Tensor:
        """x [B, t, hidden] at ``positions`` [t]: adds new entries, returns all [B, n, d]."""
        kv = self.wkv(x).float()
        score = self.wgate(x).float() + self.ape[positions % self.ratio]
        rows_kv = torch.cat([state.kv, kv], dim=1)
        rows_score = torch.cat([state.score, score], dim=1)
        num_blocks = rows_kv.shape[1] // self.ratio
        used = num_blocks * self.ratio
        state.kv, state.score = rows_kv[:, used:], rows_score[:, used:]
        if num_blocks:
            blocks_kv = rows_kv[:, :used].unflatten(1, (num_blocks, self.ratio))
            blocks_score = rows_score[:, :used].unflatten(1, (num_blocks, self.ratio))
            new = self._pool(blocks_kv, blocks_score, state)
            new = self._norm_rope(new, state.num_entries, x.dtype)
            state.entries = torch.cat([state.entries, new], dim=1)
            state.num_entries += num_blocks
        return state.entries

    def _pool(self, kv: torch.Tensor, score: torch.Tensor, state: CompressorState) -> torch.Tensor:
        """kv/score [B, nb, ratio, c*d] -> pooled [B, nb, d] (fp32)."""
        if not self.overlap:
            return (kv * score.softmax(dim=2)).sum(dim=2)
        d, r = self.dim, self.ratio
        batch, nb = kv.shape[:2]
        prev_kv = kv.new_zeros(batch, nb, r, d)
        prev_score = score.new_full((batch, nb, r, d), float("-inf"))
        prev_kv[:, 1:] = kv[:, :-1, :, :d]
        prev_score[:, 1:] = score[:, :-1, :, :d]
        if state.prev_kv is not None:
            prev_kv[:, 0] = state.prev_kv[:, :, :d]
            prev_score[:, 0] = state.prev_score[:, :, :d]
        state.prev_kv, state.prev_score = kv[:, -1], score[:, -1]
        slots_kv = torch.cat([prev_kv, kv[..., d:]], dim=2)  # [B, nb, 2r, d]
        slots_score = torch.cat([prev_score, score[..., d:]], dim=2)
        return (slots_kv * slots_score.softmax(dim=2)).sum(dim=2)

    def _norm_rope(self, pooled: torch.Tensor, first_entry: int, dtype) -> torch.Tensor:
        pooled = rms_norm(pooled.to(dtype), self.norm.weight, self.norm.eps)
        entry_ids = torch.arange(first_entry, first_entry + pooled.shape[1], device=pooled.device)
        cos, sin = cos_sin(self.rope, entry_ids * self.ratio)
        return apply_rope(pooled, cos, sin)
