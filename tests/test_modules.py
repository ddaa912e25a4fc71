"""Model building blocks: shapes, masking, empty sequences, per-surface heads."""

import math

import pytest
import torch

from pinads_rec.config import DenseFeatureConfig, SequenceEncoderConfig
from pinads_rec.modules.dense_norm import DenseNormalization
from pinads_rec.modules.mmoe import MMoE
from pinads_rec.modules.sequence import SequenceEncoder, time_delta_bucket
from pinads_rec.modules.target_attention import TargetAttention


def _encoder(**kw):
    torch.manual_seed(0)
    cfg = SequenceEncoderConfig(d_model=16, num_layers=2, num_heads=2, ffn_dim=32, **kw)
    return SequenceEncoder(attr_dim=8, max_length=6, cfg=cfg, pretrained_dim=4).eval()


def _jagged(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    attrs = [torch.randn(n, 8, generator=g) for _ in range(2)]
    offsets = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()))
    deltas = torch.rand(n, generator=g) * 1e5
    return attrs, offsets, deltas, torch.randn(n, 4, generator=g)


def test_time_delta_buckets_are_log2_and_clamped():
    seconds = torch.tensor([-5.0, 0.0, 1.0, 3.0, 1000.0, 1e12])
    assert time_delta_bucket(seconds, 24).tolist() == [0, 0, 1, 2, 9, 23]


def test_sequence_encoder_shapes_and_empty_sequences_are_finite():
    enc = _encoder()
    pooled, events, mask = enc(*_jagged([3, 0, 6, 1]))
    assert pooled.shape == (4, 32) and events.shape == (4, 6, 16) and mask.shape == (4, 6)
    assert mask.sum(1).tolist() == [3, 0, 6, 1]
    assert torch.isfinite(pooled).all() and torch.isfinite(events).all()


def test_a_request_does_not_see_other_requests_or_padding():
    """Encoding a request alone or next to others (which changes its padding) gives the same output."""
    enc = _encoder()
    attrs, offsets, deltas, pre = _jagged([2, 5, 4])
    together, events, _ = enc(attrs, offsets, deltas, pre)
    lo, hi = int(offsets[0]), int(offsets[1])
    alone, alone_events, _ = enc([a[lo:hi] for a in attrs], torch.tensor([0, hi - lo]), deltas[lo:hi], pre[lo:hi])
    torch.testing.assert_close(together[:1], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(events[0, :2], alone_events[0, :2], rtol=1e-5, atol=1e-5)


def test_poolings_select_outputs():
    assert _encoder(poolings=["mean"]).output_dim == 16
    assert _encoder(poolings=["summary", "mean"]).output_dim == 32
    pooled, _, _ = _encoder(poolings=["target"])(*_jagged([2, 1]))
    assert pooled.shape == (2, 0)


def test_target_attention_ignores_masked_events_and_empty_is_zero():
    torch.manual_seed(0)
    att = TargetAttention(query_dim=5, d_model=8).eval()
    events = torch.randn(2, 4, 8)
    mask = torch.tensor([[True, True, False, False], [False, False, False, False]])
    query, request_index = torch.randn(3, 5), torch.tensor([0, 0, 1])
    out = att(query, events, mask, request_index)
    perturbed = events.clone()
    perturbed[0, 2:] = 1e3
    perturbed[1] = -1e3
    torch.testing.assert_close(att(query, perturbed, mask, request_index), out)
    assert out.shape == (3, 8)
    assert torch.equal(out[2], torch.zeros(8)), "no events: attends to the empty slot only"
    # candidates of one request get different results when their queries differ
    assert not torch.allclose(out[0], out[1])


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
