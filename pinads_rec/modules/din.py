"""DIN target attention (Deep Interest Network, Zhou et al. 2018; sequence-modeling article): each
candidate weighs its request's events by an MLP over [q, k, q - k, q * k] (q: the candidate
projected to the event width, k: an event) and sums them.

The weights are normalized by a masked softmax (with an empty slot, so an empty sequence gives
zeros), so the output's scale does not grow with the sequence length. The MLP's first layer is
split by input block: [q, k, q - k] contribute per candidate and per event, only q * k is per
(candidate, event) pair, so the [B, L, 4W] input is never built.

Also the short-term half of long/short interest (modules/long_short.py), with a smaller MLP.

In: query [B, Dq], events [U, L, W], mask [U, L], request_index [B]. Out: [B, W].
"""

from typing import List

import torch
from torch import nn

from pinads_rec.modules.target_attention import by_request, masked_softmax_with_empty_slot, to_rows


class DINAttention(nn.Module):
    def __init__(self, query_dim: int, width: int, hidden: List[int]):
        super().__init__()
        self.query = nn.Linear(query_dim, width)
        h = hidden[0]
        self.from_query = nn.Linear(width, h)  # the q and q - k blocks' q part
        self.from_key = nn.Linear(width, h, bias=False)  # the k and q - k blocks' k part
        self.from_product = nn.Linear(width, h, bias=False)  # the q * k block
        layers: List[nn.Module] = [nn.ReLU()]
        for a, b in zip(hidden, hidden[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        layers.append(nn.Linear(hidden[-1], 1))
        self.score = nn.Sequential(*layers)

    def forward(
        self, query: torch.Tensor, events: torch.Tensor, mask: torch.Tensor, request_index: torch.Tensor
    ) -> torch.Tensor:
        q, slot = by_request(self.query(query), request_index, events.shape[0])  # [U, C, W]
        first = (
            self.from_query(q).unsqueeze(2)
            + self.from_key(events).unsqueeze(1)
            + self.from_product(q.unsqueeze(2) * events.unsqueeze(1))
        )  # [U, C, L, H]
        weights = masked_softmax_with_empty_slot(self.score(first).squeeze(-1), mask)  # [U, C, L]
        return to_rows(torch.bmm(weights, events), slot)
