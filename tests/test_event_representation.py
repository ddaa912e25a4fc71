"""Event representation (pinads_rec/modules/event_representation.py): log2 time-delta buckets, the
widths of both combines, padding zeros and each unit's events in order."""

import pytest
import torch
from sequence_inputs import L

from pinads_rec.modules.event_representation import EventRepresentation, time_delta_bucket


def test_time_delta_buckets_are_log2_and_clamped():
    seconds = torch.tensor([-5.0, 0.0, 1.0, 3.0, 1000.0, 1e12])
    assert time_delta_bucket(seconds, 24).tolist() == [0, 0, 1, 2, 9, 23]


@pytest.mark.parametrize("combine,width", [("sum", 16), ("concat", 2 * 8 + 4)])
def test_event_representation_widths_and_padding(combine, width):
    torch.manual_seed(0)
    rep = EventRepresentation([8, 8], 4, L, combine, 16, 24)
    lengths = [3, 0, 6, 1]
    n = sum(lengths)
    offsets = torch.tensor([0, 3, 3, 9, 10])
    attrs = [torch.randn(n, 8), torch.randn(n, 8)]
    content, mask, deltas = rep(attrs, offsets, torch.arange(n, dtype=torch.float32) + 1, torch.randn(n, 4))
    assert rep.width == width and content.shape == (4, L, width)
    assert mask.sum(1).tolist() == lengths
    assert (content[~mask] == 0).all() and (deltas[~mask] == 0).all()
    assert deltas[2, :6].tolist() == [4.0, 5.0, 6.0, 7.0, 8.0, 9.0]  # each unit's events in order
    if combine == "concat":  # side by side, unprojected
        torch.testing.assert_close(content[0, :3, :8], attrs[0][:3])
