"""Early feature interaction (sequence-modeling article, "More Feature Interaction"): the sequence
meets the user and the candidate before it is pooled, not after.

- cosine: the cosine similarity between each event and a representation (the candidate's and/or
  the user's, each projected to the event width) becomes an event attribute (projected and added);
- tokens: the representations, projected to the event width, join the Transformer's
  self-attention as extra tokens.

A candidate-dependent sequence can no longer be encoded once per request: the sequence arch runs
such a group per candidate row (``GroupEncoder.per_candidate``), at that cost.

In: events [N, L, W], mask [N, L], representations {name: [N, D_name]} per unit. Out: events
[N, L, W] with the cosine attributes added, extra tokens [N, X, W] or None.
"""

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn


class EarlyInteraction(nn.Module):
    def __init__(self, width: int, dims: Dict[str, int], cosine: List[str], tokens: List[str]):
        super().__init__()
        self.cosine_of, self.tokens_of = list(cosine), list(tokens)
        self.cosine_projections = nn.ModuleDict({n: nn.Linear(dims[n], width) for n in cosine})
        self.cosine_attributes = nn.Linear(len(cosine), width) if cosine else None
        self.token_projections = nn.ModuleDict({n: nn.Linear(dims[n], width) for n in tokens})

    def forward(
        self, events: torch.Tensor, mask: torch.Tensor, representations: Dict[str, torch.Tensor]
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if self.cosine_attributes is not None:
            unit = F.normalize(events, dim=-1)
            cos = torch.stack(
                [
                    torch.bmm(
                        unit, F.normalize(self.cosine_projections[n](representations[n]), dim=-1).unsqueeze(2)
                    ).squeeze(2)
                    for n in self.cosine_of
                ],
                dim=-1,
            )  # [N, L, n]
            events = events + self.cosine_attributes(cos) * mask.unsqueeze(-1).to(events.dtype)
        tokens = None
        if self.tokens_of:
            tokens = torch.stack([self.token_projections[n](representations[n]) for n in self.tokens_of], dim=1)
        return events, tokens
