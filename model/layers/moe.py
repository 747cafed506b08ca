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
from dsv4ray.model.layers.quant_linear import QuantLinear


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
        self.linear = F.linear  # a worker may bind a kernel with the same contract
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.k, dtype=torch.long))
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(
        self, x: torch.Tensor, token_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden], token_ids [N] -> (weights [N, k] fp32, expert ids [N, k])."""
        scores = F.softplus(self.linear(x, self.weight).float()).sqrt()
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
        self.stacked_scales: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def shared_in_stack(self) -> bool:
        """The shared expert has the routed experts' width and storage format (a shared FP8
        expert beside FP4 experts does not), so it stacks as one more expert."""
        return _storage(self.shared_experts.w1) == _storage(self.experts[0].w1)

    @property
    def expert_format(self) -> tuple[str, tuple[int, int]]:
        """("dense", "fp8" or "fp4", FP8 block) of the routed experts' weights."""
        w1 = self.experts[0].w1
        return (w1.kind, w1.block) if isinstance(w1, QuantLinear) else ("dense", (128, 128))

    @torch.no_grad()
    def stack_experts(self, scale_layout=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E', 2 * inter, hidden]: each expert's w1 rows then its w3 rows, w2 [E', hidden,
        inter]) with E' = E + 1 when the shared expert stacks last. The experts' parameters become
        views of these tensors, so the weights are held once. Idempotent. Quantised experts stack
        their stored bytes the same way (FP4: hidden / 2 and inter / 2 bytes per row), and their
        scales into ``stacked_scales`` (s13: w1's scale rows then w3's, s2), stored as
        ``scale_layout(stacked)`` returns them when given (the same values in the storage a kernel
        reads best; the experts' scales are views of that storage)."""
        if self.stacked is None:
            experts = list(self.experts) + ([self.shared_experts] if self.shared_in_stack else [])
            self.stacked = _stack(experts, "weight")
            if isinstance(experts[0].w1, QuantLinear):
                self.stacked_scales = _stack(experts, "scale", scale_layout)
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


def _storage(layer: nn.Module) -> list:
    """(name, shape, dtype) of each tensor a linear layer holds."""
    return [(name, t.shape, t.dtype) for name, t in layer.state_dict().items()]


def _stack(experts: list[Expert], name: str, layout=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacks tensor ``name`` of the experts' linears into (w1 | w3 [E', 2 * rows, ...], w2),
    stored as ``layout`` returns a stack when given, and makes each expert's tensor a view of
    the stack."""
    rows = getattr(experts[0].w1, name).shape[0]
    t13 = torch.stack([torch.cat([getattr(e.w1, name), getattr(e.w3, name)]) for e in experts])
    t2 = torch.stack([getattr(e.w2, name) for e in experts])
    if layout is not None:
        t13, t2 = layout(t13), layout(t2)
    for i, e in enumerate(experts):
        for layer, view in ((e.w1, t13[i, :rows]), (e.w3, t13[i, rows:]), (e.w2, t2[i])):
            if isinstance(getattr(layer, name), nn.Parameter):
                view = nn.Parameter(view, requires_grad=False)
            setattr(layer, name, view)
    return t13, t2
