"""Long/short interest (pinads_rec/modules/long_short.py): the short-term interest reads only the
latest events."""

import torch
from sequence_inputs import L, W
from sequence_inputs import padded as _padded

from pinads_rec.modules.long_short import ShortTermInterest


def test_short_term_interest_reads_only_the_latest_events():
    torch.manual_seed(0)
    short = ShortTermInterest(query_dim=5, width=W, short_length=2, hidden=[8]).eval()
    events, mask = _padded([5, 1])
    query, request_index = torch.randn(3, 5), torch.tensor([0, 0, 1])
    out = short(query, events, mask, request_index)
    older = events.clone()
    older[:, 2:] = torch.randn(2, L - 2, W)  # events past the newest two
    torch.testing.assert_close(short(query, older, mask, request_index), out)
    newer = events.clone()
    newer[0, 0] += 1.0
    assert not torch.allclose(short(query, newer, mask, request_index)[:2], out[:2])
