"""Whole models: plain nn.Modules; parallelism is applied from outside (pinads_rec.parallel).

Every model takes a ``Batch`` and offers ``scores(batch) -> (raw, calibrated)`` logits [B, T],
``forward(batch)`` (the calibrated logits) and ``loss(raw, calibrated, batch)``.
"""

import torch
from torch import nn

from pinads_rec.config import FeaturesConfig, ModelConfig, validate_layout


def build_model(features: FeaturesConfig, model: ModelConfig, device: torch.device = None) -> nn.Module:
    """The model ``model.kind`` names: the unified ranker or the two-tower ranker. A feature layout it
    cannot be trained on is a ConfigError naming the fix (config.validate_layout)."""
    validate_layout(features, model)
    if model.kind == "two_tower":
        from pinads_rec.models.two_tower import TwoTowerRanker

        return TwoTowerRanker(features, model, device=device)
    from pinads_rec.models.ranker import UnifiedRanker

    return UnifiedRanker(features, model, device=device)
