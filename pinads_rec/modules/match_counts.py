"""Target-aware counting: how often the candidate already appears in its request's history, as
features the dense arch reads (the reference's history matches, computed inside the model from the
ids it is given).

For each declared pair (an attribute of the group's events, a candidate-side feature on the same
table), the events holding the candidate's id (``retrieval.matches``) are counted among the newest
k of each ``windows`` (0: all of them), and, per value of a ``by`` attribute (the action: a click, a
save), the same among the events with that value. ``half_lives_s`` adds recency-weighted sums (an
event weighs 2^(-age / half-life)); the log seconds since the newest match, and whether there is one,
complete the set.

Why in the model: an attention whose weights are normalized (a softmax) keeps the mix of the
matching events but not how many there are, which DIN's paper (4.3) and HSTU give up the softmax to
keep; a count is a sum over a few hundred ids, hard to learn through embeddings in one pass and
cheap to compute exactly.

Each feature is log1p'd, then encoded: the value itself and a learned map of its piecewise-linear
bins (Gorishniy et al. 2022: bins on log1p(0, 1, 2, 4, ...) so one count more moves a few units
where counts are small), both into the cross network.

In: per pair, event ids [U, L] (or bags [U, L, K], padded with -1) and candidate ids [B] (or [Mc]
with their rows), mask [U, L], ages [U, L] (seconds), the ``by`` attribute's ids [U, L],
request_index [B]. Out: [B, num_features + dim].
"""

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from pinads_rec.modules.jagged import pad_jagged_torch
from pinads_rec.modules.retrieval import matches


def bin_edges(longest: int) -> List[float]:
    """log1p(0, 1, 2, 4, ..., >= longest): the piecewise-linear bins of a log1p count."""
    counts = [0] + [2**i for i in range(max(1, math.ceil(math.log2(max(longest, 2)))) + 1)]
    return [math.log1p(c) for c in counts]


class MatchCounts(nn.Module):
    def __init__(
        self,
        pair_keys: Sequence[Tuple[str, str]],
        by_key: Optional[str],
        windows: Sequence[int],
        half_lives_s: Sequence[float],
        by_values: Sequence[int],
        longest: int,
        dim: int,
    ):
        """``pair_keys``: per pair, the sequence-KJT keys of the event attribute and the candidate
        feature; ``by_key``: the key of the attribute whose values split the counts (or None);
        ``longest``: the group's max_length."""
        super().__init__()
        self.pair_keys = [tuple(p) for p in pair_keys]
        self.by_key = by_key
        self.windows = [w if w > 0 else longest for w in windows]
        self.register_buffer("half_lives", torch.tensor(list(half_lives_s), dtype=torch.float32), persistent=False)
        self.register_buffer("by_values", torch.tensor(list(by_values), dtype=torch.long), persistent=False)
        per_pair = len(self.windows) * (1 + (len(by_values) if by_key else 0)) + len(half_lives_s) + 2
        self.num_features = len(self.pair_keys) * per_pair  # + 2: since the newest match, whether one
        self.register_buffer("edges", torch.tensor(bin_edges(longest)), persistent=False)
        self.encode = nn.Linear(self.num_features * (len(self.edges) - 1), dim) if dim else None
        self.output_dim = self.num_features + dim

    def features(
        self,
        pairs: List[Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]],
        mask: torch.Tensor,
        ages: torch.Tensor,
        by: Optional[torch.Tensor],
        request_index: torch.Tensor,
    ) -> torch.Tensor:
        """The log1p counts [B, num_features], pair by pair: per window the count, then per window
        the count of each ``by`` value, then the recency-weighted sums, log1p(seconds since the newest match)
        (0 without one) and whether there is one. ``pairs``: per pair, the event ids [U, L] (or bags
        [U, L, K]), the candidate ids and their rows (``retrieval.matches``)."""
        row_ages = ages.index_select(0, request_index).clamp(min=0)  # [B, L]
        weights = torch.exp2(-row_ages.unsqueeze(2) / self.half_lives)  # [B, L, H]
        row_by = (by.index_select(0, request_index).unsqueeze(2) == self.by_values) if by is not None else None
        out = []
        for event_ids, candidate_ids, candidate_rows in pairs:
            match = matches(event_ids, mask, candidate_ids, request_index, candidate_rows)  # [B, L], newest first
            hit = match.to(ages.dtype)
            out += [hit[:, :w].sum(1, keepdim=True) for w in self.windows]
            if row_by is not None:
                per_value = hit.unsqueeze(2) * row_by  # [B, L, V]
                out += [per_value[:, :w].sum(1) for w in self.windows]
            out.append((hit.unsqueeze(2) * weights).sum(1))
            found = match.any(1, keepdim=True)
            newest = row_ages.masked_fill(~match, float("inf")).amin(1, keepdim=True)
            out += [torch.where(found, newest, torch.zeros_like(newest)), found.to(ages.dtype)]
        return torch.log1p(torch.cat(out, dim=1))

    def forward(
        self,
        ids: Dict[str, Tuple[torch.Tensor, Optional[torch.Tensor]]],
        offsets: torch.Tensor,
        mask: torch.Tensor,
        ages: torch.Tensor,
        request_index: torch.Tensor,
    ) -> torch.Tensor:
        """``ids``: the ids by sequence-KJT key (an event key's [N] or bags [N, K], a candidate key's
        [Mc] with their rows); offsets [U + 1] of the events per request; mask, ages [U, L]."""
        L = mask.shape[1]

        def padded(key: str) -> torch.Tensor:  # [N] or [N, K] per event -> [U, L] or [U, L, K]
            per_event = ids[key][0]
            flat = per_event if per_event.dim() == 2 else per_event.unsqueeze(1)
            out = pad_jagged_torch(flat, offsets, L)  # padding: masked out
            return out if per_event.dim() == 2 else out.squeeze(2)

        pairs = [(padded(e), *ids[c]) for e, c in self.pair_keys]
        by = padded(self.by_key) if self.by_key else None
        f = self.features(pairs, mask, ages.to(torch.float32), by, request_index)
        if self.encode is None:
            return f
        lo, hi = self.edges[:-1], self.edges[1:]
        bins = ((f.unsqueeze(2) - lo) / (hi - lo)).clamp(0, 1)  # [B, F, bins]; the last open-ended
        bins = torch.cat([bins[..., :-1], ((f.unsqueeze(2) - lo[-1:]) / (hi[-1:] - lo[-1:])).clamp(min=0)], dim=2)
        return torch.cat([f, self.encode(bins.flatten(1))], dim=1)
