"""HSTU encoder: shapes, padding independence, the causal mask (newest first), the time bias,
empty units, length buckets vs one padded batch, and that it learns."""

import pytest
import torch
import torch.nn.functional as F

from pinads_rec.modules import hstu
from pinads_rec.modules.hstu import HSTUEncoder, HSTUStack
from pinads_rec.modules.length_buckets import run_by_length
from pinads_rec.modules.precision import set_precision

W = 16


def stack(**kw) -> HSTUStack:
    torch.manual_seed(0)
    args = dict(width=W, num_layers=2, num_heads=2, dropout=0.0, position_buckets=32, time_buckets=24)
    return HSTUStack(**{**args, **kw}).eval()


def batch(lengths, L, seed=1):
    """Events, mask and time deltas (growing with position: newest first) for units of ``lengths``."""
    g = torch.Generator().manual_seed(seed)
    U = len(lengths)
    x = torch.randn(U, L, W, generator=g)
    mask = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
    deltas = torch.rand(U, L, generator=g).mul(1e5).cumsum(dim=1)
    return x, mask, deltas


def pad(t, extra, fill):
    """``t`` [U, L, ...] with ``extra`` more positions holding ``fill`` (garbage)."""
    return torch.cat([t, fill.expand(t.shape[0], extra, *t.shape[2:]).to(t.dtype)], dim=1)


def test_shapes_and_output_dim():
    enc = HSTUEncoder(width=W, num_layers=2, num_heads=4, dropout=0.1, position_buckets=32, time_buckets=24)
    x, mask, deltas = batch([5, 0, 12], 12)
    pooled, encoded = enc(x, mask, deltas)
    assert enc.output_dim == 2 * W
    assert pooled.shape == (3, enc.output_dim) and encoded.shape == (3, 12, W)
    assert torch.equal(encoded[1], torch.zeros(12, W)) and torch.equal(pooled[1], torch.zeros(2 * W))
    assert torch.equal(encoded[0, 5:], torch.zeros(7, W))  # zeros at padding


@pytest.fixture(params=[256, 6], ids=["one_query_block", "query_blocks_of_6"])
def query_block(request, monkeypatch):
    monkeypatch.setattr(hstu, "QUERY_BLOCK", request.param)
    return request.param


def test_query_blocks_give_the_same_outputs_as_one(monkeypatch):
    s = stack()
    x, mask, deltas = batch([40, 17, 0, 33], 40)
    x.requires_grad_(True)
    whole = s(x, mask, deltas)
    (grad,) = torch.autograd.grad(whole.sum(), x)
    monkeypatch.setattr(hstu, "QUERY_BLOCK", 7)
    blocked = s(x, mask, deltas)
    (blocked_grad,) = torch.autograd.grad(blocked.sum(), x)
    assert torch.allclose(blocked, whole, atol=1e-5) and torch.allclose(blocked_grad, grad, atol=1e-5)


def test_outputs_do_not_depend_on_padding(query_block):
    s = stack()
    lengths = [7, 20, 1, 0, 13]
    x, mask, deltas = batch(lengths, 20)
    ref = s(x, mask, deltas)
    garbage_x = torch.tensor(float("nan")).expand(1, 1, W).clone()
    garbage_x[..., ::2] = 1e6
    longer = s(
        pad(x, 37, garbage_x), pad(mask, 37, torch.zeros(1, 1, dtype=torch.bool)), pad(deltas, 37, torch.tensor(-3e9))
    )
    # Garbage after each unit's events too, inside the first L positions.
    x2, d2 = x.clone(), deltas.clone()
    x2[~mask] = 1e4
    d2[~mask] = float("inf")
    again = s(x2, mask, d2)
    for u, n in enumerate(lengths):
        assert torch.allclose(longer[u, :n], ref[u, :n], atol=1e-5), u
        assert torch.allclose(again[u, :n], ref[u, :n], atol=1e-5), u
    # An empty unit gives finite outputs, whatever its padding holds.
    assert torch.isfinite(longer[3]).all() and torch.isfinite(again[3]).all()


def test_causal_newest_first(query_block):
    # Position 0 is the newest event: it sees the older ones (larger positions); an older event
    # never sees a newer one.
    s = stack()
    x, mask, deltas = batch([30], 30)
    ref = s(x, mask, deltas)
    other = torch.randn(W, generator=torch.Generator().manual_seed(5)) * 3.0
    older = x.clone()
    older[0, 20] = other
    change = (s(older, mask, deltas) - ref)[0].abs().amax(dim=1)
    assert change[:20].min() > 1e-4  # every newer event sees it
    assert change[21:].max() == 0.0  # the older ones do not
    newer = x.clone()
    newer[0, 5] = other
    change = (s(newer, mask, deltas) - ref)[0].abs().amax(dim=1)
    assert change[:5].min() > 1e-4 and change[6:].max() == 0.0


