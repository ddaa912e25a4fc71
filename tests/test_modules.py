"""Model building blocks: shapes, masking, empty sequences, per-surface heads."""

import math

import pytest
import torch

from pinads_rec.config import DenseFeatureConfig
from pinads_rec.modules.dense_norm import DenseNormalization
from pinads_rec.modules.mmoe import MMoE


def test_mmoe_gives_one_logit_per_task_and_surface():
    torch.manual_seed(0)
    mmoe = MMoE(in_features=10, num_tasks=3, num_surfaces=4, num_experts=2, expert_dims=[8, 6], tower_dims=[5])
    out = mmoe(torch.randn(7, 10))
    assert out.shape == (7, 3, 4)
    out.sum().backward()
    assert all(p.grad is not None for p in mmoe.parameters())


def test_dense_normalizations():
    feats = [DenseFeatureConfig(name="a", column="a", norm="log"),
             DenseFeatureConfig(name="b", column="b", norm="minmax", clip_min=0.0, clip_max=2.0),
             DenseFeatureConfig(name="c", column="c", dim=3, norm="layer_norm"),
             DenseFeatureConfig(name="d", column="d", norm="none")]
    norm = DenseNormalization(feats)
    x = torch.tensor([[-(math.e - 1), 3.0, 1.0, 2.0, 3.0, 7.0]])
    y = norm(x)
    assert y[0, 0].item() == pytest.approx(-1.0)
    assert y[0, 1].item() == 1.0  # clipped
    assert y[0, 2:5].mean().abs().item() < 1e-6
    assert y[0, 5].item() == 7.0
