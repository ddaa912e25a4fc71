"""Sequence poolings (pinads_rec/modules/pooling.py): sum pooling and the period boundaries of
period-sum pooling, padding never changing an output."""

import torch
from sequence_inputs import perturb_padding as _perturb_padding

from pinads_rec.modules.pooling import PeriodSumPooling, sum_pooling


def test_sum_and_period_sum_pooling_boundaries():
    deltas = torch.tensor([[-1.0, 0.0, 3599.0, 3600.0, 86399.0, 86400.0], [1e9, 10.0, 0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[True] * 6, [True, True, False, False, False, False]])
    pool = PeriodSumPooling([3600.0, 86400.0])
    assert pool.periods(deltas[0]).tolist() == [0, 0, 0, 1, 1, 2]
    events = torch.arange(1, 13, dtype=torch.float32).view(2, 6, 1).expand(2, 6, 2).contiguous()
    out = pool(events, mask, deltas).view(2, 3, 2)[..., 0]
    # row 0: the future event (-1 s) is left out; [0, 3600): 2 + 3; [3600, 86400): 4 + 5; [86400, inf): 6
    assert out[0].tolist() == [5.0, 9.0, 6.0]
    # row 1: [0, 3600) holds event 8, the last period event 7, the middle period is empty: zeros
    assert out[1].tolist() == [8.0, 0.0, 7.0]
    assert sum_pooling(events, mask)[:, 0].tolist() == [21.0, 15.0]
    torch.testing.assert_close(pool(_perturb_padding(events, mask), mask, deltas), pool(events, mask, deltas))
