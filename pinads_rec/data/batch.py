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
from typing import Dict, List, Optional, Tuple

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

    def __reduce__(self):
        """Crosses a process boundary (from a DataLoader worker) as one buffer. torch would share
        each of the ~20 tensors through its own shared-memory segment, and the trainer would fetch
        each handle from the worker: at 512 rows that costs more than building the batch
        (benchmarks/train_throughput.py, docs/performance.md)."""
        tensors: List[torch.Tensor] = []

        def put(t: Optional[torch.Tensor]) -> Optional[int]:
            if t is None:
                return None
            tensors.append(t)
            return len(tensors) - 1

        spec = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if (
                isinstance(v, KeyedJaggedTensor)
                and not v.variable_stride_per_key()
                and v.inverse_indices_or_none() is None
            ):
                spec[f.name] = (
                    "kjt",
                    v.keys(),
                    put(v.values()),
                    put(v.lengths()),
                    put(v.weights_or_none()),
                    v.stride(),
                )
            elif isinstance(v, KeyedJaggedTensor):  # variable batch per key: torch's own pickling keeps it whole
                spec[f.name] = ("value", v)
            elif isinstance(v, torch.Tensor):
                spec[f.name] = ("tensor", put(v))
            elif isinstance(v, dict):
                spec[f.name] = ("dict", {k: put(t) for k, t in v.items()})
            else:
                spec[f.name] = ("value", v)
        buffer, layout = _pack(tensors)
        return _unpack_batch, (buffer, layout, spec)


_ALIGN = 8  # bytes: every tensor's view into the buffer starts aligned for its dtype


def _pack(tensors: List[torch.Tensor]) -> Tuple[torch.Tensor, List[tuple]]:
    """One uint8 buffer holding every tensor, and (dtype, shape, byte offset) per tensor."""
    chunks, layout, offset = [], [], 0
    for t in tensors:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        layout.append((t.dtype, tuple(t.shape), offset))
        pad = -raw.numel() % _ALIGN
        chunks += [raw, raw.new_zeros(pad)] if pad else [raw]
        offset += raw.numel() + pad
    return (torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)), layout


def _unpack_batch(buffer: torch.Tensor, layout: List[tuple], spec: dict) -> Batch:
    tensors = []
    for dtype, shape, offset in layout:
        n = torch.Size(shape).numel() * dtype.itemsize
        tensors.append(buffer[offset : offset + n].view(dtype).view(shape))
    get = lambda i: None if i is None else tensors[i]  # noqa: E731
    out = {}
    for name, (kind, *args) in spec.items():
        if kind == "kjt":
            keys, values, lengths, weights, stride = args
            out[name] = KeyedJaggedTensor(
                keys=keys, values=get(values), lengths=get(lengths), weights=get(weights), stride=stride
            )
        elif kind == "tensor":
            out[name] = get(args[0])
        elif kind == "dict":
            out[name] = {k: get(i) for k, i in args[0].items()}
        else:
            out[name] = args[0]
    return Batch(**out)
