"""DIN target attention (Deep Interest Network, Zhou et al. 2018; sequence-modeling article): each
candidate weighs its request's events by an MLP over [q, k, q - k, q * k] (q: the candidate
projected to the event width, k: an event) and sums them.

The weights are normalized by a masked softmax (with an empty slot, so an empty sequence gives
zeros), so the output's scale does not grow with the sequence length; or, with ``weights="sigmoid"``
(``model.sequence.target_weights``), each event's own sigmoid over the group's length, as the
paper's 4.3 does to keep the intensity of an interest (how many events match). The MLP's first layer is
split by input block: [q, k, q - k] contribute per candidate and per event, only q * k is per
(candidate, event) pair, so the [B, L, 4W] input is never built.

The candidates are padded into blocks of rows of one request (target_attention.by_request), at
most 2B slots whatever the number of candidates per request, so [V, C, L, H] stays within
2B x L x H (one block per request, padded to the largest, once made it 13 GB: a last batch padded
with copies of its last row put 858 rows in one request).

Also the short-term half of long/short interest (modules/long_short.py), with a smaller MLP.

In: query [B, Dq], events [U, L, W], mask [U, L], request_index [B]. Out: [B, W].
"""

from typing import List, Optional

import torch
from torch import nn

from pinads_rec.modules.target_attention import attention_weights, by_request, to_rows


class DINAttention(nn.Module):
    def __init__(self, query_dim: int, width: int, hidden: List[int], weights: str = "softmax", length: int = 1):
        """``weights``, ``length``: target_attention.attention_weights ("sigmoid": as DIN's paper,
        not normalized over the events)."""
        super().__init__()
        self.weights, self.length = weights, length
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
        self,
        query: torch.Tensor,
        events: torch.Tensor,
        mask: torch.Tensor,
        request_index: torch.Tensor,
        max_rows: Optional[int] = None,
    ) -> torch.Tensor:
        """``max_rows`` (tests): caps the rows of a block (target_attention.block_width)."""
        q, slot, block_request = by_request(self.query(query), request_index, events.shape[0], max_rows)  # [V, C, W]
        # Per request, then gathered per block [V, L, ...]: a copy of the request's when none is cut.
        key = self.from_key(events).index_select(0, block_request)
        events, mask = events.index_select(0, block_request), mask.index_select(0, block_request)
        first = (
            self.from_query(q).unsqueeze(2) + key.unsqueeze(1) + self.from_product(q.unsqueeze(2) * events.unsqueeze(1))
        )  # [V, C, L, H]: V x C <= 2B slots (by_request), whatever the candidates per request
        weights = attention_weights(self.score(first).squeeze(-1), mask, self.weights, self.length)  # [V, C, L]
        return to_rows(torch.bmm(weights, events), slot)
