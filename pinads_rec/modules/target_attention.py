"""Target attention: each candidate attends over its request's encoded events (the DIN idea, with a
scaled dot product as the score; sequence-modeling article, "feature interaction" and DIN).

The expensive encoder runs once per request; this step is per candidate row but light: one query
projection per row and a dot product with each of the request's events. A learned "no event" slot
with score 0 and value 0 keeps an empty sequence finite (it attends to nothing and returns zeros).

In: query [B, Dq] (candidate-side features), events [U, L, d], mask [U, L] (True = real event),
request_index [B] (row -> request). Out: [B, d].
"""

import math

import torch
from torch import nn


class TargetAttention(nn.Module):
    def __init__(self, query_dim: int, d_model: int):
        super().__init__()
        self.query = nn.Linear(query_dim, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.scale = 1.0 / math.sqrt(d_model)

    def forward(self, query: torch.Tensor, events: torch.Tensor, mask: torch.Tensor,
                request_index: torch.Tensor) -> torch.Tensor:
        q = self.query(query) * self.scale  # [B, d]
        keys = self.key(events).index_select(0, request_index)  # [B, L, d]
        values = events.index_select(0, request_index)  # [B, L, d]
        scores = torch.bmm(keys, q.unsqueeze(-1)).squeeze(-1)  # [B, L]
        scores = scores.masked_fill(~mask.index_select(0, request_index), float("-inf"))
        weights = torch.cat([scores, torch.zeros_like(scores[:, :1])], dim=1).softmax(dim=1)[:, :-1]
        return torch.bmm(weights.unsqueeze(1), values).squeeze(1)
