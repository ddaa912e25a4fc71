"""Streaming Parquet loader: row groups -> shuffled whole requests -> ``Batch``.

- Reads one row group at a time with pyarrow; never the whole dataset.
- Row groups are split across (rank, worker) slots round-robin after a per-epoch shuffle, so every
  row is read exactly once per epoch by exactly one slot.
- A bounded shuffle buffer holds whole requests (all candidates of a request stay together, which
  request-level broadcasting relies on); it holds at most ``shuffle_buffer_rows`` rows plus one
  row group.
- Batches have exactly ``batch_size`` rows: sharded embeddings exchange equal-sized blocks between
  ranks. A slot's last, partial batch is dropped in training (``drop_last``: fewer than batch_size
  rows per worker and epoch) or, in evaluation, padded by repeating a row marked ``valid = False``.
  A request cut by a batch boundary appears in both batches with its own sequence copy.
- ``data.max_unique_users_per_batch`` bounds the requests (unique users) in a batch: a batch that
  reaches it closes early and is padded to ``batch_size`` by repeating its last row marked
  ``valid = False`` (the loss and the metrics skip those rows), so user-side shapes stay bounded.
- ``data.row_filter`` keeps only the rows whose column holds one of the listed values (ad-type
  segmentation), before shuffling; requests left without rows disappear.
- Tensors are built from Arrow buffers (``torch.from_numpy``) or ``torch.empty`` then filled: no
  zero-filled staging allocations (a cost the two-tower article calls out).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pinads_rec.config import ExperimentConfig
from pinads_rec.data.batch import Batch
from pinads_rec.data.contract import ContractError, RowGroupChecker, check_schema, contract_columns
from pinads_rec.features import FeatureLayout


@dataclass(frozen=True)
class RowGroup:
    path: str
    index: int
    num_rows: int

    def __str__(self) -> str:
        return f"{self.path}, row group {self.index}"


def list_files(directory: str) -> List[str]:
    if os.path.isfile(directory):
        return [directory]
    if not os.path.isdir(directory):
        raise ContractError(f"data directory {directory} does not exist")
    files = sorted(glob.glob(os.path.join(directory, "**", "*.parquet"), recursive=True))
    if not files:
        raise ContractError(f"data directory {directory} holds no .parquet files")
    return files


def _open(path: str) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as e:
        raise ContractError(f"{path}: not a readable Parquet file ({e})") from None


def list_row_groups(files: Sequence[str], cfg: ExperimentConfig) -> List[RowGroup]:
    """Opens every file's footer, checks its schema against the contract, lists its row groups."""
    columns = contract_columns(cfg.features)
    groups = []
    for path in files:
        f = _open(path)
        check_schema(path, f.schema_arrow, columns)
        md = f.metadata
        groups += [
            RowGroup(path, i, md.row_group(i).num_rows)
            for i in range(md.num_row_groups)
            if md.row_group(i).num_rows > 0
        ]
    return groups


def select_part(groups: List[RowGroup], part: str, holdout: float, world_size: int, where: str) -> List[RowGroup]:
    """``all`` the row groups, the ``train`` ones, or the calibration ``holdout``: the last
    max(round(holdout x count), 1) in file order (the latest data when files are in time order).
    The split does not depend on the world size, so a run resumed on another one trains on the same rows."""
    if part == "all" or holdout == 0.0:
        return groups
    n = max(round(holdout * len(groups)), 1)
    if n >= len(groups):
        raise ContractError(
            f"{where}: {len(groups)} row group(s) cannot spare {n} for the calibration holdout "
            f"(data.calibration_holdout {holdout}) and still train; lower it or write smaller "
            f"row groups"
        )
    return groups[-n:] if part == "holdout" else groups[:-n]


def assign_row_groups(
    groups: List[RowGroup], slot: int, num_slots: int, seed: int, epoch: int, shuffle: bool
) -> List[RowGroup]:
    """This slot's row groups for the epoch; slots partition the list exactly."""
    order = np.arange(len(groups))
    if shuffle:
        order = np.random.default_rng([seed, epoch]).permutation(len(groups))
    return [groups[i] for i in order[slot::num_slots]]


