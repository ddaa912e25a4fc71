"""Surface-specific calibration layers (unified-surfaces article).

One affine map of the logit per (surface, task) -- Platt scaling, ``a[s, t] * logit + b[s, t]`` --
on top of the model's logits; ``global`` shares one map per task across surfaces (the switch-off),
``none`` is the identity.

How it is trained: at the end of the training job, with the backbone frozen, on data it never
trained on -- a calibration split from the end of the training period (``data.calibration_dir``)
or a held-out slice of the latest training data (``data.calibration_holdout``) -- by exact maximum
likelihood (Newton's method per (surface, task)). The fit matches the sum of predictions to the sum
of labels per (surface, task), so its error is label noise: ~1 / sqrt(positives) of each cell.
Not by the training loss, because a backbone that is still moving
leaves a calibration layer trained alongside it behind: measured on the demo data, a layer
trained with the model (detached logits, its own loss term) still left the final model 5-22% off
on some surfaces and tasks, since the dense learning rate decays while the embedding tables keep
moving. A final fit on data the backbone never trained on calibrates the model that is served.

The maps are buffers (in checkpoints, broadcast by DDP, no optimizer state): identity until fit,
one row per surface in every mode (``global`` fits one map and copies it to every surface), so a
trained model can be recalibrated in another mode.

In: logits [B, T], surface [B] int64. Out: [B, T].
"""

from typing import Tuple

import torch
from torch import nn


def fit_platt(
    logits: torch.Tensor,
    labels: torch.Tensor,
    groups: torch.Tensor,
    num_groups: int,
    prior: float = 1.0,
    iterations: int = 50,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per group g, the (a_g, b_g) minimizing sum_i BCE(a_g z_i + b_g, y_i) + prior/2 ((a_g - 1)^2 + b_g^2).

    logits, labels [N] (float64 used inside); groups [N] in [0, num_groups). The small prior keeps a
    group with few or no positives at (or near) the identity. Newton's method on the 2x2 system of
    every group at once (a convex problem: converges in a few iterations)."""
    z, y = logits.double(), labels.double()
    a = torch.ones(num_groups, dtype=torch.float64)
    b = torch.zeros(num_groups, dtype=torch.float64)

    def per_group(v: torch.Tensor) -> torch.Tensor:
        return torch.zeros(num_groups, dtype=torch.float64).index_add_(0, groups, v)

    for _ in range(iterations):
        p = torch.sigmoid(a[groups] * z + b[groups])
        r, w = p - y, p * (1 - p)
        ga, gb = per_group(r * z) + prior * (a - 1), per_group(r) + prior * b
        haa, hab, hbb = per_group(w * z * z) + prior, per_group(w * z), per_group(w) + prior
        det = haa * hbb - hab * hab
        da, db = (hbb * ga - hab * gb) / det, (haa * gb - hab * ga) / det
        a, b = a - da, b - db
        if float(torch.maximum(da.abs(), db.abs()).max()) < 1e-10:
            break
    return a.float(), b.float()


class Calibration(nn.Module):
    def __init__(self, num_surfaces: int, num_tasks: int, mode: str = "surface"):
        super().__init__()
        self.mode = mode
        self.register_buffer("scale", torch.ones(num_surfaces, num_tasks))
        self.register_buffer("bias", torch.zeros(num_surfaces, num_tasks))

    def forward(self, logits: torch.Tensor, surface: torch.Tensor) -> torch.Tensor:
        if self.mode == "none":
            return logits
        return logits * self.scale.index_select(0, surface) + self.bias.index_select(0, surface)

    def reset(self) -> None:
        self.scale.fill_(1.0)
        self.bias.fill_(0.0)

    def fit(self, raw: torch.Tensor, labels: torch.Tensor, surface: torch.Tensor) -> None:
        """Fit every map on the backbone's raw logits [N, T] of held-out rows (labels [N, T], surface [N])."""
        self.reset()
        if self.mode == "none":
            return
        groups = surface if self.mode == "surface" else torch.zeros_like(surface)
        for t in range(raw.shape[1]):
            a, b = fit_platt(raw[:, t], labels[:, t], groups, self.scale.shape[0])
            if self.mode == "global":
                a, b = a[0].expand_as(a), b[0].expand_as(b)
            self.scale[:, t], self.bias[:, t] = a, b
