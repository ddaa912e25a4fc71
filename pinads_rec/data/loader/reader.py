"""Parquet files -> checked Arrow row groups: listing, schema checks, the split into parts, the deal
of row groups to (rank, worker) slots, and reading one row group at a time.

- ``list_files`` / ``list_row_groups``: a directory's ``.parquet`` files (recursively, in name
  order) and their non-empty row groups; every file's schema is checked against the column contract
  (data/loader/contract.py) when it is listed, so a wrong file fails before training starts. A build's
  output that is not complete per its manifest, or whose files' sha256 differ from it, is refused
  (data/build_output.py).
- ``open_parquet``: every read verifies the pages' checksums (data/page_checksums.py).
- ``select_part``: all row groups, the training ones, or the calibration holdout (the last ones).
- ``assign_row_groups``: one slot's row groups for an epoch; the slots partition the list, so every
  row is read exactly once per epoch by exactly one slot.
- ``RowGroupReader.read_requests``: one row group's contract columns -> ``Requests``
  (data/loader/storage_layout.py: request-level columns once per request, the others once per
  candidate) after the contract's per-row-group checks and repairs (data/loader/row_group_checker.py:
  ids hashed, surfaces as indices, ...) and ``data.row_filter``.
  ``read``: the same as one ``pa.Table`` row per candidate. Never the whole dataset.

Both storage layouts are read (data/loader/storage_layout.py), file by file: per row (one row per
candidate) and per request (one row per request, its candidate columns lists). A per-request row group's footer
counts requests; its candidates are counted from the footer too (the first label column's values:
every request holds at least one candidate, so the count is exact).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pinads_rec.config import DataConfig, FeaturesConfig
from pinads_rec.data.build_output import require_complete, require_unchanged
from pinads_rec.data.loader.contract import ContractError, check_schema, contract_columns
from pinads_rec.data.loader.row_group_checker import RowGroupChecker
from pinads_rec.data.loader.storage_layout import (
    Requests,
    is_per_request,
    request_level_columns,
    request_starts,
    stored_request_level,
)
from pinads_rec.data.page_checksums import CheckedParquetFile

# Prefix of the copies ``RowGroupReader(keep_as_read=...)`` adds: a column before the contract's repairs.
AS_READ_PREFIX = "__as_read_"


@dataclass(frozen=True)
class RowGroup:
    path: str
    index: int
    num_rows: int  # candidates (rows of the per-row layout)
    num_requests: Optional[int] = None  # per-request files: the footer's row count; per-row files: not counted

    def __str__(self) -> str:
        return f"{self.path}, row group {self.index}"


def list_files(directory: str, share: Tuple[int, int] = (0, 1)) -> List[str]:
    """The ``.parquet`` files under ``directory`` (or the file itself), sorted by path; a build's
    output only when complete and unchanged (``build_output.require_complete``, ``require_unchanged``).
    ``share`` (index, count): this process hashes every count-th file from index against the
    manifest; a job's ranks pass (rank, world size), so together they hash each file once."""
    require_complete(directory)
    if os.path.isfile(directory):
        files = [directory]
    elif not os.path.isdir(directory):
        raise ContractError(f"data directory {directory} does not exist")
    else:
        files = sorted(glob.glob(os.path.join(directory, "**", "*.parquet"), recursive=True))
    if not files:
        raise ContractError(f"data directory {directory} holds no .parquet files")
    index, count = share
    require_unchanged(files[index::count])
    return files


def open_parquet(path: str) -> CheckedParquetFile:
    """The file, its pages' checksums verified on every read; a footer, page or row group that cannot
    be read is a one-line ContractError naming the file (and the row group) (data/page_checksums.py)."""
    return CheckedParquetFile(path)


def list_row_groups(files: Sequence[str], features: FeaturesConfig) -> List[RowGroup]:
    """Opens every file's footer, checks its schema against the contract, lists its row groups."""
    columns = contract_columns(features)
    groups = []
    for path in files:
        f = open_parquet(path)
        per_request = is_per_request(f.schema_arrow, features)
        stored = stored_request_level(f.schema_arrow, features) if per_request else None
        check_schema(path, f.schema_arrow, columns, per_request, stored)
        md = f.metadata
        if per_request:
            leaf = _leaf_column(md, features.tasks[0].label_column)
            groups += [
                RowGroup(path, i, md.row_group(i).column(leaf).num_values, md.row_group(i).num_rows)
                for i in range(md.num_row_groups)
                if md.row_group(i).num_rows > 0
            ]
        else:
            groups += [
                RowGroup(path, i, md.row_group(i).num_rows)
                for i in range(md.num_row_groups)
                if md.row_group(i).num_rows > 0
            ]
    return groups