class ParquetBatches(torch.utils.data.IterableDataset):
    """Iterates the batches of one rank; inside a DataLoader each worker takes its share."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        directory: Optional[str],
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        batch_size: Optional[int] = None,
        drop_last: Optional[bool] = None,
        part: str = "all",
    ):
        super().__init__()
        self.drop_last = shuffle if drop_last is None else drop_last
        self.cfg = cfg
        self.features = cfg.features
        self.layout = FeatureLayout.of(cfg.features)
        self.batch_size = batch_size or cfg.data.batch_size
        self.rank, self.world_size, self.shuffle = rank, world_size, shuffle
        # directory None: no files, only the contract checks and to_batch (in-memory requests, serving)
        files = list_files(directory) if directory is not None else []
        self.row_groups = select_part(
            list_row_groups(files, cfg), part, cfg.data.calibration_holdout, world_size, directory
        )
        self.epoch = 0
        self.columns = [c.name for c in contract_columns(cfg.features)]
        self.checker = RowGroupChecker(cfg.features, cfg.data)
        # Requests (unique users) a batch may hold: the user-side lookups' fixed batch size.
        self.user_slots = min(cfg.data.max_unique_users_per_batch or self.batch_size, self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def num_rows(self) -> int:
        return sum(g.num_rows for g in self.row_groups)

    def my_row_groups(self) -> List[RowGroup]:
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        return assign_row_groups(
            self.row_groups,
            self.rank * workers + worker,
            self.world_size * workers,
            self.cfg.train.seed,
            self.epoch,
            self.shuffle,
        )

    # --- reading ------------------------------------------------------------------------------

    def read(self, group: RowGroup) -> pa.Table:
        try:
            table = _open(group.path).read_row_group(group.index, columns=self.columns)
        except ContractError:
            raise
        except (pa.ArrowException, OSError) as e:
            raise ContractError(f"{group}: cannot be read ({e})") from None
        table = self.checker(table, str(group))
        keep = self.cfg.data.row_filter
        if keep is not None:
            table = table.filter(
                pc.is_in(table.column(keep.column), pa.array(keep.values, table.schema.field(keep.column).type))
            )
        return table

    def __iter__(self) -> Iterator[Batch]:
        info = torch.utils.data.get_worker_info()
        rng = np.random.default_rng([self.cfg.train.seed, self.epoch, self.rank, info.id if info else 0])
        for (table, source), last in self._shuffled_tables(rng):
            valid = table.num_rows
            if valid < self.batch_size:
                if last and self.drop_last:
                    return
                # Repeat the last row: it belongs to the last request, so no request slot is added.
                table = pa.concat_tables([table, table.take(pa.array(np.full(self.batch_size - valid, valid - 1)))])
            yield self.to_batch(table, valid, source)

    def _shuffled_tables(self, rng: np.random.Generator) -> Iterator[tuple]:
        """Yields (Arrow table, is_last) made of whole (or boundary-cut) requests: batch_size rows, or
        fewer when the unique-user bound closed it early or it is the slot's last."""
        max_requests = self.user_slots if self.cfg.model.broadcast else self.batch_size
        buffer_rows = max(self.cfg.data.shuffle_buffer_rows, self.batch_size) if self.shuffle else 0
        pool: List[tuple] = []  # (table, start, length, row group) per request
        pool_rows = 0
        pending: List[tuple] = []  # requests already drawn, not yet emitted
        pending_rows = 0

        def drain(until_rows: int) -> Iterator[pa.Table]:
            """Emits requests off the front of the (shuffled) pool until at most until_rows remain."""
            nonlocal pool, pool_rows, pending, pending_rows
            if self.shuffle:
                pool = [pool[i] for i in rng.permutation(len(pool))]
            sizes = np.cumsum([req[2] for req in pool])
            k = int(np.searchsorted(sizes, pool_rows - until_rows)) + 1 if pool_rows > until_rows else 0
            drawn, pool = pool[:k], _compact(pool[k:])
            pool_rows -= int(sizes[k - 1]) if k else 0
            for req in drawn:
                pending.append(req)
                pending_rows += req[2]
                while pending_rows >= self.batch_size or len(pending) >= max_requests:
                    out, pending, pending_rows = _cut(pending, self.batch_size, max_requests)
                    yield out, False

        for group in self.my_row_groups():
            table = self.read(group)
            if not table.num_rows:  # everything filtered out
                continue
            pool += [(table, s, n, group) for s, n in _requests(table, self.features.columns.request_id, group)]
            pool_rows += table.num_rows
            if pool_rows > buffer_rows:
                yield from drain(buffer_rows // 2)
        yield from drain(0)
        if pending_rows:
            yield _cut(pending, pending_rows, max_requests)[0], True

    # --- Arrow -> tensors ---------------------------------------------------------------------

    def to_batch(self, table: pa.Table, num_valid: Optional[int] = None, source: str = "") -> Batch:
        f = self.features
        req = table.column(f.columns.request_id).to_numpy()
        # Without broadcasting every row is its own request slot: user-side work is done per row.
        is_first = (
            np.concatenate([[True], req[1:] != req[:-1]]) if self.cfg.model.broadcast else np.ones(len(req), bool)
        )
        starts = np.flatnonzero(is_first)
        request_index = torch.from_numpy(np.cumsum(is_first) - 1)
        first_rows = table.take(pa.array(starts))
        B = table.num_rows

        layout = self.layout
        dense = torch.empty(B, layout.dense_dim, dtype=torch.float32)
        dense_np, at = dense.numpy(), 0  # filled in place through a numpy view: one copy from Arrow
        for d in f.dense:
            col = table.column(d.column).combine_chunks()
            values = (col.flatten() if d.dim > 1 else col).to_numpy(zero_copy_only=False)
            dense_np[:, at : at + d.dim] = values.reshape(B, d.dim)
            at += d.dim

        sparse = _kjt(layout.row_keys, [table.column(c) for c in layout.columns(layout.row_keys)], B)
        # A fixed number of user slots (the unused ones empty): pooled embedding lookups exchange
        # equal-sized blocks between ranks, so their batch size must not vary.
        user_sparse = _kjt(
            layout.user_keys,
            [first_rows.column(c) for c in layout.columns(layout.user_keys)],
            self.user_slots if self.cfg.model.broadcast else B,
        )
        seq_cols = [first_rows.column(sf.column) for g in f.sequence_groups for sf in g.features]
        # Candidate ids sharing a sequence table: per request, the ids of its rows (in row order).
        seq_cols += [
            pa.ListArray.from_arrays(pa.array(np.append(starts, B).astype(np.int32)), table.column(c).combine_chunks())
            for c in layout.columns(layout.shared_keys)
        ]
        sequences = _kjt(layout.sequence_keys, seq_cols, len(starts))

        request_time = first_rows.column(f.columns.timestamp).to_numpy().astype(np.float64)
        deltas, embeddings = {}, {}
        for g in f.sequence_groups:
            ts = first_rows.column(g.timestamp_column).combine_chunks()
            lengths = pc.list_value_length(ts).to_numpy(zero_copy_only=False)
            event_time = ts.flatten().to_numpy(zero_copy_only=False)
            deltas[g.name] = torch.from_numpy((np.repeat(request_time, lengths) - event_time).astype(np.float32))
            if g.embedding_column:
                emb = first_rows.column(g.embedding_column).combine_chunks().flatten().flatten()
                emb = emb.to_numpy(zero_copy_only=False).reshape(-1, g.embedding_dim)
                embeddings[g.name] = torch.empty(emb.shape, dtype=torch.float32)
                embeddings[g.name].numpy()[:] = emb

        labels = _stack(table, [t.label_column for t in f.tasks])
        oracle = [t.true_probability_column for t in f.tasks]
        true_probs = _stack(table, oracle) if all(oracle) else None
        surface = torch.from_numpy(table.column(f.columns.surface).to_numpy().astype(np.int64))
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
            request_index=request_index,
            surface=surface,
            labels=labels,
            valid=valid,
            true_probs=true_probs,
            source=source,
        )


