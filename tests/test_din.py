"""DIN attention (pinads_rec/modules/din.py): equal to the MLP written out row by row, padding masked,
no events giving zeros."""

import torch
import torch.nn.functional as F
from sequence_inputs import W
from sequence_inputs import padded as _padded
from sequence_inputs import perturb_padding as _perturb_padding

from pinads_rec.modules.din import DINAttention


def _din_reference(din, query, events, mask, request_index):
    """DIN written out row by row: an MLP over the explicit [q, k, q - k, q * k] per event."""
    out = []
    for b in range(query.shape[0]):
        q = din.query(query[b])
        u = int(request_index[b])
        k = events[u][mask[u]]
        qq = q.expand_as(k)
        x = torch.cat([qq, k, qq - k, qq * k], dim=1)
        # from_query = q and q - k blocks' q part, from_key = k and q - k blocks' k part: one weight
        # on the concatenation that gives the same first layer.
        w = torch.cat(
            [
                din.from_query.weight,
                din.from_key.weight,
                torch.zeros_like(din.from_key.weight),
                din.from_product.weight,
            ],
            dim=1,
        )
        s = din.score(F.linear(x, w, din.from_query.bias)).squeeze(-1)
        weights = torch.cat([s, torch.zeros(1)]).softmax(0)[:-1]
        out.append(weights @ k if len(k) else torch.zeros(events.shape[-1]))
    return torch.stack(out)


def test_din_matches_the_explicit_mlp_and_masks_padding():
    torch.manual_seed(0)
    din = DINAttention(query_dim=5, width=W, hidden=[16, 8]).eval()
    events, mask = _padded([3, 0, 6])
    query, request_index = torch.randn(5, 5), torch.tensor([0, 0, 1, 2, 2])
    out = din(query, events, mask, request_index)
    assert out.shape == (5, W)
    torch.testing.assert_close(out, _din_reference(din, query, events, mask, request_index), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(din(query, _perturb_padding(events, mask), mask, request_index), out)
    assert (out[2] == 0).all(), "no events: zeros"
