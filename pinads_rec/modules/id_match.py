"""Match indicators: for each declared pair (a candidate-side sparse feature, another sparse feature
on the same table -- the request's context, the user's query), 1 where the two share an id, 0
where not: an equality of two sparse ids, which embeddings and the cross network can only
approximate (a dot product of two embeddings is high for similar ids, not for equal ones), given to
the cross network outright.

Either side may hold several ids (a multi-hot feature) and sit per row or per request (a user-side
feature, once per request slot): each side is its ids [M] with the unit of each (its row, or its
request slot), and an id of the candidate matches one of the other side when both are equal and
sit in the same row (or the row's request). Exact, no padding: the [Ma, Mb] comparison of a batch's
ids (about B x B booleans).

In: per pair, (candidate ids [Ma], their rows [Ma]), (other ids [Mb], their units [Mb]), whether
the other side is per request, request_index [B]. Out: [B, pairs] float (0 or 1).
"""

from typing import List, Tuple

import torch
from torch import nn

Side = Tuple[torch.Tensor, torch.Tensor]  # ids [M], the row (or request slot) of each [M]


def shared_id(candidate: Side, other: Side, other_per_request: bool, request_index: torch.Tensor) -> torch.Tensor:
    """[B] bool: whether each row's candidate ids and the other side's (its row's, or its request's)
    share an id."""
    ids_a, rows_a = candidate
    ids_b, units_b = other
    units_a = request_index.index_select(0, rows_a) if other_per_request else rows_a
    equal = (ids_a.unsqueeze(1) == ids_b.unsqueeze(0)) & (units_a.unsqueeze(1) == units_b.unsqueeze(0))  # [Ma, Mb]
    hit = equal.any(1).to(torch.int32)
    return hit.new_zeros(request_index.shape[0]).index_add(0, rows_a, hit) > 0


class IdMatches(nn.Module):
    def __init__(self, pairs: List[Tuple[str, str]]):
        """``pairs``: (candidate feature, other feature) names, in config order."""
        super().__init__()
        self.pairs = [tuple(p) for p in pairs]
        self.output_dim = len(self.pairs)

    def forward(self, sides: List[Tuple[Side, Side, bool]], request_index: torch.Tensor) -> torch.Tensor:
        """``sides``: per pair, the candidate's side, the other's, and whether the other is per request."""
        matched = [shared_id(a, b, per_request, request_index) for a, b, per_request in sides]
        return torch.stack(matched, dim=1).to(torch.float32)