def _requests(table: pa.Table, request_column: str, where: RowGroup) -> List[tuple]:
    """(start, length) of each request: the contract wants a request's rows contiguous."""
    req = table.column(request_column).to_numpy()
    starts = np.flatnonzero(np.concatenate([[True], req[1:] != req[:-1]]))
    if len(starts) != len(np.unique(req)):
        raise ContractError(
            f"{where}, column {request_column!r}: the rows of a request are not contiguous "
            f"(request-level broadcasting needs them together); sort the file by request"
        )
    lengths = np.diff(np.append(starts, len(req)))
    return list(zip(starts.tolist(), lengths.tolist()))


def _compact(pool: List[tuple]) -> List[tuple]:
    """Copies the requests still waiting into fresh tables, so a row group is freed as soon as it
    is drained instead of living until its last request is drawn (keeps memory at the buffer size)."""
    by_table: Dict[int, list] = {}
    for table, start, n, group in pool:
        by_table.setdefault(id(table), [table, []])[1].append((start, n, group))
    out = []
    for table, reqs in by_table.values():
        if sum(n for _, n, _ in reqs) == table.num_rows:  # untouched: nothing to free
            out += [(table, start, n, group) for start, n, group in reqs]
            continue
        kept = table.take(pa.array(np.concatenate([np.arange(s, s + n) for s, n, _ in reqs])))
        at = 0
        for _, n, group in reqs:
            out.append((kept, at, n, group))
            at += n
    return out


