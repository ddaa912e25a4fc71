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

Each feature is log1p'd and scaled into [0, 1] (by the log1p of its largest value), then
encoded: the value itself and a learned map of its piecewise-linear bins (Gorishniy et al. 2022;
equal bins of the log1p scale, so one count more moves further where counts are small), both into
the cross network.

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

# Seconds a "since the newest match" saturates at: a year.
SINCE_CAP_S = 365 * 86400.0


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
        bins: int = 8,
    ):
        """``pair_keys``: per pair, the sequence-KJT keys of the event attribute and the candidate
        feature; ``by_key``: the key of the attribute whose values split the counts (or None);
        ``longest``: the group's max_length; ``dim``: the learned encoding's width (0: none) over
        ``bins`` piecewise-linear bins of each feature."""
        super().__init__()
        self.pair_keys = [tuple(p) for p in pair_keys]
        self.by_key = by_key
        self.windows = [w if w > 0 else longest for w in windows]
        self.register_buffer("half_lives", torch.tensor(list(half_lives_s), dtype=torch.float32), persistent=False)
        self.register_buffer("by_values", torch.tensor(list(by_values), dtype=torch.long), persistent=False)
        per_pair = len(self.windows) * (1 + (len(by_values) if by_key else 0)) + len(half_lives_s) + 2
        self.num_features = len(self.pair_keys) * per_pair  # + 2: since the newest match, whether one
        self.window_scales = [math.log1p(w) for w in self.windows]  # log1p of each window's most
        self.sum_scale = math.log1p(longest)
        self.register_buffer("bin_starts", torch.arange(bins, dtype=torch.float32), persistent=False)
        self.encode = nn.Linear(self.num_features * bins, dim) if dim else None
        self.output_dim = self.num_features + dim

    def features(
        self,
        pairs: List[Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]],
        mask: torch.Tensor,
        ages: torch.Tensor,
        by: Optional[torch.Tensor],
        request_index: torch.Tensor,
    ) -> torch.Tensor:
        """The features [B, num_features], each in [0, 1], pair by pair: per window log1p(count) /
        log1p(window), then per window the same of each ``by`` value's count, then per half-life
        log1p(the recency-weighted sum) / log1p(max_length), log1p(seconds since the newest match)
        / log1p(a year) (0 without one), and whether there is one. In [0, 1] because the cross
        network multiplies its inputs: a raw count or log-seconds near 15 drove the logits past
        1e4 and the training to a constant model (the demo, seed 0). ``pairs``: per pair, the event
        ids [U, L] (or bags [U, L, K]), the candidate ids and their rows (``retrieval.matches``)."""
        row_ages = ages.index_select(0, request_index).clamp(min=0)  # [B, L]
        weights = torch.exp2(-row_ages.unsqueeze(2) / self.half_lives)  # [B, L, H]
        row_by = (by.index_select(0, request_index).unsqueeze(2) == self.by_values) if by is not None else None
        out = []
        for event_ids, candidate_ids, candidate_rows in pairs:
            match = matches(event_ids, mask, candidate_ids, request_index, candidate_rows)  # [B, L], newest first
            hit = match.to(ages.dtype)
            out += [torch.log1p(hit[:, :w].sum(1, keepdim=True)) / z for w, z in zip(self.windows, self.window_scales)]
            if row_by is not None:
                per_value = hit.unsqueeze(2) * row_by  # [B, L, V]
                out += [torch.log1p(per_value[:, :w].sum(1)) / z for w, z in zip(self.windows, self.window_scales)]
            out.append(torch.log1p((hit.unsqueeze(2) * weights).sum(1)) / self.sum_scale)
            found = match.any(1, keepdim=True)
            newest = row_ages.masked_fill(~match, float("inf")).amin(1, keepdim=True).clamp(max=SINCE_CAP_S)
            since = torch.log1p(torch.where(found, newest, torch.zeros_like(newest))) / math.log1p(SINCE_CAP_S)
            out += [since, found.to(ages.dtype)]
        return torch.cat(out, dim=1)

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
        # Piecewise-linear bins of [0, 1]: bin j is 0 below its interval, 1 above, linear within.
        bins = (f.unsqueeze(2) * len(self.bin_starts) - self.bin_starts).clamp(0, 1)
        return torch.cat([f, self.encode(bins.flatten(1))], dim=1)
