"""Per-feature dense normalization: each kind on a small input, config order, batch norms' state."""

import math

import pytest
import torch
from torch import nn

from pinads_rec.config import DenseFeatureConfig, ResilientBNConfig
from pinads_rec.modules.dense_norm import DenseNormalization
from pinads_rec.modules.resilient_bn import ResilientBatchNorm1d


def _features():
    return [
        DenseFeatureConfig(name="a", column="a", norm="log"),
        DenseFeatureConfig(name="b", column="b", norm="minmax", clip_min=0.0, clip_max=2.0),
        DenseFeatureConfig(name="c", column="c", dim=3, norm="layer_norm"),
        DenseFeatureConfig(name="d", column="d", norm="none"),
        DenseFeatureConfig(name="e", column="e", dim=2, norm="batch_norm"),
        DenseFeatureConfig(name="f", column="f", dim=2, norm="resilient_bn"),
    ]


def _input(n=64):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 10, generator=g) * 3.0 + 1.0


def test_log_minmax_layer_norm_none():
    norm = DenseNormalization(_features()[:4], ResilientBNConfig())
    x = torch.tensor([[-(math.e - 1), 3.0, 1.0, 2.0, 3.0, 7.0]])
    y = norm(x)
    assert y[0, 0].item() == pytest.approx(-1.0)  # signed log1p
    assert y[0, 1].item() == 1.0  # clipped at clip_max
    assert y[0, 2:5].mean().abs().item() < 1e-6
    assert y[0, 5].item() == 7.0


def test_batch_norm_and_resilient_bn_in_config_order():
    cfg = ResilientBNConfig(minimal_variance=1e-3, variance_shift_threshold=8.0, momentum=0.2, eps=1e-4)
    norm = DenseNormalization(_features(), cfg)
    bn, rbn = norm.batch_norms["e"], norm.resilient_bns["f"]
    assert isinstance(bn, nn.BatchNorm1d) and isinstance(rbn, ResilientBatchNorm1d)
    assert (bn.momentum, bn.eps) == (0.2, 1e-4)  # the same momentum / eps as the resilient one
    assert (rbn.minimal_variance, rbn.variance_shift_threshold, rbn.momentum, rbn.eps) == (1e-3, 8.0, 0.2, 1e-4)
    x = _input()
    y = norm(x)
    assert y.shape == x.shape and y.dtype == torch.float32
    # batch_norm columns 6:8 -- batch statistics in training: mean 0, (biased) std 1.
    assert y[:, 6:8].mean(0).abs().max().item() < 1e-5
    assert torch.allclose(y[:, 6:8].std(0, unbiased=False), torch.ones(2), atol=1e-3)
    # resilient_bn columns 8:10 -- the first batch is adopted, then normalized with it.
    assert torch.allclose(rbn.running_mean, x[:, 8:10].mean(0))
    assert torch.allclose(y[:, 8:10], (x[:, 8:10] - rbn.running_mean) / torch.sqrt(rbn.running_var + 1e-4))
    assert torch.allclose(y[:, 5], x[:, 5])  # "none" untouched, in its place


def test_zero_filled_batch_norm_features_in_eval():
    """After a stretch of zero-filled batches, healthy eval inputs blow up through batch_norm and stay
    bounded through resilient_bn."""
    feats = [
        DenseFeatureConfig(name="bn", column="bn", norm="batch_norm"),
        DenseFeatureConfig(name="rbn", column="rbn", norm="resilient_bn"),
    ]
    norm = DenseNormalization(feats, ResilientBNConfig())
    healthy = torch.randn(256, 2, generator=torch.Generator().manual_seed(1)) + 5.0
    norm(healthy)
    for _ in range(60):
        norm(torch.zeros(256, 2))
    y = norm.eval()(healthy)
    assert torch.isfinite(y).all()
    assert y[:, 0].abs().max().item() > 100
    assert y[:, 1].abs().max().item() < 10


def test_batch_norm_state_in_state_dict():
    norm = DenseNormalization(_features(), ResilientBNConfig())
    norm(_input())
    state = norm.state_dict()
    assert {
        "batch_norms.e.running_var",
        "resilient_bns.f.running_var",
        "resilient_bns.f.initialized",
        "resilient_bns.f.num_masked",
    } <= set(state)
    other = DenseNormalization(_features(), ResilientBNConfig())
    other.load_state_dict(state)
    x = _input(8)
    assert torch.equal(norm.eval()(x), other.eval()(x))


def test_default_config_when_none_given():
    norm = DenseNormalization([DenseFeatureConfig(name="f", column="f", norm="resilient_bn")])
    assert norm.resilient_bns["f"].minimal_variance == ResilientBNConfig().minimal_variance
    assert norm(torch.randn(16, 1)).shape == (16, 1)


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
