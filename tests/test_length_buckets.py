"""Length-bucketed padding (modules/length_buckets.py): same outputs as padding every unit to the
longest, whatever the padding holds."""

import torch

from pinads_rec.modules.length_buckets import GROWTH, length_buckets, run_by_length
from pinads_rec.modules.transformer import TransformerStack


def _batch(lengths, L, W=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    x = torch.randn(len(lengths), L, W, generator=g)
    mask = torch.arange(L)[None, :] < lengths[:, None]
    return x, mask


def test_buckets_cover_every_unit_once_and_bound_the_padding():
    lengths = torch.tensor([1, 0, 3, 700, 40, 41, 1000, 2, 999, 57])
    buckets = length_buckets(lengths)
    seen = torch.cat([idx for idx, _ in buckets]).sort().values
    assert torch.equal(seen, torch.arange(len(lengths)))
    for idx, padded in buckets:
        member = lengths[idx]
        assert padded == max(int(member.max()), 1)
        # Within a bucket the longest is less than GROWTH times the shortest (non-empty) unit.
        assert padded < GROWTH * max(int(member.min()), 1) + 1e-9
    assert [p for _, p in buckets] == sorted(p for _, p in buckets)


def test_bucketed_equals_padded_for_a_transformer():
    torch.manual_seed(0)
    stack = TransformerStack(16, 2, 2, 32, 0.0).eval()
    lengths = [1, 5, 33, 200, 7, 120, 64, 65, 1, 180]
    x, mask = _batch(lengths, 200)
    padded = stack(x, mask)
    bucketed = run_by_length(stack, x, mask)
    m = mask.unsqueeze(-1)
    assert torch.allclose(padded * m, bucketed * m, atol=1e-5)
    # Past a unit's bucket length the output is zeros; the padded positions are never read.
    short = [(idx, length) for idx, length in length_buckets(mask.sum(1)) if length < 200]
    assert short
    for idx, length in short:
        assert bucketed[idx, length:].abs().max() == 0


def test_padding_never_changes_an_output():
    torch.manual_seed(1)
    stack = TransformerStack(16, 1, 1, 32, 0.0).eval()
    x, mask = _batch([3, 50, 17], 50)
    garbage = torch.where(mask.unsqueeze(-1), x, torch.randn_like(x) * 100)
    wider = torch.cat([garbage, torch.randn(3, 31, 16) * 100], dim=1)
    wider_mask = torch.cat([mask, torch.zeros(3, 31, dtype=torch.bool)], dim=1)
    out = run_by_length(stack, x, mask)
    out_wide = run_by_length(stack, wider, wider_mask)
    assert torch.allclose(out, out_wide[:, :50], atol=1e-5)


def test_gradients_flow_to_every_bucket():
    stack = TransformerStack(8, 1, 1, 16, 0.0)
    x, mask = _batch([2, 9, 30], 30, W=8)
    x.requires_grad_(True)
    run_by_length(
        stack,
        x,
        mask,
    ).sum().backward()
    assert all(x.grad[u, : int(mask[u].sum())].abs().sum() > 0 for u in range(3))


def test_no_units_and_empty_units():
    assert length_buckets(torch.zeros(0, dtype=torch.long)) == []
    stack = TransformerStack(8, 1, 1, 16, 0.0).eval()
    assert run_by_length(stack, torch.ones(0, 5, 8), torch.zeros(0, 5, dtype=torch.bool)).shape == (0, 5, 8)
    x, mask = _batch([0, 0, 4], 6, W=8)
    assert torch.isfinite(run_by_length(stack, x, mask)).all()
