"""Mixture of experts: sqrtsoftplus router (or a token-id hash table), routed + shared SwiGLU.

Gate scores = sqrt(softplus(x W^T)) in fp32. Score layers choose experts by scores + bias (the
bias only chooses); hash layers (layer id < num_hash_layers) choose by ``tid2eid[token]``. The
chosen scores are normalised to sum 1 and scaled by routed_scaling_factor. SwiGLU clamps the gate
at +limit and the up projection to +-limit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4ray.config import ModelConfig
from dsv4ray.model.layers.common import linear


class Expert(nn.Module):
    """w1 = gate, w3 = up, w2 = down."""

    def __init__(self, hidden: int, inter: int, limit: float) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = (
            linear(hidden, inter),
            linear(inter, hidden),
            linear(hidden, inter),
        )
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        return self.w2(F.silu(gate) * up)


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig, hashed: bool) -> None:
        super().__init__()
        self.hashed, self.k = hashed, cfg.num_experts_per_tok
        self.scale = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.k, dtype=torch.long))
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(
        self, x: torch.Tensor, token_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden], token_ids [N] -> (weights [N, k] fp32, expert ids [N, k])."""
        scores = F.softplus(F.linear(x, self.weight).float()).sqrt()
        if self.hashed:
            ids = self.tid2eid[token_ids].long()
        else:
            ids = torch.topk(scores + self.bias.float(), self.k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, hashed: bool) -> None:
        super().__init__()
        hidden, inter, limit = cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit
        self.gate = Gate(cfg, hashed)
        self.experts = nn.ModuleList(
            Expert(hidden, inter, limit) for _ in range(cfg.n_routed_experts)
        )
        self.shared_experts = Expert(hidden, inter * cfg.n_shared_experts, limit)
        self.limit = limit
        self.stacked: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def shared_in_stack(self) -> bool:
        """The shared expert has the routed experts' width, so it stacks as one more expert."""
        return self.shared_experts.w1.weight.shape == self.experts[0].w1.weight.shape

    @torch.no_grad()
    def stack_experts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E', 2 * inter, hidden]: each expert's w1 rows then its w3 rows, w2 [E', hidden,
        inter]) with E' = E + 1 when the shared expert stacks last. The experts' parameters become
        views of these tensors, so the weights are held once. Idempotent."""
        if self.stacked is None:
            experts = list(self.experts) + ([self.shared_experts] if self.shared_in_stack else [])
            w13 = torch.stack([torch.cat([e.w1.weight, e.w3.weight]) for e in experts])
            w2 = torch.stack([e.w2.weight for e in experts])
            inter = experts[0].w1.weight.shape[0]
            for i, e in enumerate(experts):
                e.w1.weight = nn.Parameter(w13[i, :inter], requires_grad=False)
                e.w3.weight = nn.Parameter(w13[i, inter:], requires_grad=False)
                e.w2.weight = nn.Parameter(w2[i], requires_grad=False)
            self.stacked = (w13, w2)
        return self.stacked

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """x [..., hidden], token_ids [...] -> [..., hidden]."""
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.gate(flat, token_ids.reshape(-1))
        routed = torch.zeros_like(flat)
        for e in torch.unique(ids).tolist():
            rows, slot = torch.where(ids == e)
            out = self.experts[e](flat[rows]) * weights[rows, slot, None].to(flat.dtype)
            routed.index_add_(0, rows, out)
        return (routed + self.shared_experts(flat)).view_as(x)

    def forward_static(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """forward() without a device-to-host sync (CUDA graphs): every expert runs on every row
        with a [N, E] weight that is zero where the row did not route to it."""
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.gate(flat, token_ids.reshape(-1))
        dense = torch.zeros(flat.shape[0], len(self.experts), device=flat.device)
        dense = dense.scatter_add(1, ids, weights).to(flat.dtype)  # [N, E]
        routed = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            routed = routed + expert(flat) * dense[:, e, None]
        return (routed + self.shared_experts(flat)).view_as(x)