def _leaf_column(md: pq.FileMetaData, name: str) -> int:
    """The index of the Parquet leaf column of a list column ``name`` (its values' count per row
    group is in the footer)."""
    return next(j for j in range(md.num_columns) if md.schema.column(j).path.split(".")[0] == name)


def select_part(groups: List[RowGroup], part: str, holdout: float, where: str) -> List[RowGroup]:
    """``all`` the row groups, the ``train`` ones, or the calibration ``holdout``: the last
    max(round(holdout x count), 1) in file order (the latest data when files are in time order).
    The split does not depend on the world size, so a run resumed on another one trains on the same rows."""
    if part == "all" or holdout == 0.0 or not groups:  # no rows: nothing to split (the caller says so)
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


class RowGroupReader:
    """Reads one row group at a time: the contract's columns, checked and repaired by a
    ``RowGroupChecker`` (its ``repairs`` count every repair made), then ``data.row_filter``.

    ``keep_as_read``: columns also returned as they were read, before the contract's repairs (ids
    hashed into range...), under ``AS_READ_PREFIX + name`` -- serving joins its predictions back to
    the input by them."""

    def __init__(self, features: FeaturesConfig, data: DataConfig, keep_as_read: Sequence[str] = ()):
        self.features = features
        contract = contract_columns(features)
        self.columns = [c.name for c in contract]
        self.columns += [c for c in dict.fromkeys(keep_as_read) if c not in self.columns]
        self.keep_as_read = list(dict.fromkeys(keep_as_read))
        self.checker = RowGroupChecker(features, data)
        self.row_filter = data.row_filter
        # Kept once per request in memory: the request-level columns, their derived columns, copies.
        level = set(request_level_columns(features))
        self.request_level = set(self.checker.request_level)
        self.request_level.update(AS_READ_PREFIX + c for c in self.keep_as_read if c in level)
        # The columns of ``read``'s per-row table, in order.
        self.row_columns = self.columns + [AS_READ_PREFIX + c for c in self.keep_as_read]
        self.row_columns += [d for c in contract for d in c.derived]

    def _read(self, group: RowGroup) -> pa.Table:
        table = open_parquet(group.path).read_row_group(group.index, columns=self.columns)
        for c in self.keep_as_read:
            table = table.append_column(AS_READ_PREFIX + c, table.column(c))
        return table

    def read(self, group: RowGroup) -> pa.Table:
        """The row group, checked and filtered, one row per candidate (request-level values repeated)."""
        table = self._read(group)
        if is_per_request(table.schema, self.features):
            return self._requests(table, str(group)).per_row(self.row_columns)
        return self._filter(self.checker(table, str(group)))

    def read_requests(self, group: RowGroup) -> Requests:
        """The row group, checked and filtered, as ``Requests``: whatever the file's layout, the
        request-level columns are held once per request (a per-row file's from each request's first
        row; requests must be contiguous)."""
        table = self._read(group)
        if is_per_request(table.schema, self.features):
            return self._requests(table, str(group))
        table = self._filter(self.checker(table, str(group)))
        column = self.features.columns.request_id
        req = table.column(column).to_numpy()
        starts = request_starts(req)
        if len(starts) != len(np.unique(req)):
            raise ContractError(
                f"{group}, column {column!r}: the rows of a request are not contiguous "
                f"(request-level broadcasting needs them together); sort the file by request"
            )
        return Requests.from_per_row(table, starts, self.request_level)

    def _requests(self, table: pa.Table, where: str) -> Requests:
        # Split as the file's writer stored it (its config may mark other features user-side).
        stored = stored_request_level(table.schema, self.features)
        stored |= {AS_READ_PREFIX + c for c in self.keep_as_read if c in stored}
        block = self.checker.split_requests(table, where, stored)
        block = self.checker.check_requests(block, where)
        keep = self.row_filter
        if keep is None:
            return block
        col = block.column(keep.column)
        mask = pc.is_in(col, pa.array(keep.values, col.type)).to_numpy(zero_copy_only=False)
        if keep.column in block.request_table.column_names:
            return block.filter_requests(mask)
        return block.filter_rows(mask)

    def _filter(self, table: pa.Table) -> pa.Table:
        keep = self.row_filter
        if keep is not None:
            table = table.filter(
                pc.is_in(table.column(keep.column), pa.array(keep.values, table.schema.field(keep.column).type))
            )
        return table
