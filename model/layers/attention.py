"""One layer's attention: shared K=V MQA over window + compressed entries with a per-head sink.

Keys seen by the query at position t, in ONE softmax: raw window
tokens max(0, t-127)..t; on C4 layers the indexer's top-k of entries w < (t+1)//4; on C128
layers all entries w < (t+1)//128. The sink joins only the denominator. The output's rope
channels are rotated back at the query position, then the grouped output projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dsv4ray.config import LayerSpec, ModelConfig
from dsv4ray.model.layers.common import RMSNorm, linear, unweighted_rms_norm
from dsv4ray.model.layers.compressor import Compressor, CompressorState
from dsv4ray.model.layers.indexer import Indexer
from dsv4ray.model.layers.rope import apply_rope, cos_sin


@dataclass
class AttnState:
    window: torch.Tensor  # [B, <= window-1, D] kv of the latest tokens
    compressor: CompressorState | None
    indexer: CompressorState | None


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec) -> None:
        super().__init__()
        self.spec, self.cfg = spec, cfg
        heads, dim = cfg.num_attention_heads, cfg.head_dim
        self.heads, self.dim, self.window = heads, dim, cfg.sliding_window
        self.wq_a = linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = linear(cfg.q_lora_rank, heads * dim)
        self.wkv = linear(cfg.hidden_size, dim)
        self.kv_norm = RMSNorm(dim, cfg.rms_norm_eps)
        self.wo_a = linear(heads * dim // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)
        self.wo_b = linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size)
        self.attn_sink = nn.Parameter(torch.zeros(heads, dtype=torch.float32))
        self.grouped_linear = grouped_linear  # a worker may bind a kernel with the same contract
        ratio = spec.compress_ratio
        if ratio:
            self.compressor = Compressor(cfg.hidden_size, dim, ratio, spec.rope, cfg.rms_norm_eps)
        if spec.has_indexer:
            self.indexer = Indexer(
                cfg.hidden_size,
                cfg.q_lora_rank,
                cfg.index_n_heads,
                cfg.index_head_dim,
                cfg.index_topk,
                spec.rope,
                cfg.rms_norm_eps,
            )

    def new_state(self, batch: int, device, dtype) -> AttnState:
        window = torch.zeros(batch, 0, self.dim, device=device, dtype=dtype)
        comp = self.compressor.new_state(batch, device, dtype) if self.spec.compress_ratio else None
        idx = self.indexer.new_state(batch, device, dtype) if self.spec.has_indexer else None
        return AttnState(window, comp, idx)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        state: AttnState,
        prev_topk: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [B, t, hidden] -> (out [B, t, hidden], this layer's top-k [B, t, k] or None)."""
        cos, sin = cos_sin(self.spec.rope, positions)
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).unflatten(-1, (self.heads, self.dim))
        q = apply_rope(unweighted_rms_norm(q, self.cfg.rms_norm_eps), cos[:, None], sin[:, None])
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)  # [B, t, D]
        keys, bias = self._window_keys(kv, positions, state)
        topk = None
        if self.spec.compress_ratio:
            entries = self.compressor(x, positions, state.compressor)
            topk = self._topk(x, qr, positions, state, prev_topk)
            keys = torch.cat([keys, entries], dim=1)
            entry_bias = self._entry_bias(entries.shape[1], positions, topk)
            if entry_bias.dim() == 3:
                bias = bias.expand(entry_bias.shape[0], *bias.shape)
            bias = torch.cat([bias, entry_bias], dim=-1)
        o = attend(q, keys, bias, self.attn_sink, self.dim**-0.5)
        o = apply_rope(o, cos[:, None], -sin[:, None])
        return self.project_out(o), topk

    def _window_keys(self, kv, positions, state):
        """Window keys [B, w + t, D] and their additive mask [t, w + t]."""
        keys = torch.cat([state.window, kv], dim=1)
        state.window = keys[:, -(self.window - 1) :] if self.window > 1 else keys[:, :0]
        first = positions[0] - (keys.shape[1] - kv.shape[1])
        key_pos = torch.arange(keys.shape[1], device=kv.device) + first
        delta = positions[:, None] - key_pos[None, :]
        visible = (delta >= 0) & (delta < self.window)
        return keys, _bias(visible)

    def _topk(self, x, qr, positions, state, prev_topk):
        if self.spec.compress_ratio != 4:
            return None
        if self.spec.skip_topk:
            if prev_topk is None:
                raise RuntimeError(f"layer {self.spec.layer_id} shares a top-k but none was given")
            return prev_topk
        return self.indexer(x, qr, positions, state.indexer)

    def _entry_bias(self, num_entries: int, positions: torch.Tensor, topk) -> torch.Tensor:
        """Mask over compressed entries: [t, n] (C128) or [B, t, n] (C4 top-k)."""
        ratio = self.spec.compress_ratio
        entry = torch.arange(num_entries, device=positions.device)
        causal = entry[None, :] < ((positions + 1) // ratio)[:, None]
        if ratio == 128:
            return _bias(causal)
        chosen = torch.zeros(
            *topk.shape[:-1], num_entries + 1, dtype=torch.bool, device=topk.device
        )
        chosen.scatter_(-1, torch.where(topk >= 0, topk, num_entries), True)
        return _bias(chosen[..., :num_entries] & causal)

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        """Grouped output projection: o [B, t, H, D] -> [B, t, hidden]."""
        groups, lead = self.cfg.o_groups, o.shape[:-2]
        if not isinstance(self.wo_a, nn.Linear):  # kept quantised: block-diagonal over groups
            return self.wo_b(self.wo_a(o.reshape(*lead, -1)))
        y = self.grouped_linear(o.reshape(-1, o.shape[-2] * o.shape[-1]), self.wo_a.weight, groups)
        return self.wo_b(y.view(*lead, -1))


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """Block-diagonal linear: x [N, G * K], weight [G * R, K] -> [N, G * R], group g's R outputs
    from x's columns [g K, (g + 1) K)."""
    grouped = x.view(x.shape[0], groups, -1)  # [N, G, K]
    w = weight.view(groups, -1, grouped.shape[-1])  # [G, R, K]
    # one strided batched GEMM over the groups (an einsum here picked a slow unaligned kernel)
    y = torch.bmm(grouped.transpose(0, 1), w.transpose(1, 2))  # [G, N, R]
    return y.transpose(0, 1).reshape(x.shape[0], -1)


def _bias(visible: torch.Tensor) -> torch.Tensor:
    return torch.zeros(visible.shape, device=visible.device).masked_fill(~visible, float("-inf"))


def attend(
    q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, t, H, D], keys (= values) [B, n, D], bias [t, n] or [B, t, n] -> o [B, t, H, D]."""
    scores = torch.einsum("bthd,bnd->bhtn", q.float(), keys.float()) * scale
    scores = scores + (bias[:, None] if bias.dim() == 3 else bias)
    sinks = sink.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    logits = torch.cat([scores, sinks], dim=-1)
    probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    o = torch.einsum("bhtn,bnd->bthd", probs, keys.float())
    return o.to(q.dtype)
