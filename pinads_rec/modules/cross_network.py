"""The DCNv2 cross network, chosen in one place: torchrec's ``LowRankCrossNet`` (each layer's weight
factored as U V with rank ``low_rank``, the DCNv2 paper's cheaper form) or, with ``low_rank`` 0, the
full-rank ``CrossNet``. Wrapped in a ``LargeLayer``: one of the layers that runs in BF16 when the
precision says so (modules/precision.py). Without TorchRec installed, their torch equivalents
(modules/torchrec_layers.py).

In: [N, width]. Out: [N, width].
"""

from pinads_rec.modules.precision import LargeLayer
from pinads_rec.modules.torchrec_layers import CrossNet, LowRankCrossNet


def cross_network(width: int, num_layers: int, low_rank: int) -> LargeLayer:
    """``num_layers`` cross layers over ``width`` features; low-rank when ``low_rank`` > 0."""
    return LargeLayer(LowRankCrossNet(width, num_layers, low_rank) if low_rank else CrossNet(width, num_layers))
