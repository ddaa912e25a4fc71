"""Target attention: each candidate attends over its request's encoded events (the DIN idea, with a
scaled dot product as the score; sequence-modeling article, "feature interaction" and DIN).

The expensive encoder runs once per request; this step is per candidate but light. The candidates
of a request are contiguous rows (``request_index`` is non-decreasing, as the loader builds it), so
they are padded into [V, C, d] blocks (``by_request``) and scored against their request's events
with one batched matmul: the [L, d] events are copied per block, not per row. A "no event" slot with
score 0 and value 0 keeps an empty sequence finite (it attends to nothing and returns zeros). With
``weights="sigmoid"`` each event's weight is its own sigmoid (over the group's length), not a share
of one: how many events the candidate matches survives the pooling.

Memory bound: one block per request, padded to the batch's largest request, holds U x C_max slots.
With 1-3 candidates per request and a last batch padded with copies of its last row (one request
of hundreds of rows) that is hundreds of times the batch's rows: DIN's [U, C, L, H] was 13 GB on a
4096-row batch. So when U x C_max > 2B the blocks are B // U rows wide and a request of more rows
takes several, each with its request's events: V x C <= 2B slots whatever the number of candidates
per request. With ~12 per request (the demo) U x C_max <= 2B: one block per request, as before. A
row's output does not depend on its block (tests/test_memory_bounds.py). The width is chosen by
tensor ops, not a Python branch: the same graph traces (FX, ``torch.export``) for every batch.

In: query [B, Dq] (candidate-side features), events [U, L, d], mask [U, L] (True = real event),
request_index [B] (row -> request, non-decreasing). Out: [B, d].
"""

import math
from typing import Optional, Tuple

import torch
from torch import nn

from pinads_rec.modules.jagged import pad_jagged


