"""Long/short interest (sequence-modeling article): the whole sequence stands for the long-term
interest (what the group's other encoders make of it), the latest ``short_length`` events for the
short-term one, read by a lightweight DIN-like attention of the candidate over them. The two are
joined by concatenation in the sequence arch.

In: query [B, Dq], events [U, L, W] (newest first), mask [U, L], request_index [B]. Out: [B, W].
"""

from typing import List

import torch
from torch import nn

from pinads_rec.modules.din import DINAttention


class ShortTermInterest(nn.Module):
    def __init__(self, query_dim: int, width: int, short_length: int, hidden: List[int]):
        super().__init__()
        self.short_length = short_length
        self.attention = DINAttention(query_dim, width, hidden)

    def forward(
        self, query: torch.Tensor, events: torch.Tensor, mask: torch.Tensor, request_index: torch.Tensor
    ) -> torch.Tensor:
        k = self.short_length
        return self.attention(query, events[:, :k], mask[:, :k], request_index)
