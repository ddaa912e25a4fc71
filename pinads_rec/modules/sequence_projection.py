"""DCNv2 projection of the (wide) Transformer output (sequence-modeling article): the pooled
Transformer features go through DCNv2 cross layers (modules/cross_network.py: low-rank, or full-rank
with low_rank 0) and a linear map to a small representation before they join the rest of the
network, so a wide sequence model does not dominate the dense arch's input.

In: [U, D]. Out: [U, dim].
"""

from typing import Any

import torch
from torch import nn

from pinads_rec.modules.cross_network import cross_network


class SequenceProjection(nn.Module):
    # cfg: modules/encoders.py's SequenceProjectionConfig, not imported: the registry builds this module.
    def __init__(self, in_dim: int, cfg: Any):
        super().__init__()
        self.cross = cross_network(in_dim, cfg.num_layers, cfg.low_rank) if cfg.num_layers else None
        self.out = nn.Linear(in_dim, cfg.dim)
        self.output_dim = cfg.dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.cross(x) if self.cross is not None else x)
