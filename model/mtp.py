"""The MTP (NextN) draft block: one extra layer that shares the embedding and the lm head.

Inputs are the target's pre-head residual stack h [B, t, hc, hidden] at positions p and the
tokens at p + 1; x = e_proj(enorm(embed(token))) (broadcast over hc) + h_proj(hnorm(h)) runs
through a window-only block (or, with a last compress_ratios entry of 4, a C4 block that reuses
the target's top-k), then its own hc head, the shared norm-free head path: logits =
head(norm(hc_head(x))). Its own pre-head stack feeds the next draft step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4ray.config import ModelConfig
from dsv4ray.model.block import Block
from dsv4ray.model.layers.attention import AttnState
from dsv4ray.model.layers.common import RMSNorm, linear, uninitialised_embedding
from dsv4ray.model.layers.mhc import hc_head


class MTPBlock(Block):
    def __init__(self, cfg: ModelConfig) -> None:
        assert cfg.mtp_layer is not None
        super().__init__(cfg, cfg.mtp_layer)
        hc, hidden = cfg.hc_mult, cfg.hidden_size
        self.e_proj, self.h_proj = linear(hidden, hidden), linear(hidden, hidden)
        self.enorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hc_head_fn = nn.Parameter(torch.zeros(hc, hc * hidden))
        self.hc_head_base = nn.Parameter(torch.zeros(hc))
        self.hc_head_scale = nn.Parameter(torch.ones(1))
        # a worker may bind kernels with the same contracts
        self.collapse, self.head_linear = hc_head, F.linear
        self._dtype = torch.float32

    def new_state(self, batch: int, device=None, dtype=None) -> AttnState:
        device = device or self.e_proj.weight.device
        return super().new_state(batch, device, dtype or self.e_proj.weight.dtype)

    def draft(
        self,
        h: torch.Tensor,
        embed: torch.Tensor,
        head_weight: torch.Tensor,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        state: AttnState,
        topk: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h [B, t, hc, hidden], embed = embedding of token_ids [B, t, hidden] ->
        (logits [B, t, V] fp32, own pre-head stack [B, t, hc, hidden])."""
        x, _ = self.forward(self.mix(h, embed), token_ids, positions, state, topk)
        return self.head_logits(x, head_weight), x

    def mix(self, h: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        """The block's input: e_proj(enorm(embed)) broadcast over hc + h_proj(hnorm(h)).
        h [..., hc, hidden], embed [..., hidden] -> [..., hc, hidden]."""
        e = self.e_proj(self.enorm(embed.to(h.dtype)))
        return e.unsqueeze(-2) + self.h_proj(self.hnorm(h))

    def head_logits(self, x: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        """Own pre-head stack [..., hc, hidden] -> fp32 logits [..., V] through the shared head."""
        c = self.cfg
        y = self.collapse(
            x, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, c.hc_eps, c.rms_norm_eps
        )
        h = self.norm(y)
        if h.is_cuda and head_weight.dtype in (torch.bfloat16, torch.float16):
            # 16-bit operands, fp32 accumulation and output: no fp32 copy of the head per call
            flat = torch.mm(h.reshape(-1, h.shape[-1]).to(head_weight.dtype), head_weight.t(),
                            out_dtype=torch.float32)  # fmt: skip
            return flat.view(*h.shape[:-1], head_weight.shape[0])
        return self.head_linear(h.float(), head_weight.float())


class DraftModel(nn.Module):
    """What a draft worker holds: the MTP block (``mtp.0.*``) and the target's embedding and lm
    head, which the block shares (official names, so it loads its slice of any checkpoint)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.embed = uninitialised_embedding(cfg.vocab_size, cfg.hidden_size)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleList([MTPBlock(cfg)])

    @staticmethod
    def owns(name: str) -> bool:
        return name.startswith(("embed.", "head.", "mtp.0."))

    @property
    def block(self) -> MTPBlock:
        return self.mtp[0]
