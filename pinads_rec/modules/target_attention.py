"""Target attention: each candidate attends over its request's encoded events (the DIN idea, with a
scaled dot product as the score; sequence-modeling article, "feature interaction" and DIN).

The expensive encoder runs once per request; this step is per candidate but light. The candidates
of a request are contiguous rows (``request_index`` is non-decreasing, as the loader builds it), so
they are padded into one [U, C, d] block (``by_request``) and scored against their request's events
with one batched matmul: no per-row copy of the [L, d] events is ever made. A "no event" slot with
score 0 and value 0 keeps an empty sequence finite (it attends to nothing and returns zeros).

In: query [B, Dq] (candidate-side features), events [U, L, d], mask [U, L] (True = real event),
request_index [B] (row -> request, non-decreasing). Out: [B, d].
"""

import math
from typing import Tuple

import torch
from torch import nn

from pinads_rec.modules.jagged import pad_jagged


def by_request(q: torch.Tensor, request_index: torch.Tensor, U: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rows [B, d] -> per-request blocks [U, C, d] (C: the most rows of a request), and each row's
    slot in the flattened [U * C] blocks (for ``to_rows``)."""
    rows = torch.bincount(request_index, minlength=U)
    offsets = torch.cat([rows.new_zeros(1), rows.cumsum(0)])
    # .item(), not int(): torch.export keeps the width symbolic instead of failing on it.
    C = rows.max().item()
    blocks = pad_jagged(q, offsets, C)
    slot = (
        request_index * C
        + torch.arange(request_index.shape[0], device=q.device)
        - offsets.index_select(0, request_index)
    )
    return blocks, slot


def to_rows(out: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """[U, C, d] per-request blocks -> [B, d] rows. A gather: fbgemm's dense_to_jagged returns a
    tensor list the torch.export .pt2 serializer cannot round-trip."""
    return out.reshape(out.shape[0] * out.shape[1], -1).index_select(0, slot)


def masked_softmax_with_empty_slot(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of scores [U, C, L] at real events (mask [U, L]), plus a slot of
    score 0 that takes the weight no event takes: an empty sequence gets all-zero weights."""
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    return torch.cat([scores, torch.zeros_like(scores[..., :1])], dim=-1).softmax(dim=-1)[..., :-1]


def _attend(
    q: torch.Tensor, keys: torch.Tensor, events: torch.Tensor, mask: torch.Tensor, request_index: torch.Tensor
) -> torch.Tensor:
    """q [B, d] per candidate; keys, events [U, L, d]; mask [U, L]. Returns [B, d]."""
    blocks, slot = by_request(q, request_index, events.shape[0])
    weights = masked_softmax_with_empty_slot(torch.bmm(blocks, keys.transpose(1, 2)), mask)  # [U, C, L]
    return to_rows(torch.bmm(weights, events), slot)


# The padding width depends on the batch: keep this call opaque to FX tracing (train pipeline).
torch.fx.wrap("_attend")


class TargetAttention(nn.Module):
    def __init__(self, query_dim: int, d_model: int):
        super().__init__()
        self.query = nn.Linear(query_dim, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.scale = 1.0 / math.sqrt(d_model)

    def forward(
        self, query: torch.Tensor, events: torch.Tensor, mask: torch.Tensor, request_index: torch.Tensor
    ) -> torch.Tensor:
        # A batched matmul, not self.key(events): nn.Linear checks the contiguity of this [U, L, d]
        # slice of the encoder output, which torch.export turns into a U != 1 guard (no single requests).
        keys = torch.baddbmm(self.key.bias.view(1, 1, -1), events, self.key.weight.t().expand(events.shape[0], -1, -1))
        return _attend(self.query(query) * self.scale, keys, events, mask, request_index)
