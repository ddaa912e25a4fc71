"""Target attention: each candidate attends over its request's encoded events (the DIN idea, with a
scaled dot product as the score; sequence-modeling article, "feature interaction" and DIN).

The expensive encoder runs once per request; this step is per candidate but light. The candidates
of a request are contiguous rows (``request_index`` is non-decreasing, as the loader builds it), so
they are padded into one [U, C, d] block and scored against their request's events with one batched
matmul: no per-row copy of the [L, d] events is ever made. A learned "no event" slot with score 0
and value 0 keeps an empty sequence finite (it attends to nothing and returns zeros).

In: query [B, Dq] (candidate-side features), events [U, L, d], mask [U, L] (True = real event),
request_index [B] (row -> request, non-decreasing). Out: [B, d].
"""

import math

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import torch
from torch import nn


def _attend(q: torch.Tensor, keys: torch.Tensor, events: torch.Tensor, mask: torch.Tensor,
            request_index: torch.Tensor) -> torch.Tensor:
    """q [B, d] per candidate; keys, events [U, L, d]; mask [U, L]. Returns [B, d]."""
    U = events.shape[0]
    rows = torch.bincount(request_index, minlength=U)
    offsets = torch.cat([rows.new_zeros(1), rows.cumsum(0)])
    # .item(), not int(): torch.export keeps the width symbolic instead of failing on it.
    C = rows.max().item()
    q = torch.ops.fbgemm.jagged_to_padded_dense(q, [offsets], [C], 0.0)  # [U, C, d]
    scores = torch.bmm(q, keys.transpose(1, 2)).masked_fill(~mask.unsqueeze(1), float("-inf"))  # [U, C, L]
    weights = torch.cat([scores, torch.zeros_like(scores[..., :1])], dim=-1).softmax(dim=-1)[..., :-1]
    out = torch.bmm(weights, events)  # [U, C, d]
    # Back to rows by a gather (row b sits at slot (request, position in its request)); fbgemm's
    # dense_to_jagged returns a tensor list the torch.export .pt2 serializer cannot round-trip.
    slot = request_index * C + torch.arange(request_index.shape[0], device=q.device) - offsets.index_select(0, request_index)
    return out.reshape(U * C, -1).index_select(0, slot)


# The padding width depends on the batch: keep this call opaque to FX tracing (train pipeline).
torch.fx.wrap("_attend")


class TargetAttention(nn.Module):
    def __init__(self, query_dim: int, d_model: int):
        super().__init__()
        self.query = nn.Linear(query_dim, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.scale = 1.0 / math.sqrt(d_model)

    def forward(self, query: torch.Tensor, events: torch.Tensor, mask: torch.Tensor,
                request_index: torch.Tensor) -> torch.Tensor:
        # A batched matmul, not self.key(events): nn.Linear checks the contiguity of this [U, L, d]
        # slice of the encoder output, which torch.export turns into a U != 1 guard (no single requests).
        keys = torch.baddbmm(self.key.bias.view(1, 1, -1), events, self.key.weight.t().expand(events.shape[0], -1, -1))
        return _attend(self.query(query) * self.scale, keys, events, mask, request_index)
