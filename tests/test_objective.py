"""The objective (pinads_rec/models/objective.py): the weighted multi-task loss over valid rows."""

import torch

from pinads_rec.models.objective import engagement_loss


def test_masked_loss_ignores_invalid_rows():
    logits, labels = torch.randn(6, 2), torch.randint(0, 2, (6, 2)).float()
    valid = torch.tensor([True, True, True, False, False, False])
    weights = torch.tensor([1.0, 0.5])
    garbage = torch.cat([logits[:3], torch.full((3, 2), 50.0)])
    assert torch.allclose(
        engagement_loss(garbage, labels, valid, weights), engagement_loss(logits[:3], labels[:3], valid[:3], weights)
    )
