"""Lightning indexer of C4 layers: scores compressed entries per query and keeps the top-k.

score(t, s) = sum_h relu(q[t, h] . k[s]) * 128^-0.5 * w[t, h], with w = weights_proj(x) * heads^-0.5
and k the indexer compressor's entries (d = 128). Entries s >= (t + 1) // 4 are not visible yet.
Tie rule (everywhere in dsv4ray): among equal scores the lower entry index wins, so chunking
and paging never change a selection.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4ray.config import RopeSpec
from dsv4ray.model.layers.common import linear
from dsv4ray.model.layers.compressor import Compressor, CompressorState
from dsv4ray.model.layers.rope import apply_rope, cos_sin


class Indexer(nn.Module):
    """Parameters ``wq_b`` [heads*128, q_lora], ``weights_proj`` [heads, hidden], ``compressor``."""

    def __init__(
        self,
        hidden: int,
        q_lora: int,
        heads: int,
        head_dim: int,
        topk: int,
        rope: RopeSpec,
        eps: float,
    ) -> None:
        super().__init__()
        self.heads, self.head_dim, self.topk, self.rope = heads, head_dim, topk, rope
        self.wq_b = linear(q_lora, heads * head_dim)
        self.weights_proj = linear(hidden, heads)
        self.compressor = Compressor(hidden, head_dim, 4, rope, eps)

    def new_state(self, batch: int, device, dtype) -> CompressorState:
        return self.compressor.new_state(batch, device, dtype)

    def forward(
        self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, state: CompressorState
    ) -> torch.Tensor:
        """x [B, t, hidden], qr [B, t, q_lora] -> top-k C4 positions [B, t, k] (-1 = none)."""
        keys = self.compressor(x, positions, state)  # [B, n, 128]
        q = self.wq_b(qr).unflatten(-1, (self.heads, self.head_dim))
        cos, sin = cos_sin(self.rope, positions)
        q = apply_rope(q, cos[:, None], sin[:, None])
        weights = self.weights_proj(x).float() * self.heads**-0.5
        scores = index_scores(q, keys, weights)  # [B, t, n]
        return select_topk(scores, (positions + 1) // 4, self.topk)


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """q [B, t, H, 128], keys [B, n, 128], weights [B, t, H] -> [B, t, n] fp32."""
    dots = torch.einsum("bthd,bnd->bthn", q.float(), keys.float())
    dots = torch.relu(dots) * q.shape[-1] ** -0.5
    return (dots * weights.float().unsqueeze(-1)).sum(dim=2)


def select_topk(scores: torch.Tensor, bound: torch.Tensor, topk: int) -> torch.Tensor:
    """scores [..., t, n], bound [t] visible-entry counts -> [..., t, min(topk, n)] (-1 padded)."""
    n = scores.shape[-1]
    k = min(topk, n)
    entry = torch.arange(n, device=scores.device)
    visible = entry < bound[:, None]  # [t, n]
    masked = scores.masked_fill(~visible, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.where(order < bound[:, None], order, torch.full_like(order, -1))
