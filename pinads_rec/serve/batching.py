"""Rows -> ``Batch`` for inference, with the loader's contract checks and ``BatchBuilder``.

- ``RequestBatcher``: one in-memory request (an Arrow table of its N candidate rows, or its one row
  of the per-request layout; labels optional) -> a Batch with one user slot (U = 1), so the
  user-side work runs once for all N.
- ``ScoringBatches``: every candidate of a Parquet file or directory (either layout) in file order,
  nothing shuffled or dropped -> (request and item ids as read, one row per candidate; Batch) pairs,
  so predictions join back to the input.
- ``file_order_batches``: the loader's ``ParquetBatches`` over a directory the same way (file
  order, nothing dropped), for callers that need batches only (export's example, the ad table).

None of them applies ``data.max_unique_users_per_batch`` (see ``unbounded_users``).
"""

from __future__ import annotations

import dataclasses
from typing import Collection, Iterator, Optional, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pinads_rec import config
from pinads_rec.data.loader.batch import Batch, BatchBuilder
from pinads_rec.data.loader.contract import ContractError, check_schema, contract_columns
from pinads_rec.data.loader.dataset import LoaderSettings, ParquetBatches
from pinads_rec.data.loader.reader import AS_READ_PREFIX, RowGroupReader, list_files, list_row_groups
from pinads_rec.data.loader.row_group_checker import RowGroupChecker
from pinads_rec.data.loader.shuffle import ShufflePool, read_requests
from pinads_rec.data.loader.storage_layout import is_per_request, stored_request_level
from pinads_rec.features import FeatureLayout


def unbounded_users(cfg: config.ExperimentConfig) -> config.ExperimentConfig:
    """The config for batching files at inference: no ``data.max_unique_users_per_batch``. The bound
    keeps the sharded user-side lookups' batch size fixed in training; unsharded, it would only close
    batches early and pad them with copies of the last request's row: rows computed for nothing (the
    candidate attentions bound their cost per row, modules/target_attention.py)."""
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_unique_users_per_batch=0))


class RequestBatcher:
    """The loader's contract checks and ``BatchBuilder`` for in-memory requests of one user each: one
    user slot, U = 1 per request."""

    def __init__(self, cfg: config.ExperimentConfig):
        self.cfg = cfg
        self.columns = contract_columns(cfg.features)
        self.checker = RowGroupChecker(cfg.features, cfg.data)
        self.builder = BatchBuilder(FeatureLayout.of(cfg.features), user_slots=1, broadcast=cfg.model.broadcast)

    def batch(self, request: pa.Table, where: str) -> Batch:
        """One request's batch: ``request`` holds its candidate rows (per-row layout) or is one row of
        the per-request layout (data/loader/storage_layout.py)."""
        f = self.cfg.features
        if request.num_rows == 0:
            raise ContractError(f"{where}: no rows to score")
        per_request = is_per_request(request.schema, f)
        if per_request and request.num_rows != 1:
            raise ContractError(f"{where}: score_request takes one request, got {request.num_rows} per-request rows")
        if not per_request and f.columns.request_id in request.column_names:
            ids = len(pc.unique(request.column(f.columns.request_id)))
            if ids != 1:
                raise ContractError(f"{where}: score_request takes the rows of one request, got {ids} request ids")
        # A per-request row is split as its writer stored it (data/loader/storage_layout.py).
        stored = stored_request_level(request.schema, f) if per_request else None
        table = _with_label_columns(request, self.cfg, stored)
        check_schema(where, table.schema, self.columns, per_request, stored)
        table = table.select([c.name for c in self.columns])
        if per_request:
            block = self.checker.check_requests(self.checker.split_requests(table, where, stored), where)
            return self.builder.build_requests(block)
        return self.builder.build(self.checker(table, where))

    def batch_requests(self, requests: pa.Table, where: str) -> Batch:
        """Several requests' batch: ``requests`` holds one per-request row each (the layout the
        build writes: data/loader/storage_layout.py); one user slot per request, candidates in row order."""
        f = self.cfg.features
        stored = stored_request_level(requests.schema, f)
        table = _with_label_columns(requests, self.cfg, stored)
        check_schema(where, table.schema, self.columns, True, stored)
        table = table.select([c.name for c in self.columns])
        block = self.checker.check_requests(self.checker.split_requests(table, where, stored), where)
        builder = BatchBuilder(self.builder.layout, user_slots=requests.num_rows, broadcast=self.cfg.model.broadcast)
        return builder.build_requests(block)


def _with_label_columns(
    table: pa.Table, cfg: config.ExperimentConfig, stored: Optional[Collection[str]] = None
) -> pa.Table:
    """A served request has no labels: the contract's label (and oracle) columns are filled with 0
    (per candidate; in a per-request row -- ``stored``: the columns it holds once per request -- a
    list as long as its candidates)."""
    for task in cfg.features.tasks:
        for name in (task.label_column, task.true_probability_column):
            if name and table.schema.get_field_index(name) < 0:
                if stored is not None:
                    # As many as the row's candidates: the length of any column stored per candidate.
                    candidate = next(n for n in table.column_names if n not in stored)
                    lengths = pc.list_value_length(table.column(candidate)).to_numpy(zero_copy_only=False)
                    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
                    zeros = pa.array(np.zeros(int(lengths.sum()), np.float32))
                    table = table.append_column(name, pa.ListArray.from_arrays(offsets, zeros))
                else:
                    table = table.append_column(name, pa.array(np.zeros(table.num_rows, np.float32)))
    return table


def file_order_batches(cfg: config.ExperimentConfig, data_dir: str, batch_size: Optional[int] = None) -> ParquetBatches:
    """The loader over ``data_dir`` in file order, nothing dropped, without the unique-user bound."""
    return ParquetBatches(
        data_dir, LoaderSettings.of(unbounded_users(cfg)), shuffle=False, batch_size=batch_size, drop_last=False
    )


class ScoringBatches:
    """Every row of ``data_dir`` in file order, nothing shuffled or dropped, as (rows, batch) pairs:
    ``batch`` padded to ``batch_size`` rows (padding marked invalid) and ``rows`` one row per valid
    candidate, its request id and item id as read -- before the contract's id hashing, under
    ``AS_READ_PREFIX + column`` -- so predictions join back to the input (either storage layout).
    The files are listed and their schemas checked here, before the first batch."""

    def __init__(self, cfg: config.ExperimentConfig, data_dir: str, batch_size: Optional[int] = None):
        names = cfg.features.columns
        self.batch_size = batch_size or cfg.data.batch_size
        self.request_column = names.request_id
        self.reader = RowGroupReader(cfg.features, cfg.data, keep_as_read=[names.request_id, names.item_id])
        self.joined_columns = [AS_READ_PREFIX + names.request_id, AS_READ_PREFIX + names.item_id]
        self.row_groups = list_row_groups(list_files(data_dir), cfg.features)
        # No data.max_unique_users_per_batch (see unbounded_users): up to batch_size requests a batch.
        layout = FeatureLayout.of(cfg.features)
        self.builder = BatchBuilder(layout, user_slots=self.batch_size, broadcast=cfg.model.broadcast)

    def __iter__(self) -> Iterator[Tuple[pa.Table, Batch]]:
        pool = ShufflePool(self.batch_size, max_requests=self.batch_size, buffer_rows=0, rng=None)
        for rows in pool.batches(read_requests(self.reader, self.row_groups)):
            kept = rows.requests.per_row(self.joined_columns)
            yield kept, self.builder.build_requests(rows.requests, rows.source, pad_to=self.batch_size)
