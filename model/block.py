"""One decoder block: mHC around attention and around the MoE (official parameter names)."""

from __future__ import annotations

import torch
from torch import nn

from dsv4ray.config import LayerSpec, ModelConfig
from dsv4ray.model.layers.attention import Attention, AttnState
from dsv4ray.model.layers.common import RMSNorm
from dsv4ray.model.layers.mhc import hc_post, hc_pre
from dsv4ray.model.layers.moe import MoE


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec) -> None:
        super().__init__()
        self.cfg, self.spec = cfg, spec
        hc, hidden = cfg.hc_mult, cfg.hidden_size
        mix = (2 + hc) * hc
        self.attn_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.zeros(mix, hc * hidden)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros(mix)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3)))
        self.attn = Attention(cfg, spec)
        self.ffn = MoE(cfg, hashed=spec.moe_kind == "hash")

    def new_state(self, batch: int, device, dtype) -> AttnState:
        return self.attn.new_state(batch, device, dtype)

    def forward(
        self,
        x: torch.Tensor,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        state: AttnState,
        prev_topk: torch.Tensor | None,
    ):
        """x [B, t, hc, hidden] -> (x, top-k of this layer or the one passed through)."""
        post, comb, collapsed = self.pre_mix(x, "attn")
        out, topk = self.attn(self.attn_norm(collapsed), positions, state, prev_topk)
        x = hc_post(x, out, post, comb)
        post, comb, collapsed = self.pre_mix(x, "ffn")
        x = hc_post(x, self.ffn(self.ffn_norm(collapsed), token_ids), post, comb)
        return x, (topk if topk is not None else prev_topk)

    def pre_mix(self, x: torch.Tensor, site: str):
        """mHC before a sublayer (site "attn" or "ffn"): (post, comb, the collapsed input)."""
        c = self.cfg
        return hc_pre(
            x,
            getattr(self, f"hc_{site}_fn"),
            getattr(self, f"hc_{site}_base"),
            getattr(self, f"hc_{site}_scale"),
            c.hc_eps,
            c.rms_norm_eps,
            c.hc_sinkhorn_iters,
        )
