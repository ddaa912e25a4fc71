"""Sum pooling and period sum pooling of a user action sequence (sequence-modeling article).

Sum pooling adds the events up: cheap and the traditional baseline. **Period sum pooling** splits
the events by time delta into periods (boundaries in seconds: [a, b, c] gives [0, a), [a, b),
[b, c), [c, inf)), sum-pools each period and concatenates the results: recent and old interests
stay apart. An empty period gives zeros; future events (negative time delta) are left out.

In: events [U, L, W], mask [U, L], time deltas [U, L] seconds. Out: [U, W] / [U, P * W].
"""

from typing import List

import torch
import torch.nn.functional as F
from torch import nn


def sum_pooling(events: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (events * mask.unsqueeze(-1).to(events.dtype)).sum(dim=1)


class PeriodSumPooling(nn.Module):
    def __init__(self, boundaries_s: List[float]):
        super().__init__()
        self.register_buffer("boundaries", torch.tensor(boundaries_s, dtype=torch.float32), persistent=False)
        self.num_periods = len(boundaries_s) + 1

    def periods(self, deltas: torch.Tensor) -> torch.Tensor:
        """Period index of each time delta: the number of boundaries <= delta."""
        return torch.bucketize(deltas.float(), self.boundaries, right=True)

    def forward(self, events: torch.Tensor, mask: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        keep = (mask & (deltas >= 0)).to(events.dtype)
        member = F.one_hot(self.periods(deltas), self.num_periods).to(events.dtype) * keep.unsqueeze(-1)  # [U, L, P]
        return torch.bmm(member.transpose(1, 2), events).flatten(1)  # [U, P * W]
