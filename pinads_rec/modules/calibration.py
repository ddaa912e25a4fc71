"""Surface-specific calibration layers (unified-surfaces article).

One affine map of the logit per (surface, task) -- Platt scaling, ``a[s, t] * logit + b[s, t]`` --
on top of the model's logits; ``global`` shares one map per task across surfaces (the switch-off),
``none`` is the identity.

Why the input is detached in training: the backbone fits every batch it trains on, so its logits on
data it has *not* yet seen are over-confident (on the demo data it over-predicts by 5-30% with no
calibration). In one-pass training each batch is unseen when its forward runs, so a calibration
layer trained on those logits -- with its own loss term and no gradient into the backbone -- learns
the out-of-sample correction, which is what serving needs. Starts as the identity (a = 1, b = 0).

In: logits [B, T], surface [B] int64. Out: [B, T].
"""

import torch
from torch import nn


class Calibration(nn.Module):
    def __init__(self, num_surfaces: int, num_tasks: int, mode: str = "surface"):
        super().__init__()
        rows = {"surface": num_surfaces, "global": 1, "none": 0}[mode]
        self.mode = mode
        self.scale = nn.Parameter(torch.ones(rows, num_tasks))
        self.bias = nn.Parameter(torch.zeros(rows, num_tasks))

    def forward(self, logits: torch.Tensor, surface: torch.Tensor) -> torch.Tensor:
        if self.mode == "none":
            return logits
        index = surface if self.mode == "surface" else torch.zeros_like(surface)
        logits = logits.detach() if self.training else logits
        return logits * self.scale.index_select(0, index) + self.bias.index_select(0, index)
