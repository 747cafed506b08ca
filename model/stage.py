"""The part of the network one pipeline stage holds: layers [start, end), plus the embedding on
the first stage and the hc head, norm and lm head on the last. Parameter names are the official
checkpoint names (``layers.N`` keyed by the GLOBAL layer id), so a stage loads its slice of any
checkpoint by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4ray.config import ModelConfig
from dsv4ray.model.block import Block
from dsv4ray.model.layers.common import RMSNorm, uninitialised_embedding
from dsv4ray.model.layers.mhc import hc_head


class StageModel(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        start: int = 0,
        end: int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        end = cfg.num_hidden_layers if end is None else end
        if not 0 <= start < end <= cfg.num_hidden_layers:
            raise ValueError(
                f"stage layers [{start}, {end}) not inside [0, {cfg.num_hidden_layers})"
            )
        self.cfg, self.dtype, self.start, self.end = cfg, dtype, start, end
        self.is_first, self.is_last = start == 0, end == cfg.num_hidden_layers
        hc, hidden = cfg.hc_mult, cfg.hidden_size
        if self.is_first:
            self.embed = uninitialised_embedding(cfg.vocab_size, hidden)
        self.layers = nn.ModuleDict({str(i): Block(cfg, cfg.layers[i]) for i in range(start, end)})
        if self.is_last:
            self.norm = RMSNorm(hidden, cfg.rms_norm_eps)
            self.hc_head_fn = nn.Parameter(torch.zeros(hc, hc * hidden))
            self.hc_head_base = nn.Parameter(torch.zeros(hc))
            self.hc_head_scale = nn.Parameter(torch.ones(1))
            self.head = nn.Linear(hidden, cfg.vocab_size, bias=False)
            # a worker may bind kernels with the same contracts
            self.collapse, self.head_linear = hc_head, F.linear

    def owns(self, name: str) -> bool:
        """Whether a checkpoint tensor (official name) belongs to this stage."""
        if name.startswith("layers."):
            return self.start <= int(name.split(".", 2)[1]) < self.end
        if name.startswith("embed."):
            return self.is_first
        if name.startswith("mtp."):
            return False
        return self.is_last

    def block(self, layer_id: int) -> Block:
        return self.layers[str(layer_id)]

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[...] -> the residual stack [..., hc, hidden] (the embedding copied hc times)."""
        e = self.embed(input_ids).to(self.dtype)
        return e.unsqueeze(-2).expand(*e.shape[:-1], self.cfg.hc_mult, e.shape[-1]).contiguous()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Residual stack [..., hc, hidden] -> fp32 logits [..., V]."""
        c = self.cfg
        y = self.collapse(
            x, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, c.hc_eps, c.rms_norm_eps
        )
        h, w = self.norm(y), self.head.weight
        if h.is_cuda and w.dtype in (torch.bfloat16, torch.float16) and h.dtype == w.dtype:
            # 16-bit operands, fp32 accumulation and output: no per-step fp32 copy of the head
            return torch.mm(h.reshape(-1, h.shape[-1]), w.t(), out_dtype=torch.float32).view(
                *h.shape[:-1], w.shape[0]
            )
        return self.head_linear(h.float(), w.float())
