"""Storage layouts of contract Parquet files, and the in-memory form the loader keeps requests in.

Two layouts hold the same data (docs/storage_layout.md):

- **per row**: one row per candidate; the request-level values (request id, timestamp, user-side
  sparse features, every sequence group column) repeated on each candidate row; the rows of a
  request contiguous.
- **per request**: one row per request; request-level columns as in the per-row layout, stored
  once; every other column ("candidate-level") a ``list<T>`` of one value per candidate, T its
  per-row type. All candidate columns of a row have the same length (its candidates, at least one).
  A file is per request iff its first task's label column is a list (``is_per_request``). Writers
  set the schema metadata ``LAYOUT_KEY: PER_REQUEST`` and ``REQUEST_COLUMNS_KEY``: the JSON list
  of the columns they stored once per request. A reader goes by that list, not by its own config:
  another config may mark other features user-side (a candidate-level column stored per request is
  repeated on its candidates; a request-level one stored per candidate is read from the first
  candidate, as in the per-row layout). A file without the list is read with the config's.

A column read both per request and per candidate (e.g. a user-side feature's column also a
candidate feature's) is request-level: the same value for every candidate of the request.

``Requests`` is how the loader holds rows in memory, whatever the file's layout: the request-level
columns once per request, the candidate-level ones once per candidate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Collection, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pinads_rec.config import FeaturesConfig

LAYOUT_KEY = b"pinads_rec.layout"
PER_REQUEST = b"per_request"
REQUEST_COLUMNS_KEY = b"pinads_rec.request_columns"


def request_level_columns(features: FeaturesConfig) -> List[str]:
    """The columns stored once per request: request id, timestamp, every user-side sparse feature's
    column, every sequence group's columns (config order, each once)."""
    names = features.columns
    out = [names.request_id, names.timestamp]
    out += [s.column for s in features.sparse if s.user_side]
    for g in features.sequence_groups:
        out += [g.timestamp_column] + [f.column for f in g.features]
        out += [g.embedding_column] if g.embedding_column else []
    return list(dict.fromkeys(out))


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def is_per_request(schema: pa.Schema, features: FeaturesConfig) -> bool:
    """Whether ``schema`` is of the per-request layout: its first task's label column is a list.
    (Without that column -- a request to serve -- the surface column decides the same way.)"""
    for name in (features.tasks[0].label_column, features.columns.surface):
        idx = schema.get_field_index(name)
        if idx >= 0:
            return _is_list(schema.field(idx).type)
    return False


def stored_request_level(schema: pa.Schema, features: FeaturesConfig) -> Set[str]:
    """The columns a per-request file holds once per request: as its writer recorded them, else the
    config's ``request_level_columns``."""
    recorded = (schema.metadata or {}).get(REQUEST_COLUMNS_KEY)
    return set(json.loads(recorded)) if recorded else set(request_level_columns(features))


def per_request_metadata(names: Sequence[str], request_level: Collection[str]) -> Dict[bytes, bytes]:
    """The schema metadata a per-request writer sets for a file of columns ``names``."""
    stored = [n for n in names if n in set(request_level)]
    return {LAYOUT_KEY: PER_REQUEST, REQUEST_COLUMNS_KEY: json.dumps(stored).encode()}


def per_request_schema(
    schema: pa.Schema, features: Optional[FeaturesConfig], request_level: Optional[Collection[str]] = None
) -> pa.Schema:
    """The per-request schema of a per-row one: every column but the ``request_level`` ones (default:
    the config's) becomes ``list<T>``; the layout's metadata is set. Open a ``ParquetWriter`` with it
    to write per-request files."""
    level = set(request_level_columns(features) if request_level is None else request_level)
    fields = [f if f.name in level else pa.field(f.name, pa.list_(f.type)) for f in schema]
    metadata = dict(schema.metadata or {})
    metadata.update(per_request_metadata(schema.names, level))
    return pa.schema(fields, metadata=metadata)


def request_starts(request_ids: np.ndarray) -> np.ndarray:
    """The first row of each run of equal request ids (a request's rows are contiguous)."""
    if not len(request_ids):
        return np.zeros(0, np.int64)
    return np.flatnonzero(np.concatenate([[True], request_ids[1:] != request_ids[:-1]]))


def to_per_request(
    table: pa.Table, features: FeaturesConfig, request_level: Optional[Collection[str]] = None
) -> pa.Table:
    """A per-row table (a request's rows contiguous) as a per-request one, columns in the same order.
    The ``request_level`` columns (default: the config's) are taken from each request's first row."""
    req = table.column(features.columns.request_id).to_numpy()
    starts = request_starts(req)
    if len(starts) != len(np.unique(req)):
        raise ValueError(
            f"column {features.columns.request_id!r}: the rows of a request are not contiguous; sort by request"
        )
    offsets = pa.array(np.append(starts, len(req)).astype(np.int32))
    level = set(request_level_columns(features) if request_level is None else request_level)
    first = pa.array(starts)
    columns = []
    for name in table.column_names:
        col = table.column(name).combine_chunks()
        columns.append(col.take(first) if name in level else pa.ListArray.from_arrays(offsets, col))
    return pa.Table.from_arrays(columns, schema=per_request_schema(table.schema, features, level))


def candidate_counts(table: pa.Table, features: FeaturesConfig) -> np.ndarray:
    """Candidates per request of a per-request table (its first task's label lists' lengths)."""
    label = table.column(features.tasks[0].label_column)
    return pc.list_value_length(label).to_numpy(zero_copy_only=False).astype(np.int64)


