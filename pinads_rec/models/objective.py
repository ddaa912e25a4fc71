"""The training objective shared by the ranker and the two-tower model.

Per-task binary cross-entropy of the raw logits, weighted by the config's task weights, over the
valid rows only (a batch closed early by the unique-user bound, or the padded end of an eval pass,
carries repeated rows marked invalid). The calibration layers are not trained by this loss: they
are fit after training on held-out data (modules/calibration.py).
"""

import torch
import torch.nn.functional as F


def engagement_loss(
    logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, task_weights: torch.Tensor
) -> torch.Tensor:
    """logits, labels [B, T]; valid [B] bool; task_weights [T]. Mean over valid rows, summed over tasks."""
    per_row = F.binary_cross_entropy_with_logits(logits.float(), labels, reduction="none")
    weight = valid.to(per_row.dtype).unsqueeze(1)
    per_task = (per_row * weight).sum(dim=0) / weight.sum().clamp(min=1.0)
    return (per_task * task_weights).sum()
