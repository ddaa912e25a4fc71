"""The training objective shared by the ranker and the two-tower model.

Per-task binary cross-entropy, weighted by the config's task weights, over the valid rows only (a
batch closed early by the unique-user bound, or the padded end of an eval pass, carries repeated
rows marked invalid). Two terms: the backbone learns from its raw logits, the calibration layer from
the calibrated logits (whose input is detached: see modules/calibration.py).
"""

import torch
import torch.nn.functional as F


def multitask_bce(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                  task_weights: torch.Tensor) -> torch.Tensor:
    """logits, labels [B, T]; valid [B] bool; task_weights [T]. Mean over valid rows, summed over tasks."""
    per_row = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")
    weight = valid.to(per_row.dtype).unsqueeze(1)
    per_task = (per_row * weight).sum(dim=0) / weight.sum().clamp(min=1.0)
    return (per_task * task_weights).sum()


def engagement_loss(raw: torch.Tensor, calibrated: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                    task_weights: torch.Tensor, calibrate: bool) -> torch.Tensor:
    loss = multitask_bce(raw.float(), labels, valid, task_weights)
    if calibrate:
        loss = loss + multitask_bce(calibrated.float(), labels, valid, task_weights)
    return loss
