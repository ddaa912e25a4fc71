"""The training batch: what the loader yields and the model consumes.

Rows are ad impressions (B of them). Sequence features are per *unique request* (U <= B of them):
all candidates of a request share the user's history, so it is carried once and broadcast to the
rows by ``request_index`` (request-level broadcasting, unified-surfaces article).
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
    sparse: KeyedJaggedTensor  # pooled categorical features, stride B
    sequences: KeyedJaggedTensor  # "<group>.<feature>" id sequences, stride U, newest first
    sequence_time_deltas: Dict[str, torch.Tensor]  # group -> [events] float32 seconds before the request
    sequence_embeddings: Dict[str, torch.Tensor]  # group -> [events, E] pretrained per-event embedding
    request_index: torch.Tensor  # [B] int64: row -> its request's slot in [0, U)
    surface: torch.Tensor  # [B] int64 index into features.surfaces
    labels: torch.Tensor  # [B, T] float32
    valid: torch.Tensor  # [B] bool: False for rows that only pad the last batch to full size
    true_probs: Optional[torch.Tensor] = None  # [B, T] float32 when the data carries them (synthetic)

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
            elif v is not None:
                out[f.name] = fn(v)
            else:
                out[f.name] = None
        return Batch(**out)

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        return self._map(lambda t: t.to(device=device, non_blocking=non_blocking))

    def record_stream(self, stream) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            for t in v.values() if isinstance(v, dict) else [v]:
                if t is not None:
                    t.record_stream(stream)

    def pin_memory(self) -> "Batch":
        return self._map(lambda t: t.pin_memory())
