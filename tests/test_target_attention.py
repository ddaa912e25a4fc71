"""Target attention (pinads_rec/modules/target_attention.py): masked events ignored, no events giving
zeros, each candidate its own query."""

import torch
from sequence_inputs import W
from sequence_inputs import padded as _padded
from sequence_inputs import perturb_padding as _perturb_padding

from pinads_rec.modules.target_attention import TargetAttention


def test_target_attention_ignores_masked_events_and_empty_is_zero():
    torch.manual_seed(0)
    att = TargetAttention(query_dim=5, d_model=W).eval()
    events, mask = _padded([2, 0])
    query, request_index = torch.randn(3, 5), torch.tensor([0, 0, 1])
    out = att(query, events, mask, request_index)
    torch.testing.assert_close(att(query, _perturb_padding(events, mask), mask, request_index), out)
    assert out.shape == (3, W) and torch.equal(out[2], torch.zeros(W))
    assert not torch.allclose(out[0], out[1])  # candidates of one request differ by their queries
