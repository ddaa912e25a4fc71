"""The training batch: what the loader yields and the model consumes.

Rows are ad impressions (B of them). User-side features -- the sequences and the pooled user
features -- are per *unique request* (U <= B of them): all candidates of a request share the user's
history, so it is carried and computed once and broadcast to the rows by ``request_index``
(request-level broadcasting, unified-surfaces article). With ``model.broadcast: false`` the loader
makes every row its own request slot (U = B, ``request_index = arange(B)``): same model, same
outputs, the user-side work repeated per candidate.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Dict, Optional

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable


@dataclass
class Batch(Pipelineable):
    dense: torch.Tensor  # [B, D_dense] float32, raw (normalized inside the model)
    sparse: KeyedJaggedTensor  # pooled candidate-side categorical features, stride B
    # pooled user-side categorical features, once per request: stride S >= U (the loader's fixed
    # number of user slots, data.max_unique_users_per_batch; slots past U are empty)
    user_sparse: KeyedJaggedTensor
    sequences: KeyedJaggedTensor  # "<group>.<feature>" id sequences, stride U, newest first
    sequence_time_deltas: Dict[str, torch.Tensor]  # group -> [events] float32 seconds before the request
    sequence_embeddings: Dict[str, torch.Tensor]  # group -> [events, E] pretrained per-event embedding
    request_index: torch.Tensor  # [B] int64: row -> its request's slot in [0, U)
    surface: torch.Tensor  # [B] int64 index into features.surfaces
    labels: torch.Tensor  # [B, T] float32
    valid: torch.Tensor  # [B] bool: False for rows that only pad the last batch to full size
    true_probs: Optional[torch.Tensor] = None  # [B, T] float32 when the data carries them (synthetic)
    source: str = ""  # the row groups the rows came from (named in errors about this batch)

    @property
    def batch_size(self) -> int:
        return self.labels.shape[0]

    @property
    def num_requests(self) -> int:
        return self.sequences.stride()

    def _map(self, fn) -> "Batch":
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, dict):
                out[f.name] = {k: fn(t) for k, t in v.items()}
            elif isinstance(v, (torch.Tensor, KeyedJaggedTensor)):
                out[f.name] = fn(v)
            else:
                out[f.name] = v
        return Batch(**out)

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        return self._map(lambda t: t.to(device=device, non_blocking=non_blocking))

    def record_stream(self, stream) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            for t in v.values() if isinstance(v, dict) else [v]:
                if isinstance(t, (torch.Tensor, KeyedJaggedTensor)):
                    t.record_stream(stream)

    def pin_memory(self) -> "Batch":
        return self._map(lambda t: t.pin_memory())
