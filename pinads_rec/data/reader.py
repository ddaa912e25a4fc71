"""Parquet files -> checked Arrow row groups: listing, schema checks, the split into parts, the deal
of row groups to (rank, worker) slots, and reading one row group at a time.

- ``list_files`` / ``list_row_groups``: a directory's ``.parquet`` files (recursively, in name
  order) and their non-empty row groups; every file's schema is checked against the column contract
  (data/contract.py) when it is listed, so a wrong file fails before training starts.
- ``select_part``: all row groups, the training ones, or the calibration holdout (the last ones).
- ``assign_row_groups``: one slot's row groups for an epoch; the slots partition the list, so every
  row is read exactly once per epoch by exactly one slot.
- ``RowGroupReader.read``: one row group's contract columns -> ``pa.Table`` after the contract's
  per-row-group checks and repairs (ids hashed, surfaces as indices, ...) and ``data.row_filter``.
  Never the whole dataset.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import List, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pinads_rec.config import DataConfig, FeaturesConfig
from pinads_rec.data.contract import ContractError, RowGroupChecker, check_schema, contract_columns

# Prefix of the copies ``RowGroupReader(keep_as_read=...)`` adds: a column before the contract's repairs.
AS_READ_PREFIX = "__as_read_"


@dataclass(frozen=True)
class RowGroup:
    path: str
    index: int
    num_rows: int

    def __str__(self) -> str:
        return f"{self.path}, row group {self.index}"


def list_files(directory: str) -> List[str]:
    """The ``.parquet`` files under ``directory`` (or the file itself), sorted by path."""
    if os.path.isfile(directory):
        return [directory]
    if not os.path.isdir(directory):
        raise ContractError(f"data directory {directory} does not exist")
    files = sorted(glob.glob(os.path.join(directory, "**", "*.parquet"), recursive=True))
    if not files:
        raise ContractError(f"data directory {directory} holds no .parquet files")
    return files


def open_parquet(path: str) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as e:
        raise ContractError(f"{path}: not a readable Parquet file ({e})") from None


def list_row_groups(files: Sequence[str], features: FeaturesConfig) -> List[RowGroup]:
    """Opens every file's footer, checks its schema against the contract, lists its row groups."""
    columns = contract_columns(features)
    groups = []
    for path in files:
        f = open_parquet(path)
        check_schema(path, f.schema_arrow, columns)
        md = f.metadata
        groups += [
            RowGroup(path, i, md.row_group(i).num_rows)
            for i in range(md.num_row_groups)
            if md.row_group(i).num_rows > 0
        ]
    return groups


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
        self.columns = [c.name for c in contract_columns(features)]
        self.columns += [c for c in dict.fromkeys(keep_as_read) if c not in self.columns]
        self.keep_as_read = list(dict.fromkeys(keep_as_read))
        self.checker = RowGroupChecker(features, data)
        self.row_filter = data.row_filter

    def read(self, group: RowGroup) -> pa.Table:
        try:
            table = open_parquet(group.path).read_row_group(group.index, columns=self.columns)
        except ContractError:
            raise
        except (pa.ArrowException, OSError) as e:
            raise ContractError(f"{group}: cannot be read ({e})") from None
        for c in self.keep_as_read:
            table = table.append_column(AS_READ_PREFIX + c, table.column(c))
        table = self.checker(table, str(group))
        keep = self.row_filter
        if keep is not None:
            table = table.filter(
                pc.is_in(table.column(keep.column), pa.array(keep.values, table.schema.field(keep.column).type))
            )
        return table