def block_width(rows: torch.Tensor, B: int, max_rows: Optional[int] = None) -> torch.Tensor:
    """C, the rows a block holds (a 0-d tensor: it depends on the data), from the rows per request
    [U]: the largest request's when U x C_max <= 2B (one block per request), else B // U (at least
    1); ``max_rows`` (tests) caps the largest request's instead. Tensor ops, not a Python branch:
    the same graph traces for every batch (FX, torch.export)."""
    most = rows.max()
    if max_rows is not None:
        return most.clamp(min=1, max=max_rows)
    U = rows.shape[0]
    cut = most * 0 + torch.sym_max(B // torch.sym_max(U, 1), 1)  # B // U < 2B / U < C_max when chosen
    return torch.where(most * U <= 2 * B, most, cut).clamp(min=1)


def by_request(
    q: torch.Tensor, request_index: torch.Tensor, U: int, max_rows: Optional[int] = None
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows [B, d] -> blocks [V, C, d] of C consecutive rows of one request (``block_width``; a
    request of more rows takes several blocks, of fewer leaves zeros), each row's slot in the
    flattened [V * C] blocks (for ``to_rows``), and each block's request [V] (to gather its events).
    V x C <= 2B: U x C_max <= 2B, or sum over requests of ceil(n / C) x C <= B + U x C <= 2B."""
    B = request_index.shape[0]
    rows = torch.bincount(request_index, minlength=U)  # [U]
    offsets = torch.cat([rows.new_zeros(1), rows.cumsum(0)])
    width = block_width(rows, B, max_rows)
    blocks_of = (rows + (width - 1)) // width  # [U] blocks per request
    # One host sync for both sizes; .tolist(), not int(): torch.export keeps them symbolic.
    C, V = torch.stack([width, blocks_of.sum()]).tolist()
    position = torch.arange(B, device=q.device) - offsets.index_select(0, request_index)  # in its request
    first = blocks_of.cumsum(0) - blocks_of  # [U] a request's first block
    # arange over rows' own length (U; unbacked under torch.export, as bincount's): no guard on it.
    block_request = torch.arange(rows.shape[0], device=q.device).repeat_interleave(blocks_of, output_size=V)  # [V]
    within = torch.arange(V, device=q.device) - first.index_select(0, block_request)  # block's place in its request
    starts = offsets.index_select(0, block_request) + within * C  # [V] each block's first row
    blocks = pad_jagged(q, torch.cat([starts, offsets[-1:]]), C)
    slot = (first.index_select(0, request_index) + position // C) * C + position % C
    return blocks, slot, block_request


def to_rows(out: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """[V, C, d] blocks -> [B, d] rows. A gather: fbgemm's dense_to_jagged returns a tensor list the
    torch.export .pt2 serializer cannot round-trip."""
    return out.reshape(out.shape[0] * out.shape[1], -1).index_select(0, slot)


def masked_softmax_with_empty_slot(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of scores [V, C, L] at real events (mask [V, L]), plus a slot of
    score 0 that takes the weight no event takes: an empty sequence gets all-zero weights."""
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    return torch.cat([scores, torch.zeros_like(scores[..., :1])], dim=-1).softmax(dim=-1)[..., :-1]


def sigmoid_weights(scores: torch.Tensor, mask: torch.Tensor, length: int) -> torch.Tensor:
    """Count-preserving weights [V, C, L] of scores [V, C, L] at real events (mask [V, L]): each
    event's sigmoid, not normalized over the events (DIN's paper, 4.3: a softmax removes how many
    events match; HSTU drops it too), divided by the group's ``length`` so a full sequence of
    matches weighs at most 1 whatever its padding."""
    return torch.sigmoid(scores) * mask.unsqueeze(1).to(scores.dtype) / length


def attention_weights(scores: torch.Tensor, mask: torch.Tensor, kind: str, length: int) -> torch.Tensor:
    """``masked_softmax_with_empty_slot`` ("softmax") or ``sigmoid_weights`` ("sigmoid")."""
    return sigmoid_weights(scores, mask, length) if kind == "sigmoid" else masked_softmax_with_empty_slot(scores, mask)


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    events: torch.Tensor,
    mask: torch.Tensor,
    request_index: torch.Tensor,
    max_rows: Optional[int] = None,
    kind: str = "softmax",
    length: int = 1,
) -> torch.Tensor:
    """q [B, d] per candidate; keys, events [U, L, d]; mask [U, L]. Returns [B, d]. ``max_rows``: as
    ``by_request``; ``kind``, ``length``: as ``attention_weights``."""
    blocks, slot, block_request = by_request(q, request_index, events.shape[0], max_rows)
    # Each block's request's events [V, L, d]: a copy of [U, L, d] when no request is cut.
    keys, events, mask = (t.index_select(0, block_request) for t in (keys, events, mask))
    weights = attention_weights(torch.bmm(blocks, keys.transpose(1, 2)), mask, kind, length)  # [V, C, L]
    return to_rows(torch.bmm(weights, events), slot)


# The blocks' sizes depend on the batch: keep this call opaque to FX tracing (train pipeline).
torch.fx.wrap("_attend")


class TargetAttention(nn.Module):
    def __init__(self, query_dim: int, d_model: int, weights: str = "softmax", length: int = 1):
        """``weights``: "softmax", or "sigmoid" (count-preserving, divided by ``length``, the
        group's events: ``attention_weights``)."""
        super().__init__()
        self.query = nn.Linear(query_dim, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.scale = 1.0 / math.sqrt(d_model)
        self.weights, self.length = weights, length

    def forward(
        self,
        query: torch.Tensor,
        events: torch.Tensor,
        mask: torch.Tensor,
        request_index: torch.Tensor,
        max_rows: Optional[int] = None,
    ) -> torch.Tensor:
        """``max_rows`` (tests): caps the rows of a block (``block_width``)."""
        # A batched matmul, not self.key(events): nn.Linear checks the contiguity of this [U, L, d]
        # slice of the encoder output, which torch.export turns into a U != 1 guard (no single requests).
        keys = torch.baddbmm(self.key.bias.view(1, 1, -1), events, self.key.weight.t().expand(events.shape[0], -1, -1))
        q = self.query(query) * self.scale
        return _attend(q, keys, events, mask, request_index, max_rows, self.weights, self.length)
