"""Dense reference of the DeepSeek-V4 network: the numerical oracle of every other path.

``module(input_ids [B, T]) -> logits [B, T, V]`` runs the full sequence; the incremental path
``state = module.new_state(B)``, ``module.step(input_ids [B, t], state) -> logits [B, t, V]``
appends t tokens to every row (rows share one length). Both run the same layer code: the full
forward is one step from an empty state, so chunked and token-by-token decoding differ from it
only in how the compressor and window state carry across calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dsv4ray.config import ModelConfig
from dsv4ray.model.block import Block
from dsv4ray.model.layers.attention import AttnState
from dsv4ray.model.layers.common import RMSNorm
from dsv4ray.model.layers.mhc import hc_head


@dataclass
class RefState:
    """Incremental state of a batch: per-layer window/compressor state and the length so far."""

    layers: list[AttnState]
    num_tokens: int = 0
    mtp: object | None = None
    extras: dict = field(default_factory=dict)


class DSV4Reference(nn.Module):
    """Parameters carry the official checkpoint names (``embed``, ``layers.N.attn.wq_a``, ...)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        hc, hidden = cfg.hc_mult, cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, hidden)
        self.layers = nn.ModuleList(Block(cfg, spec) for spec in cfg.layers)
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hc_head_fn = nn.Parameter(torch.zeros(hc, hc * hidden))
        self.hc_head_base = nn.Parameter(torch.zeros(hc))
        self.hc_head_scale = nn.Parameter(torch.ones(1))
        self.head = nn.Linear(hidden, cfg.vocab_size, bias=False)
        # mtp.0 (the NextN block) when the checkpoint has mtp.* tensors; empty otherwise.
        self.mtp = nn.ModuleList()

    @property
    def draft_block(self):
        return self.mtp[0] if len(self.mtp) else None

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_state(self, batch: int) -> RefState:
        layers = [blk.new_state(batch, self.device, self.dtype) for blk in self.layers]
        mtp = self.draft_block.new_state(batch) if self.draft_block is not None else None
        return RefState(layers, 0, mtp)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.step(input_ids, self.new_state(input_ids.shape[0]))

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, state: RefState, return_hidden: bool = False):
        """Appends input_ids [B, t] to every row; returns logits [B, t, V] (fp32).

        With ``return_hidden`` also returns the pre-head residual stack [B, t, hc, hidden] and the
        last C4 layer's top-k (the MTP draft block's inputs).
        """
        input_ids = input_ids.to(self.device)
        t = input_ids.shape[1]
        positions = torch.arange(state.num_tokens, state.num_tokens + t, device=self.device)
        x, last_topk = self.run_layers(self.embed_tokens(input_ids), input_ids, positions, state)
        state.num_tokens += t
        logits = self.logits(x)
        return (logits, x, last_topk) if return_hidden else logits

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, t] -> the residual stack [B, t, hc, hidden] (the embedding copied hc times)."""
        e = self.embed(input_ids).to(self.dtype)
        return e.unsqueeze(-2).expand(*e.shape[:-1], self.cfg.hc_mult, e.shape[-1]).contiguous()

    def run_layers(
        self,
        x,
        input_ids,
        positions,
        state: RefState,
        start: int = 0,
        end=None,
        topk: torch.Tensor | None = None,
    ):
        """Runs layers [start, end) on the residual stack; returns (x, running top-k)."""
        end = len(self.layers) if end is None else end
        for i in range(start, end):
            x, topk = self.layers[i](x, input_ids, positions, state.layers[i], topk)
        return x, topk

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        y = hc_head(
            x, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, c.hc_eps, c.rms_norm_eps
        )
        return F.linear(self.norm(y).float(), self.head.weight.float())
