"""Target-aware retrieval from a long history (SIM's "hard search", Pi et al. 2020): for each
candidate, the newest ``max_events`` events of its request's history whose category (a configured
attribute of the group: each group may name its own, model.sequence_groups.<group>.retrieval)
equals the candidate's, encoded with target attention.

A long history is mostly about other things than the candidate. Attending over all of it costs L^2
(self-attention) or B x L (target attention) and dilutes the few relevant events; the hard search
keeps only events sharing the candidate's category, a cheap id comparison, so the encoder sees K
events whatever L is. The search also gives the count of matching events in the whole history,
which attention weights alone do not carry (a softmax normalizes it away): log(1 + count) joins
the output.

The search runs on ids (the events' attribute ids and the candidate's, from one table), on the
request-level events broadcast to rows by ``request_index`` -- nothing is copied per row but the K
retrieved events. Events are newest first, so the first K matches are the newest. Either side may
hold a bag of ids (a video's tags, the clicked videos' tags): an event matches when it shares an id
with the candidate.

In: events [U, L, W] (content + time-delta positions), event ids [U, L] (or bags [U, L, K], padded
with -1), mask [U, L], candidate ids [B] (or the ids of bags [Mc] and the row of each, [Mc]),
query [B, Dq], request_index [B]. Out: [B, W + 1] (attention output ++ log(1 + matches)).
"""

import math
from typing import NamedTuple, Optional

import torch
from torch import nn

from pinads_rec.modules.target_attention import masked_softmax_with_empty_slot


class Search(NamedTuple):
    """The ids a retrieval compares: the events' ([N], or bags [N, K] padded with -1) and the
    candidates' ([B] one per row, or [Mc] with ``candidate_rows`` [Mc] the row of each)."""

    event_ids: torch.Tensor
    candidate_ids: torch.Tensor
    candidate_rows: Optional[torch.Tensor] = None


def matches(
    event_ids: torch.Tensor,
    mask: torch.Tensor,
    candidate_ids: torch.Tensor,
    request_index: torch.Tensor,
    candidate_rows: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per row, which of its request's real events hold its candidate's id [B, L]: event ids
    [U, L] or bags [U, L, Ke]; candidate ids [B], or [Mc] ids of the rows ``candidate_rows`` (a row
    matches an event when any of its ids is one of the event's)."""
    L = event_ids.shape[1]
    bags = event_ids if event_ids.dim() == 3 else event_ids.unsqueeze(2)  # [U, L, Ke]
    if candidate_rows is None:  # one id per row
        candidate_rows = torch.arange(candidate_ids.shape[0], device=candidate_ids.device)
    # Per candidate id, the events holding it; a row's events match when any of its ids does.
    of_id = bags.index_select(0, request_index.index_select(0, candidate_rows))  # [Mc, L, Ke]
    per_id = (of_id == candidate_ids[:, None, None]).any(2).to(torch.int32)  # [Mc, L]
    hit = per_id.new_zeros(request_index.shape[0], L).index_add(0, candidate_rows, per_id) > 0
    return hit & mask.index_select(0, request_index)  # [B, L]


def hard_search(
    event_ids: torch.Tensor,
    mask: torch.Tensor,
    candidate_ids: torch.Tensor,
    request_index: torch.Tensor,
    k: int,
    candidate_rows: Optional[torch.Tensor] = None,
):
    """Per row: the positions [B, K] of the newest ``k`` events matching its candidate (in [0, L)),
    which of them are real matches [B, K], and the number of matches in the history [B]. Event ids
    [U, L] or bags [U, L, Ke]; candidate ids [B], or [Mc] ids of the rows ``candidate_rows``."""
    L = event_ids.shape[1]
    match = matches(event_ids, mask, candidate_ids, request_index, candidate_rows)
    count = match.sum(dim=1)
    k = min(k, L)
    # Earlier (newer) matches score higher: topk keeps the first k matches in order.
    newest_first = torch.arange(L, 0, -1, device=event_ids.device)
    score, position = torch.topk(match * newest_first, k, dim=1)
    return position, score > 0, count


class TargetRetrieval(nn.Module):
    def __init__(self, query_dim: int, width: int, max_events: int):
        super().__init__()
        self.max_events = max_events
        self.query = nn.Linear(query_dim, width)
        self.key = nn.Linear(width, width)
        self.scale = 1.0 / math.sqrt(width)
        self.output_dim = width + 1

    def forward(
        self,
        events: torch.Tensor,
        event_ids: torch.Tensor,
        mask: torch.Tensor,
        candidate_ids: torch.Tensor,
        query: torch.Tensor,
        request_index: torch.Tensor,
        candidate_rows: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        U, L, W = events.shape
        position, found, count = hard_search(
            event_ids, mask, candidate_ids, request_index, self.max_events, candidate_rows
        )
        flat = (request_index.unsqueeze(1) * L + position).reshape(-1)
        retrieved = events.reshape(U * L, W).index_select(0, flat).view(position.shape[0], -1, W)  # [B, K, W]
        q = self.query(query) * self.scale  # [B, W]
        scores = torch.einsum("bw,bkw->bk", q, self.key(retrieved)).unsqueeze(1)  # [B, 1, K]
        weights = masked_softmax_with_empty_slot(scores, found)  # an empty search attends to nothing
        out = torch.bmm(weights, retrieved).squeeze(1)
        return torch.cat([out, torch.log1p(count.to(out.dtype)).unsqueeze(1)], dim=1)