def _cut(pending: List[tuple], rows: int, max_requests: int):
    """Takes up to ``rows`` rows of at most ``max_requests`` requests off the front of the drawn
    requests; returns ((table, source), rest, rest_rows), source naming the row groups it came from."""
    pieces, taken, rest, groups = [], 0, [], {}
    for i, (table, start, n, group) in enumerate(pending):
        if taken == rows or i == max_requests:
            rest = pending[i:]
            break
        k = min(n, rows - taken)
        pieces.append((table, start, k))
        groups[group] = None
        if k < n:  # a request cut at the batch boundary: the rest opens the next batch
            rest = [(table, start + k, n - k, group)] + pending[i + 1 :]
        taken += k
        if k < n:
            break
    # Group the pieces by source table so each table is gathered once (rows of a request stay contiguous).
    by_table: Dict[int, list] = {}
    for table, start, k in pieces:
        by_table.setdefault(id(table), [table, []])[1].append(np.arange(start, start + k))
    out = pa.concat_tables([t.take(pa.array(np.concatenate(idx))) for t, idx in by_table.values()])
    return (out, "; ".join(map(str, groups))), rest, sum(req[2] for req in rest)


def _kjt(keys: List[str], columns: List[pa.ChunkedArray], stride: int) -> KeyedJaggedTensor:
    """One KJT of the columns; slots past a column's length are empty (padding to a fixed stride)."""
    values, lengths = [], []
    for col in columns:
        col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        if pa.types.is_integer(col.type):
            values.append(col.to_numpy(zero_copy_only=False))
            lengths.append(np.ones(len(col), np.int32))
        else:
            values.append(col.flatten().to_numpy(zero_copy_only=False))
            lengths.append(pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int32))
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


def _stack(table: pa.Table, names: List[str]) -> torch.Tensor:
    out = torch.empty(table.num_rows, len(names), dtype=torch.float32)
    view = out.numpy()
    for j, name in enumerate(names):
        view[:, j] = table.column(name).to_numpy()
    return out


def make_loader(
    cfg: ExperimentConfig,
    directory: str,
    rank: int = 0,
    world_size: int = 1,
    shuffle: bool = True,
    num_workers: Optional[int] = None,
    epoch: int = 0,
    pin_memory: bool = False,
    part: str = "all",
    prefetch_factor: int = 4,
) -> torch.utils.data.DataLoader:
    """A DataLoader over this rank's batches; workers read disjoint row groups in parallel, each
    keeping ``prefetch_factor`` batches ready."""
    dataset = ParquetBatches(cfg, directory, rank, world_size, shuffle, part=part)
    dataset.set_epoch(epoch)
    workers = cfg.data.num_workers if num_workers is None else num_workers
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=None,
        num_workers=workers,
        pin_memory=pin_memory,
        persistent_workers=False,
        prefetch_factor=prefetch_factor if workers else None,
        worker_init_fn=_one_thread if workers else None,
    )


def _one_thread(worker_id: int) -> None:
    """Loader workers share the host's cores with the trainer: one torch thread each. (A module-level
    function, so workers also start under spawn/forkserver.)"""
    torch.set_num_threads(1)
