"""The sequence projection (pinads_rec/modules/sequence_projection.py): a linear map, then cross layers
when it has any."""

import torch
from torchrec.modules.crossnet import CrossNet


def test_sequence_projection_without_cross_layers_is_the_linear_map_alone():
    from pinads_rec.config import SequenceProjectionConfig
    from pinads_rec.modules.sequence_projection import SequenceProjection

    plain = SequenceProjection(12, SequenceProjectionConfig(dim=5, num_layers=0, low_rank=4))
    assert plain.cross is None and plain(torch.randn(2, 12)).shape == (2, 5)
    crossed = SequenceProjection(12, SequenceProjectionConfig(dim=5, num_layers=2, low_rank=0))
    assert type(crossed.cross.module) is CrossNet and crossed(torch.randn(2, 12)).shape == (2, 5)
