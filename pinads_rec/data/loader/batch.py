"""The training batch: what the loader yields and the model consumes, and ``BatchBuilder``, which
makes one from Arrow rows.

Rows are ad impressions (B of them). User-side features -- the sequences and the pooled user
features -- are per *unique request* (U <= B of them): all candidates of a request share the user's
history, so it is carried and computed once and broadcast to the rows by ``request_index``
(request-level broadcasting, unified-surfaces article). With ``model.broadcast: false`` the builder
makes every row its own request slot (U = B, ``request_index = arange(B)``): same model, same
outputs, the user-side work repeated per candidate.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from pinads_rec import config
from pinads_rec.data.loader.contract import checked_columns, contract_columns
from pinads_rec.data.loader.storage_layout import Requests, request_starts
from pinads_rec.features import FeatureLayout
from pinads_rec.managed_collision import spread_ids


@dataclass
class Batch(Pipelineable):
    dense: torch.Tensor  # [B, D_dense] float32, raw (normalized inside the model)
    sparse: KeyedJaggedTensor  # pooled candidate-side categorical features, stride B
    # pooled user-side categorical features, once per request: stride S >= U (the loader's fixed
    # number of user slots, data.max_unique_users_per_batch; slots past U are empty)
    user_sparse: KeyedJaggedTensor
    # the EmbeddingCollection's keys (FeatureLayout.sequence_keys), stride U: "<group>.<feature>" id
    # sequences, newest first, then "candidate.<name>": the ids of the request's rows, in row order
    sequences: KeyedJaggedTensor
    sequence_time_deltas: Dict[str, torch.Tensor]  # group -> [events] float32 seconds before the request
    sequence_embeddings: Dict[str, torch.Tensor]  # group -> [events, E] pretrained per-event embedding
    # bag key of the sequence KJT (FeatureLayout.bag_keys) -> [events] int64 ids per event (a
    # multi-valued attribute), or [B] ids per row (a candidate key); the KJT's lengths count ids
    sequence_bag_sizes: Dict[str, torch.Tensor]
    request_index: torch.Tensor  # [B] int64: row -> its request's slot in [0, U)
    surface: torch.Tensor  # [B] int64 index into features.surfaces
    labels: torch.Tensor  # [B, T] float32
    valid: torch.Tensor  # [B] bool: False for rows that only pad the last batch to full size
    true_probs: Optional[torch.Tensor] = None  # [B, T] float32 when the data carries them (synthetic)
    # [B] int64 each row's user (features.columns.user_id, as checked) when the config reads that
    # column (a feature uses it): the per-user metrics (GAUC) group by it; the model never reads it
    user_id: Optional[torch.Tensor] = None
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


# --------------------------------------------------------------------------------------------
# Requests -> Batch.
# --------------------------------------------------------------------------------------------


class BatchBuilder:
    """Checked requests (data/loader/reader.py) -> ``Batch``: ``build_requests`` from ``Requests`` (the
    request-level columns once per request, as the loader holds them), ``build`` from a per-row table.

    ``user_slots``: the stride of ``user_sparse`` with broadcasting (pooled user-side lookups
    exchange equal-sized blocks between ranks, so it is fixed; slots past the batch's requests are
    empty). ``broadcast`` False: every row is its own request slot.

    Tensors are built from Arrow buffers (``torch.from_numpy``) or ``torch.empty`` then filled: no
    zero-filled staging allocations (a cost the two-tower article calls out). ``zero_fill`` True
    allocates them with ``torch.zeros`` instead -- the same batches, for benchmarks/train_throughput.py
    to measure what that costs.

    ``id_dropout``: table -> rate. Given a generator (``build_requests``' ``rng``: training batches),
    each id of such a table -- pooled, user-side, sequence and candidate keys alike -- is replaced by
    0 with that probability: the out-of-vocabulary row of a vocabulary-mapped table is then trained
    (build.vocabularies[].dropout; docs/data_build.md, "Cold start")."""

    def __init__(
        self,
        layout: FeatureLayout,
        user_slots: int,
        broadcast: bool = True,
        zero_fill: bool = False,
        id_dropout: Optional[Mapping[str, float]] = None,
    ):
        self.layout, self.user_slots, self.broadcast = layout, user_slots, broadcast
        self.zero_fill = zero_fill
        # The checked columns of each KJT, resolved once (not per batch): a column feeding several
        # features may hold each one's ids in a column of its own (contract.Column.column_for).
        f = layout.features
        names = checked_columns(contract_columns(f))
        self.row_columns = [names["sparse", k] for k in layout.row_keys]
        self.user_columns = [names["sparse", k] for k in layout.user_keys]
        self.event_columns = [names["sequence", g.name, sf.name] for g in f.sequence_groups for sf in g.features]
        self.shared_columns = [names["sparse", k] for k in layout.shared_keys]
        self.timestamp_columns = {g.name: names["timestamp", g.name] for g in f.sequence_groups}
        self.embedding_columns = {g.name: names["embedding", g.name] for g in f.sequence_groups if g.embedding_column}
        self.user_id_column = user_id_column(f)
        self.spread = set(layout.managed_keys())  # raw ids, spread over the managed modules' input range
        # Every KJT key whose ids come from a table with a dropout rate, and its rate.
        key_tables = {s.name: s.table for s in f.sparse}
        key_tables.update((config.CANDIDATE_PREFIX + k, key_tables[k]) for k in layout.shared_keys)
        key_tables.update((f"{g.name}.{sf.name}", sf.table) for g in f.sequence_groups for sf in g.features)
        rates = id_dropout or {}
        self.drop = {k: rates[t] for k, t in key_tables.items() if rates.get(t, 0.0) > 0.0}

    def build(self, table: pa.Table, source: str = "", pad_to: Optional[int] = None) -> Batch:
        """The batch of ``table``'s rows (one per candidate, a request's rows contiguous; its
        request-level values are read from its first row). ``pad_to``: as ``build_requests``."""
        starts = request_starts(table.column(self.layout.features.columns.request_id).to_numpy())
        block = Requests(pa.table({}), table, np.append(starts, table.num_rows).astype(np.int64))
        return self.build_requests(block, source, pad_to)

    def build_requests(
        self, block: Requests, source: str = "", pad_to: Optional[int] = None, rng: Optional[np.random.Generator] = None
    ) -> Batch:
        """The batch of ``block``'s candidates; ``rng`` draws the id dropout (none without it).
        ``pad_to``: fewer rows are padded to this many by
        repeating the last row marked ``valid = False`` (it belongs to the last request, so no request
        slot is added: the user slots of the sharded lookups stay within their fixed number). That
        request may then hold most of the batch's rows (a batch closed early by
        ``max_unique_users_per_batch``, an epoch's last): the candidate attentions cut it into blocks
        of at most B // U rows when it is large (modules/target_attention.py), so its padding costs what
        as many real rows would, never rows x requests."""
        valid = block.num_rows
        num_valid = None
        if pad_to is not None and valid < pad_to:
            rows = pa.concat_tables([block.rows, block.rows.take(pa.array(np.full(pad_to - valid, valid - 1)))])
            offsets = block.offsets.copy()
            offsets[-1] = pad_to
            block, num_valid = Requests(block.request_table, rows, offsets), valid
        if not self.broadcast:  # every row its own request slot: user-side work done per row
            requests = block.request_table
            if requests.num_columns:
                requests = requests.take(pa.array(block.request_of_rows()))
            block = Requests(requests, block.rows, np.arange(block.num_rows + 1, dtype=np.int64))
        return self._build(block, num_valid, source, rng)

    def _build(self, block: Requests, num_valid: Optional[int], source: str, rng=None) -> Batch:
        layout = self.layout
        f = layout.features
        B, U = block.num_rows, block.num_requests
        request_index = torch.from_numpy(block.request_of_rows())
        new = torch.zeros if self.zero_fill else torch.empty  # every tensor below is written whole

        dense = new(B, layout.dense_dim, dtype=torch.float32)
        dense_np, at = dense.numpy(), 0  # filled in place through a numpy view: one copy from Arrow
        for d in f.dense:
            col = block.row_column(d.column)
            values = (col.flatten() if d.dim > 1 else col).to_numpy(zero_copy_only=False)
            dense_np[:, at : at + d.dim] = values.reshape(B, d.dim)
            at += d.dim

        drop = (self.drop, rng) if rng is not None and self.drop else None
        sparse = _kjt(layout.row_keys, [block.row_column(c) for c in self.row_columns], B, self.spread, drop)
        # A fixed number of user slots (the unused ones empty): pooled embedding lookups exchange
        # equal-sized blocks between ranks, so their batch size must not vary.
        user_sparse = _kjt(
            layout.user_keys,
            [block.request_column(c) for c in self.user_columns],
            self.user_slots if self.broadcast else B,
            self.spread,
            drop,
        )
        seq_cols = [block.request_column(c) for c in self.event_columns]
        # Candidate ids sharing a sequence table: per request, the ids of its rows (in row order).
        offsets = pa.array(block.offsets.astype(np.int32))
        seq_cols += [pa.ListArray.from_arrays(offsets, block.row_column(c)) for c in self.shared_columns]
        sequences = _kjt(layout.sequence_keys, seq_cols, U, self.spread, drop)
        bag_sizes = {}
        for key in layout.bag_keys:
            column = seq_cols[layout.sequence_keys.index(key)]
            bags = column.flatten()  # per event (per row, for a candidate key): its id or its ids
            if pa.types.is_integer(bags.type):
                bag_sizes[key] = torch.ones(len(bags), dtype=torch.int64)
            else:
                sizes = pc.list_value_length(bags).to_numpy(zero_copy_only=False)
                bag_sizes[key] = torch.from_numpy(sizes.astype(np.int64))

        request_time = block.request_column(f.columns.timestamp).to_numpy().astype(np.float64)
        deltas, embeddings = {}, {}
        for g in f.sequence_groups:
            ts = block.request_column(self.timestamp_columns[g.name])
            lengths = pc.list_value_length(ts).to_numpy(zero_copy_only=False)
            event_time = ts.flatten().to_numpy(zero_copy_only=False)
            deltas[g.name] = torch.from_numpy((np.repeat(request_time, lengths) - event_time).astype(np.float32))
            if g.embedding_column:
                emb = block.request_column(self.embedding_columns[g.name]).flatten().flatten()
                emb = emb.to_numpy(zero_copy_only=False).reshape(-1, g.embedding_dim)
                embeddings[g.name] = new(emb.shape, dtype=torch.float32)
                embeddings[g.name].numpy()[:] = emb

        labels = _stack(block, [t.label_column for t in f.tasks], new)
        oracle = [t.true_probability_column for t in f.tasks]
        true_probs = _stack(block, oracle, new) if all(oracle) else None
        surface = torch.from_numpy(block.row_column(f.columns.surface).to_numpy().astype(np.int64))
        user_id = None
        if self.user_id_column is not None:
            user_id = torch.from_numpy(block.row_column(self.user_id_column).to_numpy().astype(np.int64))
        valid = torch.ones(B, dtype=torch.bool)
        if num_valid is not None:
            valid[num_valid:] = False
        return Batch(
            dense=dense,
            sparse=sparse,
            user_sparse=user_sparse,
            sequences=sequences,
            sequence_time_deltas=deltas,
            sequence_embeddings=embeddings,
            sequence_bag_sizes=bag_sizes,
            request_index=request_index,
            surface=surface,
            labels=labels,
            valid=valid,
            true_probs=true_probs,
            user_id=user_id,
            source=source,
        )


def user_id_column(features) -> Optional[str]:
    """The checked column holding ``features.columns.user_id``'s ids when the config reads it (a
    single-id feature uses it), else None: the batches then carry no user ids."""
    for c in contract_columns(features):
        if c.name == features.columns.user_id:
            names = checked_columns([c])
            return next((names[u.key] for u in c.uses if u.key[0] == "sparse"), None)
    return None


def _kjt(
    keys: List[str],
    columns: List[pa.ChunkedArray],
    stride: int,
    spread=frozenset(),
    drop: Optional[Tuple[Dict[str, float], np.random.Generator]] = None,
) -> KeyedJaggedTensor:
    """One KJT of the columns; slots past a column's length are empty (padding to a fixed stride).
    The keys in ``spread`` are a managed-collision table's: their ids go through ``spread_ids``.
    ``drop``: (key -> rate, generator): each id of such a key becomes 0 with that probability."""
    values, lengths = [], []
    for key, col in zip(keys, columns):
        col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        if pa.types.is_integer(col.type):
            values.append(col.to_numpy(zero_copy_only=False))
            lengths.append(np.ones(len(col), np.int32))
        else:
            counts = pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)
            flat = col.flatten()
            if not pa.types.is_integer(flat.type):  # bags (a list per event, per row): count their ids
                inner = pc.list_value_length(flat).to_numpy(zero_copy_only=False).astype(np.int64)
                starts = np.concatenate([[0], np.cumsum(inner)])  # per event, where its ids start
                counts = np.diff(starts[np.concatenate([[0], np.cumsum(counts)])])
                flat = flat.flatten()
            values.append(flat.to_numpy(zero_copy_only=False))
            lengths.append(counts.astype(np.int32))
        if drop is not None and key in drop[0]:
            values[-1] = np.where(drop[1].random(len(values[-1])) < drop[0][key], 0, values[-1])
        if key in spread:
            values[-1] = spread_ids(values[-1])
        lengths.append(np.zeros(stride - len(col), np.int32))
    if not keys:  # e.g. a model without sequence groups
        return KeyedJaggedTensor(
            keys=[], values=torch.empty(0, dtype=torch.int64), lengths=torch.empty(0, dtype=torch.int32), stride=stride
        )
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.from_numpy(np.concatenate(values).astype(np.int64, copy=False)),
        lengths=torch.from_numpy(np.concatenate(lengths)),
        stride=stride,
    )


def _stack(block: Requests, names: List[str], new=torch.empty) -> torch.Tensor:
    out = new(block.num_rows, len(names), dtype=torch.float32)
    view = out.numpy()
    for j, name in enumerate(names):
        view[:, j] = block.row_column(name).to_numpy()
    return out
