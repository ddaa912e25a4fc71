"""Resilient Batch Norm: masking rules, BatchNorm1d-equal updates, running-statistics normalization."""

import pytest
import torch
from torch import nn

from pinads_rec.modules.resilient_bn import ResilientBatchNorm1d


def _batch(n=256, columns=3, seed=0, scale=1.0, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, columns, generator=g) * scale + shift


def _warm(rbn, batches=3):
    for i in range(batches):
        rbn(_batch(seed=i, columns=rbn.num_features))
    return rbn


def test_first_usable_batch_is_adopted_and_constant_column_waits():
    rbn = ResilientBatchNorm1d(2)
    x = _batch(columns=2)
    x[:, 1] = 3.0  # constant from the start
    y = rbn(x)
    assert rbn.initialized.tolist() == [True, False]
    assert torch.allclose(rbn.running_mean[0], x[:, 0].mean())
    assert torch.allclose(rbn.running_var[0], x[:, 0].var())
    assert rbn.running_mean[1].item() == 0.0 and rbn.running_var[1].item() == 1.0
    assert torch.equal(y[:, 1], x[:, 1])  # uninitialized: identity (weight 1, bias 0), no division
    assert rbn.num_masked.tolist() == [0, 1]


def test_zero_variance_column_stays_finite_and_keeps_running_stats():
    rbn = _warm(ResilientBatchNorm1d(3))
    before_mean, before_var = rbn.running_mean.clone(), rbn.running_var.clone()
    x = _batch(seed=10)
    x[:, 1] = 0.0  # absent feature filled with a default
    y = rbn(x)
    assert torch.isfinite(y).all()
    assert rbn.running_mean[1] == before_mean[1] and rbn.running_var[1] == before_var[1]
    expected = (0.0 - before_mean[1]) / torch.sqrt(before_var[1] + rbn.eps)
    assert torch.allclose(y[:, 1], expected.expand(len(x)))
    assert rbn.running_mean[0] != before_mean[0]  # the other columns still update


def test_masked_columns_do_not_move_over_many_batches():
    rbn = _warm(ResilientBatchNorm1d(3, minimal_variance=1e-3))
    frozen_mean, frozen_var = rbn.running_mean[2].item(), rbn.running_var[2].item()
    for i in range(20):
        x = _batch(seed=20 + i)
        x[:, 2] = 0.5 + 1e-3 * x[:, 2]  # near-constant (stale) column: variance 1e-6
        rbn(x)
    assert rbn.running_mean[2].item() == frozen_mean and rbn.running_var[2].item() == frozen_var
    assert rbn.num_masked[2].item() == 20 and rbn.num_masked[:2].sum().item() == 0


def test_ordinary_columns_update_exactly_like_batchnorm1d():
    rbn = ResilientBatchNorm1d(3, momentum=0.2)
    bn = nn.BatchNorm1d(3, momentum=0.2)
    rbn(_batch(seed=0))
    # From the same starting point (RBN adopts its first batch; BN starts at 0 / 1), same updates.
    bn.running_mean.copy_(rbn.running_mean)
    bn.running_var.copy_(rbn.running_var)
    for i in range(1, 8):
        x = _batch(seed=i, scale=1.0 + 0.1 * i, shift=0.3 * i)
        rbn(x)
        bn(x)
    assert torch.allclose(rbn.running_mean, bn.running_mean, rtol=1e-6, atol=1e-7)
    assert torch.allclose(rbn.running_var, bn.running_var, rtol=1e-6, atol=1e-7)
    assert rbn.num_masked.sum().item() == 0


def test_eval_normalizes_with_running_stats_and_does_not_update():
    rbn = _warm(ResilientBatchNorm1d(3)).eval()
    bn = nn.BatchNorm1d(3).eval()
    bn.load_state_dict(
        {k: v for k, v in rbn.state_dict().items() if k in ("weight", "bias", "running_mean", "running_var")},
        strict=False,
    )
    state = {k: v.clone() for k, v in rbn.state_dict().items()}
    x = _batch(seed=5, scale=4.0, shift=-2.0)
    y = rbn(x)
    assert torch.allclose(y, bn(x), atol=1e-6)
    assert all(torch.equal(state[k], v) for k, v in rbn.state_dict().items())


