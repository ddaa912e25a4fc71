"""What a sequence encoder of the registry (modules/encoders.py) reads and makes: ``EncoderInputs``
(a group's events, [U, L, W] for U units) in, ``Parts`` (per-unit [U, D_u] and per-row [B, D_r]
tensors) out. Torch types only, for annotations: the registry imports this without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

if TYPE_CHECKING:
    import torch


@dataclass
class EncoderInputs:
    """What an encoder reads. content / x (content + time-delta positions) [U, L, W], mask [U, L],
    deltas [U, L]; tokens: early-interaction tokens [U, X, W] (or None); query [B, Dq] (or None);
    index [B]: the unit of each row; request_index [B]; offsets [U + 1], search (the
    ``retrieval.Search`` fields) and ids (the ids of the entries' ``id_keys``: per key the events'
    ids [N] or bags [N, K] with None, or the candidates' ids [Mc] with the row of each): only for
    the history entries."""

    content: torch.Tensor
    x: torch.Tensor
    mask: torch.Tensor
    deltas: torch.Tensor
    query: Optional[torch.Tensor]
    index: torch.Tensor
    request_index: torch.Tensor
    tokens: Optional[torch.Tensor] = None
    offsets: Optional[torch.Tensor] = None
    search: Optional[Tuple[torch.Tensor, ...]] = None
    ids: Optional[Dict[str, Tuple[torch.Tensor, Optional[torch.Tensor]]]] = None


@dataclass
class Parts:
    unit: List[torch.Tensor] = field(default_factory=list)  # [U, D_u] each
    row: List[torch.Tensor] = field(default_factory=list)  # [B, D_r] each
