"""Event representation of one sequence group (sequence-modeling article, "Feature Connection").

An event's attributes (item, action, taxonomy... embeddings; the optional pretrained per-event
embedding) are connected by **sum**: each projected to ``d_model`` and summed, so the event width
is fixed whatever the attributes; or by **concat**: laid side by side, so the event is as wide as
its attributes together. The jagged events are padded to the group's max length (or, with
``pad_to_longest``, only to the batch's longest sequence: no encoder output changes); the
**time-delta position embedding** (bucketized log of request time - event time: position means
"how long ago", not "how many events ago") is kept apart, for the encoders that want it.

In: per attribute [N, D_a] (N events over U units), offsets [U + 1], time deltas [N] seconds,
optional pretrained [N, E]. Out: content [U, L, W], mask [U, L] (True = real event),
time deltas [U, L] (0 at padding).
"""

from typing import List, Optional, Tuple

import torch
from torch import nn

from pinads_rec.modules.encoders import width_of_events
from pinads_rec.modules.jagged import pad_jagged


def time_delta_bucket(seconds: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """floor(log2(1 + seconds)) clamped to [0, num_buckets - 1]; future events fall in bucket 0."""
    return torch.log2(1.0 + seconds.clamp(min=0.0)).floor().long().clamp(max=num_buckets - 1)


class EventRepresentation(nn.Module):
    def __init__(
        self,
        attr_dims: List[int],
        pretrained_dim: int,
        max_length: int,
        combine: str,
        d_model: int,
        time_buckets: int,
        pad_to_longest: bool = False,
    ):
        super().__init__()
        self.combine, self.max_length, self.time_buckets = combine, max_length, time_buckets
        self.pad_to_longest = pad_to_longest
        in_dim = sum(attr_dims) + pretrained_dim
        self.pretrained_dim = pretrained_dim
        # "sum": one Linear over the concatenation is the sum of one projection per attribute.
        self.project = nn.Linear(in_dim, d_model) if combine == "sum" else None
        self.width = width_of_events(attr_dims, pretrained_dim, combine, d_model)
        self.time_embedding = nn.Embedding(time_buckets, self.width)

    def forward(
        self,
        attributes: List[torch.Tensor],
        offsets: torch.Tensor,
        time_deltas: torch.Tensor,
        pretrained: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        parts = list(attributes)
        if self.pretrained_dim:
            parts.append(pretrained)
        event = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        if self.project is not None:
            event = self.project(event)
        lengths = offsets[1:] - offsets[:-1]
        L = self.max_length
        # At least 1: an all-empty batch still has a (masked) slot. Not while exporting: the padded
        # length would be data-dependent, and max_length gives the same outputs.
        if self.pad_to_longest and not torch.compiler.is_exporting():
            L = min(L, max(int(lengths.max()), 1)) if lengths.numel() else 1
        content = pad_jagged(event, offsets, L)  # [U, L, W]
        deltas = pad_jagged(time_deltas.unsqueeze(1), offsets, L).squeeze(2)
        mask = torch.arange(L, device=offsets.device)[None, :] < lengths[:, None]
        return content, mask, deltas

    def positions(self, deltas: torch.Tensor) -> torch.Tensor:
        """Time-delta position embeddings [U, L, W] of padded time deltas [U, L]."""
        return self.time_embedding(time_delta_bucket(deltas, self.time_buckets))
