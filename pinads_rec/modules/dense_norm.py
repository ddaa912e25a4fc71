"""Per-feature normalization of the raw dense features (sequence-modeling article: log, min-max
clip, layer norm and batch norm are combined to tame heavy-tailed inputs; Resilient Batch Norm keeps
batch norm from blowing up on stale, absent or shifted features).

In: dense [B, D_dense] with features laid out in config order. Out: [B, D_dense] float32.

Per feature (``DenseFeatureConfig.norm``): ``none``; ``log`` (signed log1p); ``minmax`` (clipped to
[0, 1] between clip_min and clip_max); ``layer_norm`` (over the feature's own columns);
``batch_norm`` (``nn.BatchNorm1d`` over its columns: batch statistics in training, running ones in
eval); ``resilient_bn`` (``ResilientBatchNorm1d``: running statistics always, updated only from
batches whose variance is sane). Both batch norms take momentum and eps from ``model.resilient_bn``,
so the two differ only in what makes Resilient Batch Norm resilient.
"""

from typing import List, Optional

import torch
from torch import nn

from pinads_rec.config import DenseFeatureConfig, ResilientBNConfig
from pinads_rec.modules.resilient_bn import ResilientBatchNorm1d


class DenseNormalization(nn.Module):
    def __init__(self, features: List[DenseFeatureConfig], resilient_bn_cfg: Optional[ResilientBNConfig] = None):
        super().__init__()
        rbn = resilient_bn_cfg or ResilientBNConfig()
        self.features = [(f.name, f.dim, f.norm, f.clip_min, f.clip_max) for f in features]
        self.layer_norms = nn.ModuleDict({f.name: nn.LayerNorm(f.dim) for f in features if f.norm == "layer_norm"})
        self.batch_norms = nn.ModuleDict(
            {
                f.name: nn.BatchNorm1d(f.dim, eps=rbn.eps, momentum=rbn.momentum)
                for f in features
                if f.norm == "batch_norm"
            }
        )
        self.resilient_bns = nn.ModuleDict(
            {
                f.name: ResilientBatchNorm1d(
                    f.dim, rbn.minimal_variance, rbn.variance_shift_threshold, rbn.momentum, rbn.eps
                )
                for f in features
                if f.norm == "resilient_bn"
            }
        )

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        out, at = [], 0
        for name, dim, norm, lo, hi in self.features:
            x = dense[:, at : at + dim]
            at += dim
            if norm == "log":  # signed log: heavy tails both ways, keeps the sign
                x = torch.sign(x) * torch.log1p(torch.abs(x))
            elif norm == "minmax":
                x = ((x - lo) / (hi - lo)).clamp(0.0, 1.0)
            elif norm == "layer_norm":
                x = self.layer_norms[name](x)
            elif norm == "batch_norm":
                x = self.batch_norms[name](x)
            elif norm == "resilient_bn":
                x = self.resilient_bns[name](x)
            out.append(x)
        return torch.cat(out, dim=1) if out else dense
