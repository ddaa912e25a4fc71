"""Per-feature normalization of the raw dense features (sequence-modeling article: log, min-max
clip, layer norm are combined to tame heavy-tailed inputs).

In: dense [B, D_dense] with features laid out in config order. Out: [B, D_dense] float32.
"""

from typing import List

import torch
from torch import nn

from pinads_rec.config import DenseFeatureConfig


class DenseNormalization(nn.Module):
    def __init__(self, features: List[DenseFeatureConfig]):
        super().__init__()
        self.features = [(f.name, f.dim, f.norm, f.clip_min, f.clip_max) for f in features]
        self.layer_norms = nn.ModuleDict(
            {f.name: nn.LayerNorm(f.dim) for f in features if f.norm == "layer_norm"})

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        out, at = [], 0
        for name, dim, norm, lo, hi in self.features:
            x = dense[:, at:at + dim]
            at += dim
            if norm == "log":  # signed log: heavy tails both ways, keeps the sign
                x = torch.sign(x) * torch.log1p(torch.abs(x))
            elif norm == "minmax":
                x = ((x - lo) / (hi - lo)).clamp(0.0, 1.0)
            elif norm == "layer_norm":
                x = self.layer_norms[name](x)
            out.append(x)
        return torch.cat(out, dim=1) if out else dense