def test_time_bias_matters():
    s = stack()
    x, mask, deltas = batch([3, 25], 25)
    ref = s(x, mask, deltas)
    out = s(x, mask, deltas * 1000.0)
    assert (out[1] - ref[1]).abs().max() > 1e-3
    # Time enters only through differences between events: a shift of every delta changes nothing.
    assert torch.allclose(s(x, mask, deltas), ref) and torch.allclose(
        s(x, mask, deltas.round() + 7.0), s(x, mask, deltas.round()), atol=1e-6
    )


def test_gradients_finite_for_empty_units():
    enc = HSTUEncoder(width=W, num_layers=2, num_heads=2, dropout=0.0, position_buckets=32, time_buckets=24)
    x, mask, deltas = batch([0, 0, 4], 6)
    x.requires_grad_(True)
    pooled, encoded = enc(x, mask, deltas)
    (pooled.sum() + encoded.sum()).backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in enc.parameters())
    assert torch.equal(pooled[:2], torch.zeros(2, 2 * W))


def test_length_buckets_match_one_padded_batch(query_block):
    s = stack()
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 90, (24,), generator=g).tolist() + [90]
    x, mask, deltas = batch(lengths, 90)
    padded = s(x, mask, deltas)
    bucketed = run_by_length(s, x, mask, deltas)
    m = mask.unsqueeze(-1)
    assert torch.allclose(bucketed * m, padded * m, atol=1e-5)
    # And through the encoder, which runs by length: the same as the stack on the padded batch.
    enc = HSTUEncoder(width=W, num_layers=2, num_heads=2, dropout=0.0, position_buckets=32, time_buckets=24).eval()
    enc.stack.module.load_state_dict(s.state_dict())
    _, encoded = enc(x, mask, deltas)
    assert torch.allclose(encoded, s(x, mask, deltas.round()) * m, atol=1e-5)


def test_bf16_runs_and_stays_close():
    enc = HSTUEncoder(width=W, num_layers=2, num_heads=2, dropout=0.0, position_buckets=32, time_buckets=24).eval()
    x, mask, deltas = batch([9, 40, 0], 40)
    ref, _ = enc(x, mask, deltas)
    set_precision(enc, "bf16")
    autocast, _ = enc(x, mask, deltas)
    set_precision(enc, "bf16", cast_weights=True)
    cast, _ = enc(x, mask, deltas)
    assert autocast.dtype == cast.dtype == torch.float32
    assert torch.allclose(autocast, ref, atol=0.1) and torch.allclose(cast, ref, atol=0.1)


@pytest.mark.slow
def test_learns_whether_a_token_is_in_a_long_history():
    # Label: does token 0 occur in a history of 150-300 events (8 times, anywhere, mostly far from
    # the newest)? Chance is 50%; 60 steps of 32 histories learn it (held-out accuracy 1.0 at seeds 0-3).
    torch.manual_seed(0)
    vocab, L, U = 20, 300, 32
    emb = torch.nn.Embedding(vocab, W)
    enc = HSTUEncoder(width=W, num_layers=1, num_heads=2, dropout=0.0, position_buckets=32, time_buckets=24)
    head = torch.nn.Linear(enc.output_dim, 1)
    opt = torch.optim.Adam([*emb.parameters(), *enc.parameters(), *head.parameters()], lr=3e-2)

    def draw(g, U=U):
        lengths = torch.randint(L // 2, L + 1, (U,), generator=g)
        tokens = torch.randint(1, vocab, (U, L), generator=g)
        label = torch.rand(U, generator=g) < 0.5
        for _ in range(8):
            where = (torch.rand(U, generator=g) * lengths).long()
            tokens[label, where[label]] = 0
        mask = torch.arange(L)[None, :] < lengths[:, None]
        deltas = torch.arange(L, dtype=torch.float32).mul(60.0).expand(U, L)
        return tokens, mask, deltas, label.float()

    def logits(tokens, mask, deltas):
        pooled, _ = enc(emb(tokens), mask, deltas)
        return head(pooled).squeeze(1)

    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        tokens, mask, deltas, label = draw(g)
        loss = F.binary_cross_entropy_with_logits(logits(tokens, mask, deltas), label)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        tokens, mask, deltas, label = draw(torch.Generator().manual_seed(99), U=128)
        accuracy = ((logits(tokens, mask, deltas) > 0).float() == label).float().mean()
    assert accuracy > 0.95, float(accuracy)
