"""Sampling on the last stage: greedy, temperature, top-k, top-p, per-request seeded generators.

A request's generator is seeded once (its seed, or one the scheduler picked) and advanced only by
that request's draws, so its tokens do not depend on what else shares the batch.
"""

from __future__ import annotations

import torch


class RequestSampler:
    def __init__(self, params: dict, seed: int) -> None:
        self.temperature = float(params.get("temperature", 0.0))
        self.top_p = float(params.get("top_p", 1.0))
        self.top_k = int(params.get("top_k", -1))
        self.gen = torch.Generator().manual_seed(int(seed))

    def sample(self, logits: torch.Tensor) -> int:
        """logits [V] fp32 -> token id."""
        if self.temperature == 0.0:
            return int(logits.argmax())
        probs = torch.softmax(self._filtered(logits.float() / self.temperature), dim=-1)
        return int(torch.multinomial(probs.cpu(), 1, generator=self.gen))

    def _filtered(self, logits: torch.Tensor) -> torch.Tensor:
        if self.top_k > 0 and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            drop = probs.cumsum(-1) - probs >= self.top_p  # keep the first past p
            drop[0] = False  # a top_p below the top probability (or fp32's range) keeps the top
            logits = logits.masked_fill(
                torch.zeros_like(drop).scatter(0, order, drop), float("-inf")
            )
        return logits


def token_logprobs(logits: torch.Tensor, token: int, num_top: int) -> list:
    """[sampled token's logprob, [[token id, logprob], ...] top num_top] from raw logits [V]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logp, num_top) if num_top else None
    pairs = [[int(i), float(v)] for v, i in zip(top.values, top.indices)] if top is not None else []
    return [float(logp[token]), pairs]
