"""The data contract: which columns a config needs, their types, and the checks on every row group.

A user's mistake surfaces here, as a ``ContractError`` naming the file, row group, column and
(where it applies) the first offending row, before any tensor is built. Two problems have a
documented, counted repair instead of an error, chosen in config:

- ``data.nonfinite_dense: replace`` -- NaN/inf in a dense column becomes 0.0;
- ``data.overlong_sequence: truncate`` -- a sequence longer than its group's ``max_length`` keeps
  its newest ``max_length`` events (sequences are stored newest first, so the head of the list).

Ids at or beyond their table's size are hashed into range (id mod size) when the table says
``hash: true``, and are an error otherwise.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pinads_rec.config import DataConfig, FeaturesConfig
from pinads_rec.features import FeatureLayout

log = logging.getLogger(__name__)


class ContractError(ValueError):
    """Input data that breaks the contract; the message says where (file, row group, column)."""


# Column roles: what the loader does with each column and which Arrow types it accepts.
ID, SHARED_ID, FLOAT, FLOAT_LIST, SEQ_ID, SEQ_TS, SEQ_EMB, LABEL, PROB, SURFACE, TIME, REQUEST = (
    "id",
    "single id (its table is shared with sequences)",
    "float",
    "fixed-size float list",
    "sequence id list",
    "sequence timestamp list",
    "sequence embedding list",
    "0/1 label",
    "probability",
    "surface",
    "timestamp",
    "request id",
)


@dataclass(frozen=True)
class Column:
    name: str
    role: str
    table_size: int = 0  # id roles: the embedding table's size
    hashed: bool = False
    dim: int = 1  # float lists / sequence embeddings
    group: Optional[str] = None  # sequence roles: the group
    max_length: int = 0


def contract_columns(features: FeaturesConfig) -> List[Column]:
    """Every column the config reads, with its role. Shared columns appear once."""
    cols: Dict[str, Column] = {}

    def add(c: Column) -> None:
        if c.name in cols and cols[c.name] != c:
            raise ContractError(f"config uses column {c.name!r} as both {cols[c.name].role} and {c.role}")
        cols[c.name] = c

    names = features.columns
    add(Column(names.request_id, REQUEST))
    add(Column(names.surface, SURFACE))
    add(Column(names.timestamp, TIME))
    shared = set(FeatureLayout.of(features).shared_keys)
    for s in features.sparse:
        t = features.table(s.table)
        # ID: one id or a list (decided by the file's type); SHARED_ID: exactly one id per row.
        add(Column(s.column, SHARED_ID if s.name in shared else ID, t.num_embeddings, t.hash))
    for d in features.dense:
        add(Column(d.column, FLOAT if d.dim == 1 else FLOAT_LIST, dim=d.dim))
    for g in features.sequence_groups:
        add(Column(g.timestamp_column, SEQ_TS, group=g.name, max_length=g.max_length))
        for f in g.features:
            t = features.table(f.table)
            add(Column(f.column, SEQ_ID, t.num_embeddings, t.hash, group=g.name, max_length=g.max_length))
        if g.embedding_column:
            add(Column(g.embedding_column, SEQ_EMB, dim=g.embedding_dim, group=g.name, max_length=g.max_length))
    for task in features.tasks:
        add(Column(task.label_column, LABEL))
        if task.true_probability_column:
            add(Column(task.true_probability_column, PROB))
    return list(cols.values())


def _is_int(t: pa.DataType) -> bool:
    return pa.types.is_integer(t)


def _is_num(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _type_ok(c: Column, t: pa.DataType) -> bool:
    if c.role in (ID, REQUEST, SHARED_ID):
        return _is_int(t) or (c.role == ID and _is_list(t) and _is_int(t.value_type))
    if c.role in (FLOAT, LABEL, PROB, TIME):
        return _is_num(t)
    if c.role == FLOAT_LIST:
        return _is_list(t) and _is_num(t.value_type)
    if c.role in (SEQ_ID, SEQ_TS):
        return _is_list(t) and _is_int(t.value_type)
    if c.role == SEQ_EMB:
        return _is_list(t) and _is_list(t.value_type) and _is_num(t.value_type.value_type)
    if c.role == SURFACE:
        return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_dictionary(t) or _is_int(t)
    raise AssertionError(c.role)


_EXPECTED = {
    ID: "int64 or list<int64>",
    SHARED_ID: "int64",
    REQUEST: "integer",
    FLOAT: "float",
    LABEL: "integer or float 0/1",
    PROB: "float",
    TIME: "integer or float seconds",
    FLOAT_LIST: "list<float>",
    SEQ_ID: "list<int64>",
    SEQ_TS: "list<int64>",
    SEQ_EMB: "list<fixed_size_list<float>>",
    SURFACE: "string (or integer index)",
}


def check_schema(path: str, schema: pa.Schema, columns: List[Column]) -> None:
    """Fail at open, naming the file and column, when a column is missing or of the wrong type."""
    for c in columns:
        idx = schema.get_field_index(c.name)
        if idx < 0:
            raise ContractError(f"{path}: missing column {c.name!r} (the config uses it as {c.role})")
        t = schema.field(idx).type
        if not _type_ok(c, t):
            raise ContractError(f"{path}: column {c.name!r} has type {t}, expected {_EXPECTED[c.role]} ({c.role})")


class RowGroupChecker:
    """Checks and repairs one row group at a time; keeps the counts of every repair it made."""

    def __init__(self, features: FeaturesConfig, data: DataConfig):
        self.features = features
        self.data = data
        self.columns = contract_columns(features)
        self.surface_index = pa.array(features.surfaces)
        self.repairs: Counter = Counter()
        # A group's truncation is counted once, on its first id column.
        self.counting_columns = {g.features[0].column for g in features.sequence_groups}

    def __call__(self, table: pa.Table, where: str) -> pa.Table:
        """Returns the row group with ids hashed, surfaces as indices, repairs applied."""
        for c in self.columns:
            col = table.column(c.name)
            place = f"{where}, column {c.name!r}"
            if col.null_count:
                row = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
                raise ContractError(f"{place}: null value at row {row} (nulls are not allowed)")
            if _is_list(col.type):
                inner = col.combine_chunks().flatten()
                if inner.null_count:
                    i = int(np.flatnonzero(inner.is_null().to_numpy(zero_copy_only=False))[0])
                    raise ContractError(f"{place}: null inside a list (value #{i}; nulls are not allowed)")
            fixed = self._check(c, col, place, table)
            if fixed is not None:
                table = table.set_column(table.schema.get_field_index(c.name), c.name, fixed)
        self._check_aligned(table, where)
        return table

    # --- one column -------------------------------------------------------------------------

    def _check(self, c: Column, col: pa.ChunkedArray, place: str, table: pa.Table) -> Optional[pa.Array]:
        col = col.combine_chunks()
        if c.role in (ID, SHARED_ID, SEQ_ID):
            fixed = None
            if c.role == SEQ_ID:
                fixed = col = self._truncate(c, col, place)
            flat = col.flatten() if _is_list(col.type) else col
            ids = flat.to_numpy(zero_copy_only=False)
            if ids.size:
                if ids.min() < 0:
                    bad = int(np.argmax(ids < 0))
                    raise ContractError(f"{place}: negative id {ids[bad]} (value #{bad} of the row group)")
                if ids.max() >= c.table_size:
                    if not c.hashed:
                        bad = int(np.argmax(ids >= c.table_size))
                        raise ContractError(
                            f"{place}: id {ids[bad]} is beyond its table's size {c.table_size} "
                            f"(value #{bad}); enlarge the table or set hash: true"
                        )
                    hashed = pa.array(ids % c.table_size)
                    fixed = pa.ListArray.from_arrays(_offsets(col), hashed) if _is_list(col.type) else hashed
            return fixed
        if c.role in (SEQ_TS, SEQ_EMB):
            return self._truncate(c, col, place)
        if c.role in (FLOAT, FLOAT_LIST):
            values = (col.flatten() if _is_list(col.type) else col).to_numpy(zero_copy_only=False)
            values = np.asarray(values, dtype=np.float32)
            if c.role == FLOAT_LIST:
                lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
                if lengths.size and (lengths != c.dim).any():
                    row = int(np.argmax(lengths != c.dim))
                    raise ContractError(
                        f"{place}: row {row} has {lengths[row]} values, the config declares dim {c.dim}"
                    )
            bad = ~np.isfinite(values)
            if bad.any():
                if self.data.nonfinite_dense == "error":
                    i = int(np.argmax(bad))
                    raise ContractError(
                        f"{place}: non-finite value {values[i]} (value #{i}); "
                        "fix the data or set data.nonfinite_dense: replace"
                    )
                self._count(f"{c.name}: non-finite replaced by 0", int(bad.sum()), place)
                values = np.where(bad, np.float32(0), values)
                return (
                    pa.FixedSizeListArray.from_arrays(pa.array(values), c.dim)
                    if c.role == FLOAT_LIST
                    else pa.array(values)
                )
            return None
        if c.role == LABEL:
            y = col.to_numpy(zero_copy_only=False)
            bad = (y != 0) & (y != 1)
            if bad.any():
                row = int(np.argmax(bad))
                raise ContractError(f"{place}: label {y[row]} at row {row} is not 0 or 1")
            return None
        if c.role == PROB:
            p = col.to_numpy(zero_copy_only=False)
            bad = ~((p >= 0) & (p <= 1))
            if bad.any():
                row = int(np.argmax(bad))
                raise ContractError(f"{place}: probability {p[row]} at row {row} is outside [0, 1]")
            return None
        if c.role == SURFACE:
            if _is_int(col.type):
                idx = col.to_numpy(zero_copy_only=False)
                bad = (idx < 0) | (idx >= len(self.features.surfaces))
            else:
                idx = pc.index_in(col.cast(pa.string()), value_set=self.surface_index).to_numpy(zero_copy_only=False)
                bad = np.isnan(idx) if idx.dtype.kind == "f" else np.zeros(len(idx), bool)
            if bad.any():
                row = int(np.argmax(bad))
                raise ContractError(
                    f"{place}: unknown surface {col[row].as_py()!r} at row {row} "
                    f"(features.surfaces lists {self.features.surfaces})"
                )
            return pa.array(np.asarray(idx, dtype=np.int64))
        if c.role == TIME:
            t = col.to_numpy(zero_copy_only=False)
            if not np.isfinite(t).all():
                raise ContractError(f"{place}: non-finite timestamp")
            return None
        return None  # REQUEST: any integer

    def _truncate(self, c: Column, col: pa.Array, place: str) -> pa.Array:
        lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
        if not lengths.size or lengths.max() <= c.max_length:
            return col
        if self.data.overlong_sequence == "error":
            row = int(np.argmax(lengths > c.max_length))
            raise ContractError(
                f"{place}: row {row} has a sequence of {lengths[row]} events, "
                f"more than the group's max_length {c.max_length}"
            )
        if c.name in self.counting_columns:
            self._count(
                f"sequence group {c.group}: truncated to newest {c.max_length}",
                int((lengths > c.max_length).sum()),
                place,
            )
        return pc.list_slice(col, 0, c.max_length)

    def _check_aligned(self, table: pa.Table, where: str) -> None:
        for g in self.features.sequence_groups:
            cols = [g.timestamp_column] + [f.column for f in g.features]
            cols += [g.embedding_column] if g.embedding_column else []
            ref = pc.list_value_length(table.column(cols[0])).to_numpy(zero_copy_only=False)
            for name in cols[1:]:
                lengths = pc.list_value_length(table.column(name)).to_numpy(zero_copy_only=False)
                if (lengths != ref).any():
                    row = int(np.argmax(lengths != ref))
                    raise ContractError(
                        f"{where}: ragged sequence group {g.name!r} at row {row}: column {name!r} has "
                        f"{lengths[row]} events but {cols[0]!r} has {ref[row]}"
                    )
            if g.embedding_column:
                inner = pc.list_value_length(table.column(g.embedding_column).combine_chunks().flatten())
                inner = inner.to_numpy(zero_copy_only=False)
                if inner.size and (inner != g.embedding_dim).any():
                    raise ContractError(
                        f"{where}, column {g.embedding_column!r}: event embeddings of width "
                        f"{int(inner[inner != g.embedding_dim][0])}, config says {g.embedding_dim}"
                    )

    def _count(self, what: str, n: int, place: str) -> None:
        self.repairs[what] += n
        log.warning("%s: repaired %d value(s): %s", place, n, what)


def _offsets(col: pa.Array) -> pa.Array:
    lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
    return pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))


def summarize_repairs(repairs: Counter) -> List[Tuple[str, int]]:
    return sorted(repairs.items())
