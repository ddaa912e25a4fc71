"""Multi-gate Mixture-of-Experts (MMoE) with per-task towers giving per-surface logits.

Shared MLP experts; one softmax gate per task mixes them; each task's tower maps its mixture to one
logit per surface (unified-surfaces article: one model, surface-specific heads).

In: x [B, D]. Out: logits [B, T, S] for T tasks and S surfaces.
"""

from typing import List

import torch
from torch import nn

from pinads_rec.modules.precision import LargeLayer
from pinads_rec.modules.torchrec_layers import MLP


class Experts(nn.Module):
    """The shared experts: the MMoE's large part (run in BF16 when configured). Out: [B, E, H]."""

    def __init__(self, in_features: int, num_experts: int, dims: List[int]):
        super().__init__()
        self.experts = nn.ModuleList(MLP(in_features, dims) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            # Autocast would cast the shared input once per expert (and each gradient back): once.
            # Here, not in LargeLayer: casting every large layer's input would also put the
            # Transformer's residual stream and the cross network's products in BF16.
            x = x.to(torch.get_autocast_dtype(x.device.type))
        return torch.stack([e(x) for e in self.experts], dim=1)


class MMoE(nn.Module):
    def __init__(
        self,
        in_features: int,
        num_tasks: int,
        num_surfaces: int,
        num_experts: int,
        expert_dims: List[int],
        tower_dims: List[int],
    ):
        super().__init__()
        self.experts = LargeLayer(Experts(in_features, num_experts, expert_dims))
        self.gates = nn.Linear(in_features, num_tasks * num_experts)
        self.towers = nn.ModuleList(
            nn.Sequential(MLP(expert_dims[-1], tower_dims), nn.Linear(tower_dims[-1], num_surfaces))
            if tower_dims
            else nn.Linear(expert_dims[-1], num_surfaces)
            for _ in range(num_tasks)
        )
        self.num_tasks, self.num_experts = num_tasks, num_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts = self.experts(x)  # [B, E, H]
        gates = self.gates(x).view(-1, self.num_tasks, self.num_experts).softmax(dim=-1)  # [B, T, E]
        mixed = torch.bmm(gates, experts)  # [B, T, H]
        # unbind: one backward for all tasks, not a zero-filled [B, T, H] gradient per task
        return torch.stack([tower(m) for m, tower in zip(mixed.unbind(1), self.towers)], dim=1)