def to_per_row(table: pa.Table, features: FeaturesConfig) -> pa.Table:
    """A per-request table as a per-row one: one row per candidate, request-level values repeated."""
    counts = candidate_counts(table, features)
    request_of_row = pa.array(np.repeat(np.arange(len(counts)), counts))
    request_level = stored_request_level(table.schema, features)
    columns, fields = [], []
    for f in table.schema:
        col = table.column(f.name).combine_chunks()
        if f.name in request_level:
            columns.append(col.take(request_of_row))
            fields.append(f)
        else:
            columns.append(col.flatten())
            fields.append(pa.field(f.name, f.type.value_type))
    metadata = {k: v for k, v in (table.schema.metadata or {}).items() if k not in (LAYOUT_KEY, REQUEST_COLUMNS_KEY)}
    return pa.Table.from_arrays(columns, schema=pa.schema(fields, metadata=metadata or None))


# --------------------------------------------------------------------------------------------
# In memory: requests once, candidates once.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Requests:
    """Requests and their candidates: ``request_table`` holds the request-level columns (one row per
    request), ``rows`` the candidate-level ones (one row per candidate, requests in order); request
    i's candidates are ``rows[offsets[i] : offsets[i + 1]]``. A column lives in one of the two."""

    request_table: pa.Table
    rows: pa.Table
    offsets: np.ndarray  # int64 [num_requests + 1], offsets[0] == 0

    @property
    def num_requests(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_rows(self) -> int:
        return int(self.offsets[-1])

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def nbytes(self) -> int:
        return self.request_table.nbytes + self.rows.nbytes

    def request_of_rows(self) -> np.ndarray:
        """[num_rows] int64: each candidate's request."""
        return np.repeat(np.arange(self.num_requests), self.lengths)

    def row_column(self, name: str) -> pa.Array:
        """A column per candidate; a request-level one repeated on each of the request's candidates."""
        if name in self.rows.column_names:
            return self.rows.column(name).combine_chunks()
        return self.request_table.column(name).combine_chunks().take(pa.array(self.request_of_rows()))

    def request_column(self, name: str) -> pa.Array:
        """A column per request; a candidate-level one from each request's first candidate."""
        if name in self.request_table.column_names:
            return self.request_table.column(name).combine_chunks()
        return self.rows.column(name).combine_chunks().take(pa.array(self.offsets[:-1]))

    def column(self, name: str) -> pa.Array:
        """The column as stored: per request or per candidate."""
        return (
            (self.request_table if name in self.request_table.column_names else self.rows).column(name).combine_chunks()
        )

    def with_columns(self, values: Dict[str, pa.Array], beside: Optional[Dict[str, str]] = None) -> "Requests":
        """Columns replaced where they live; a new one added to the table of the column ``beside[name]``."""
        requests, rows = self.request_table, self.rows
        for name, array in values.items():
            home = (beside or {}).get(name, name)
            if home in requests.column_names:
                requests = _put(requests, name, array)
            else:
                rows = _put(rows, name, array)
        return Requests(requests, rows, self.offsets)

    def per_row(self, names: Optional[Sequence[str]] = None) -> pa.Table:
        """One row per candidate (request-level values repeated), the columns ``names`` (default all,
        request-level first)."""
        names = list(names) if names is not None else self.request_table.column_names + self.rows.column_names
        return pa.table({n: self.row_column(n) for n in names})

    def filter_rows(self, keep: np.ndarray) -> "Requests":
        """The candidates where ``keep``; requests left without one are dropped."""
        counts = np.bincount(self.request_of_rows()[keep], minlength=self.num_requests)
        alive = counts > 0
        return Requests(
            self.request_table.filter(pa.array(alive)),
            self.rows.filter(pa.array(keep)),
            np.concatenate([[0], np.cumsum(counts[alive])]).astype(np.int64),
        )

    def filter_requests(self, keep: np.ndarray) -> "Requests":
        """The requests where ``keep``, with their candidates."""
        return self.filter_rows(np.repeat(keep, self.lengths))

    @classmethod
    def from_per_row(cls, table: pa.Table, starts: np.ndarray, request_level: Collection[str]) -> "Requests":
        """Splits a per-row table (requests starting at rows ``starts``): the ``request_level``
        columns taken from each request's first row."""
        names = [n for n in table.column_names if n in request_level]
        first = pa.array(starts.astype(np.int64))
        requests = pa.table({n: table.column(n).combine_chunks().take(first) for n in names})
        rows = table.drop_columns(names)
        return cls(requests, rows, np.append(starts, table.num_rows).astype(np.int64))

    @classmethod
    def gather(cls, pieces: Sequence[Tuple["Requests", int, int, int]]) -> "Requests":
        """The requests of ``pieces`` -- (block, request, first row, rows) -- in order, each with the
        given run of its candidates (one request per piece). Each block is gathered once: pieces from
        the same block come out together, blocks in order of first appearance."""
        by_block: dict = {}
        for block, request, start, n in pieces:
            entry = by_block.setdefault(id(block), [block, [], [], []])
            entry[1].append(request)
            entry[2].append(np.arange(start, start + n))
            entry[3].append(n)
        requests, rows, lengths = [], [], []
        for block, reqs, idx, ns in by_block.values():
            requests.append(block.request_table.take(pa.array(np.asarray(reqs, np.int64))))
            rows.append(block.rows.take(pa.array(np.concatenate(idx))))
            lengths += ns
        return cls(
            pa.concat_tables(requests) if len(requests) > 1 else requests[0],
            pa.concat_tables(rows) if len(rows) > 1 else rows[0],
            np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        )


def _put(table: pa.Table, name: str, array) -> pa.Table:
    idx = table.schema.get_field_index(name)
    if idx < 0:
        return table.append_column(name, array)
    return table.set_column(idx, name, array)
