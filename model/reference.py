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
from torch import nn

from dsv4ray.config import ModelConfig
from dsv4ray.model.layers.attention import AttnState
from dsv4ray.model.stage import StageModel


@dataclass
class RefState:
    """Incremental state of a batch: per-layer window/compressor state and the length so far."""

    layers: list[AttnState]
    num_tokens: int = 0
    mtp: object | None = None
    extras: dict = field(default_factory=dict)


class DSV4Reference(StageModel):
    """All layers of the network plus the MTP block; parameters carry the official names."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(cfg, 0, cfg.num_hidden_layers, dtype)
        # mtp.0 (the NextN block) when the checkpoint has mtp.* tensors; empty otherwise.
        self.mtp = nn.ModuleList()

    def owns(self, name: str) -> bool:
        return True

    @property
    def draft_block(self):
        return self.mtp[0] if len(self.mtp) else None

    def new_state(self, batch: int) -> RefState:
        layers = [blk.new_state(batch, self.device, self.dtype) for blk in self.layers.values()]
        mtp = self.draft_block.new_state(batch) if self.draft_block is not None else None
        return RefState(layers, 0, mtp)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.step(input_ids, self.new_state(input_ids.shape[0]))

    @torch.inference_mode()
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

    @torch.inference_mode()
    def greedy(self, prompt: list[int], num_tokens: int) -> list[int]:
        """The greedy continuation of one prompt on the incremental path (the engine's oracle)."""
        state = self.new_state(1)
        logits = self.step(torch.tensor([prompt]), state)[0, -1]
        out = [int(logits.argmax())] if num_tokens > 0 else []
        while len(out) < num_tokens:
            logits = self.step(torch.tensor([[out[-1]]]), state)[0, -1]
            out.append(int(logits.argmax()))
        return out

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
        end = self.cfg.num_hidden_layers if end is None else end
        for i in range(start, end):
            x, topk = self.block(i)(x, input_ids, positions, state.layers[i], topk)
        return x, topk
