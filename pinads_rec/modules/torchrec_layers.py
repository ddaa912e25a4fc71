"""TorchRec's dense layers the model uses -- ``CrossNet``, ``LowRankCrossNet``, ``MLP`` -- taken from
TorchRec where it is installed, and from the torch equivalents below where it is not (a GPU machine
with torch alone, where TorchRec cannot import without fbgemm: benchmarks/arch_precision.py runs the
dense and sequence arch there).

The equivalents keep TorchRec's parameter names, shapes, initialization order and arithmetic
(torchrec 1.8.0's modules/crossnet.py and modules/mlp.py, ReLU MLPs only, the one kind used here):
the same seed gives the same weights, the same weights the same bits, forward and backward, and a
checkpoint loads into either (tests/test_jagged_fallback.py compares them).
"""

from importlib.util import find_spec
from typing import List

import torch
from torch import nn

HAVE_TORCHREC = find_spec("torchrec") is not None
if HAVE_TORCHREC:
    from torchrec.modules.crossnet import CrossNet, LowRankCrossNet
    from torchrec.modules.mlp import MLP


class TorchCrossNet(nn.Module):
    """Full-rank DCNv2 cross layers: x_{l+1} = x_0 * (W_l x_l + b_l) + x_l. [N, D] -> [N, D]."""

    def __init__(self, in_features: int, num_layers: int):
        super().__init__()
        self._num_layers = num_layers
        self.kernels = nn.ParameterList(
            nn.Parameter(nn.init.xavier_normal_(torch.empty(in_features, in_features))) for _ in range(num_layers)
        )
        self.bias = nn.ParameterList(
            nn.Parameter(nn.init.zeros_(torch.empty(in_features, 1))) for _ in range(num_layers)
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x_0 = input.unsqueeze(2)  # [N, D, 1]
        x_l = x_0
        for layer in range(self._num_layers):
            x_l = x_0 * (torch.matmul(self.kernels[layer], x_l) + self.bias[layer]) + x_l
        return torch.squeeze(x_l, dim=2)


class TorchLowRankCrossNet(nn.Module):
    """Low-rank DCNv2 cross layers: x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l. [N, D] -> [N, D]."""

    def __init__(self, in_features: int, num_layers: int, low_rank: int = 1):
        super().__init__()
        if low_rank < 1:
            raise ValueError(f"LowRankCrossNet: low_rank must be >= 1, got {low_rank}")
        self._num_layers, self._low_rank = num_layers, low_rank
        self.W_kernels = nn.ParameterList(
            nn.Parameter(nn.init.xavier_normal_(torch.empty(in_features, low_rank))) for _ in range(num_layers)
        )
        self.V_kernels = nn.ParameterList(
            nn.Parameter(nn.init.xavier_normal_(torch.empty(low_rank, in_features))) for _ in range(num_layers)
        )
        self.bias = nn.ParameterList(nn.Parameter(nn.init.zeros_(torch.empty(in_features))) for _ in range(num_layers))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x_0 = x_l = input
        for layer in range(self._num_layers):
            x_l_w = nn.functional.linear(nn.functional.linear(x_l, self.V_kernels[layer]), self.W_kernels[layer])
            x_l = x_0 * (x_l_w + self.bias[layer]) + x_l
        return x_l


class TorchPerceptron(nn.Module):
    """Linear then ReLU, TorchRec's ``Perceptron`` (its ``_linear``)."""

    def __init__(self, in_size: int, out_size: int):
        super().__init__()
        self._linear = nn.Linear(in_size, out_size)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.relu(self._linear(input))


class TorchMLP(nn.Module):
    """ReLU perceptrons in a row, TorchRec's ``MLP`` (its ``_mlp``). [N, in] -> [N, layer_sizes[-1]]."""

    def __init__(self, in_size: int, layer_sizes: List[int]):
        super().__init__()
        sizes = [in_size] + list(layer_sizes)
        self._mlp = nn.Sequential(*(TorchPerceptron(a, b) for a, b in zip(sizes[:-1], sizes[1:])))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._mlp(input)


if not HAVE_TORCHREC:
    CrossNet, LowRankCrossNet, MLP = TorchCrossNet, TorchLowRankCrossNet, TorchMLP

__all__ = ["CrossNet", "LowRankCrossNet", "MLP", "HAVE_TORCHREC"]
