"""Model building blocks: shapes, masking, empty sequences, per-surface heads."""

import math

import pytest
import torch
from torchrec.modules.crossnet import CrossNet, LowRankCrossNet

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


def test_mmoe_in_bf16_matches_autocast_layer_by_layer():
    # The experts cast their shared input once instead of autocast casting it per expert: the same
    # numbers, forward and backward, as the experts run one by one under autocast.
    torch.manual_seed(0)
    mmoe = MMoE(in_features=10, num_tasks=3, num_surfaces=4, num_experts=3, expert_dims=[8, 6], tower_dims=[5])
    x = torch.randn(7, 10, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mmoe.experts.module(x)
        reference = torch.stack([e(x) for e in mmoe.experts.module.experts], dim=1)
    assert out.dtype == torch.bfloat16 and torch.equal(out, reference)
    (grad,) = torch.autograd.grad(out.float().sum(), x)
    (reference_grad,) = torch.autograd.grad(reference.float().sum(), x)
    assert grad.dtype == torch.float32 and torch.allclose(grad, reference_grad, rtol=1e-2, atol=1e-3)


def test_dense_normalizations():
    feats = [
        DenseFeatureConfig(name="a", column="a", norm="log"),
        DenseFeatureConfig(name="b", column="b", norm="minmax", clip_min=0.0, clip_max=2.0),
        DenseFeatureConfig(name="c", column="c", dim=3, norm="layer_norm"),
        DenseFeatureConfig(name="d", column="d", norm="none"),
    ]
    norm = DenseNormalization(feats)
    x = torch.tensor([[-(math.e - 1), 3.0, 1.0, 2.0, 3.0, 7.0]])
    y = norm(x)
    assert y[0, 0].item() == pytest.approx(-1.0)
    assert y[0, 1].item() == 1.0  # clipped
    assert y[0, 2:5].mean().abs().item() < 1e-6
    assert y[0, 5].item() == 7.0


@pytest.mark.parametrize("low_rank,kind", [(4, LowRankCrossNet), (0, CrossNet)])
def test_cross_network_is_low_rank_unless_low_rank_is_zero(low_rank, kind):
    """The one place choosing the DCNv2 form: every model and the sequence projection use it."""
    from pinads_rec.modules.cross_network import cross_network
    from pinads_rec.modules.precision import LargeLayer

    cross = cross_network(10, 2, low_rank)
    assert isinstance(cross, LargeLayer) and type(cross.module) is kind
    assert cross(torch.randn(3, 10)).shape == (3, 10)


def test_sequence_projection_without_cross_layers_is_the_linear_map_alone():
    from pinads_rec.config import SequenceProjectionConfig
    from pinads_rec.modules.sequence_projection import SequenceProjection

    plain = SequenceProjection(12, SequenceProjectionConfig(dim=5, num_layers=0, low_rank=4))
    assert plain.cross is None and plain(torch.randn(2, 12)).shape == (2, 5)
    crossed = SequenceProjection(12, SequenceProjectionConfig(dim=5, num_layers=2, low_rank=0))
    assert type(crossed.cross.module) is CrossNet and crossed(torch.randn(2, 12)).shape == (2, 5)
