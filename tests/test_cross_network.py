"""The DCNv2 cross network (pinads_rec/modules/cross_network.py): low-rank unless low_rank is zero."""

import pytest
import torch
from torchrec.modules.crossnet import CrossNet, LowRankCrossNet


@pytest.mark.parametrize("low_rank,kind", [(4, LowRankCrossNet), (0, CrossNet)])
def test_cross_network_is_low_rank_unless_low_rank_is_zero(low_rank, kind):
    """The one place choosing the DCNv2 form: every model and the sequence projection use it."""
    from pinads_rec.modules.cross_network import cross_network
    from pinads_rec.modules.precision import LargeLayer

    cross = cross_network(10, 2, low_rank)
    assert isinstance(cross, LargeLayer) and type(cross.module) is kind
    assert cross(torch.randn(3, 10)).shape == (3, 10)