def test_training_output_uses_running_stats_not_batch_stats():
    rbn = _warm(ResilientBatchNorm1d(3))
    with torch.no_grad():
        rbn.weight.fill_(2.0)
        rbn.bias.fill_(0.5)
    x = _batch(seed=7, scale=3.0, shift=5.0)  # shifted batch: batch stats would re-centre it
    y = rbn(x)
    # Normalized with the running stats *after* this batch's update (BatchNorm's order of steps).
    expected = (x - rbn.running_mean) / torch.sqrt(rbn.running_var + rbn.eps) * 2.0 + 0.5
    assert torch.allclose(y, expected, atol=1e-5)
    assert y.mean().item() > 2.0  # a batch-stat norm would give mean 0.5 (the bias)


def test_variance_shift_mask_fires_both_ways():
    rbn = _warm(ResilientBatchNorm1d(3, variance_shift_threshold=10.0))
    var_before = rbn.running_var.clone()
    x = _batch(seed=30)
    x[:, 0] *= 5.0  # variance x25: beyond the threshold
    x[:, 1] *= 0.2  # variance /25 (still above minimal_variance): beyond it the other way
    x[:, 2] *= 2.0  # variance x4: within it
    rbn(x)
    assert rbn.running_var[0] == var_before[0] and rbn.running_var[1] == var_before[1]
    assert rbn.running_var[2] > var_before[2]
    assert rbn.num_masked.tolist() == [1, 1, 0]


def test_state_dict_round_trip():
    rbn = _warm(ResilientBatchNorm1d(3))
    x = _batch(seed=40)
    x[:, 1] = 0.0
    rbn(x)
    state = rbn.state_dict()
    assert {"running_mean", "running_var", "initialized", "num_batches_tracked", "num_masked", "weight", "bias"} <= set(
        state
    )
    other = ResilientBatchNorm1d(3)
    other.load_state_dict(state)
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in state.items())
    probe = _batch(seed=41)
    assert torch.equal(rbn.eval()(probe), other.eval()(probe))


def test_plain_batchnorm_blows_up_where_resilient_does_not():
    """The failure the module exists for: running variance collapses on a zero-filled stretch, then
    healthy values come back (eval / serving) and are divided by ~sqrt(eps)."""
    bn, rbn = nn.BatchNorm1d(1), ResilientBatchNorm1d(1)
    healthy = lambda s: _batch(n=64, columns=1, seed=s, shift=5.0)  # noqa: E731
    for i in range(10):
        bn(healthy(i))
        rbn(healthy(i))
    for _ in range(60):  # the feature is absent: default 0 for every row (running var -> 0.9^60)
        bn(torch.zeros(64, 1))
        rbn(torch.zeros(64, 1))
    bn.eval(), rbn.eval()
    probe = healthy(99)
    assert bn(probe).abs().max().item() > 100
    assert rbn(probe).abs().max().item() < 10


def test_fx_traceable():
    rbn = _warm(ResilientBatchNorm1d(3))
    traced = torch.fx.symbolic_trace(rbn)
    # The buffers are graph inputs (get_attr), not constants frozen at trace time.
    graph_inputs = {n.target for n in traced.graph.nodes if n.op == "get_attr"}
    assert {"running_mean", "running_var", "initialized"} <= graph_inputs
    reference = ResilientBatchNorm1d(3)
    reference.load_state_dict(rbn.state_dict())
    x = _batch(seed=50)
    x[:, 0] = 1.0
    assert torch.equal(traced(x), reference(x))
    assert torch.equal(traced.running_var, reference.running_var)


def test_rejects_a_threshold_that_is_not_a_ratio():
    with pytest.raises(ValueError, match="variance_shift_threshold"):
        ResilientBatchNorm1d(2, variance_shift_threshold=0.5)
    assert ResilientBatchNorm1d(2, variance_shift_threshold=1.5).variance_shift_threshold == 1.5
