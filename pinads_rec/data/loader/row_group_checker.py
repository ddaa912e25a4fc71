"""``RowGroupChecker``: every row group checked against the contract (data/loader/contract.py) and repaired.

A user's mistake surfaces here, as a ``ContractError`` naming the file, row group, column and
(where it applies) the first offending row, before any tensor is built. Two problems have a
documented, counted repair instead of an error, chosen in config:

- ``data.nonfinite_dense: replace`` -- NaN/inf in a dense column becomes 0.0;
- ``data.overlong_sequence: truncate`` -- a sequence longer than its group's ``max_length`` keeps
  its newest ``max_length`` events (sequences are stored newest first, so the head of the list).

Ids at or beyond their table's size are hashed into range (id mod size) when the table says
``hash: true``, and are an error otherwise. A multi-valued event attribute (``max_values`` > 1)
holds a bag of ids per event: a bag longer than ``max_values`` is an error, or keeps its first
``max_values`` ids under ``overlong_sequence: truncate`` (counted the same way).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Callable, Collection, Dict, List, Optional, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pinads_rec.config import DataConfig, FeaturesConfig
from pinads_rec.data.loader import rules
from pinads_rec.data.loader.contract import (
    FLOAT,
    FLOAT_LIST,
    ID_ROLES,
    LABEL,
    PROB,
    SEQ_BAG,
    SEQ_ID,
    SEQ_TS,
    SEQUENCE_ROLES,
    SURFACE,
    TIME,
    Column,
    ContractError,
    Use,
    checked_columns,
    contract_columns,
    is_int_type,
    is_list_type,
    view_name,
)
from pinads_rec.data.loader.storage_layout import Requests, request_level_columns

log = logging.getLogger(__name__)


def _row(r: int) -> str:
    return f"row {r}"


class RowGroupChecker:
    """Checks and repairs one row group at a time; keeps the counts of every repair it made.

    Each column is checked once, for every use the config makes of it (the strictest check: ids
    against the smallest table that does not hash...); hashing and sequence truncation are applied
    per use (``Column.column_for``)."""

    def __init__(self, features: FeaturesConfig, data: DataConfig):
        self.features = features
        self.data = data
        self.columns = contract_columns(features)
        self.surface_index = pa.array(features.surfaces)
        self.repairs: Counter = Counter()
        self.names = checked_columns(self.columns)
        # Held once per request in memory (storage_layout.py): request-level columns and their derived ones.
        self.request_level = set(request_level_columns(features))
        self.request_level.update(d for c in self.columns if c.request_level for d in c.derived)

    def __call__(self, table: pa.Table, where: str) -> pa.Table:
        """A per-row row group -> the same with ids hashed, surfaces as indices, repairs applied (and
        the derived columns of ``Column.derived``)."""
        self._count_truncations(table.column, where)
        for c in self.columns:
            for name, fixed in self._check(c, table.column(c.name), f"{where}, column {c.name!r}", _row).items():
                table = _put(table, name, fixed)
        self._check_aligned(table.column, where, _row)
        return table

    def check_requests(self, block: Requests, where: str) -> Requests:
        """The same for a per-request row group split into ``Requests`` (``split_requests``): errors
        name the file's row (the request) and, for candidate-level columns, the candidate."""
        starts = block.offsets[:-1]

        def candidate(r: int) -> str:
            i = int(np.searchsorted(starts, r, side="right")) - 1
            return f"row {i}, candidate {r - int(starts[i])}"

        self._count_truncations(block.column, where)
        fixed: Dict[str, pa.Array] = {}
        beside: Dict[str, str] = {}
        for c in self.columns:
            locate = _row if c.name in block.request_table.column_names else candidate
            out = self._check(c, block.column(c.name), f"{where}, column {c.name!r}", locate)
            fixed.update(out)
            beside.update((n, c.name) for n in out)
        block = block.with_columns(fixed, beside)
        self._check_aligned(block.column, where, _row)
        return block

    def split_requests(self, table: pa.Table, where: str, request_level: Optional[Collection[str]] = None) -> Requests:
        """A per-request row group as ``Requests``: the ``request_level`` columns (default
        ``self.request_level``) once per request, the others flattened to one row per candidate.
        Every candidate column of a row holds the same number of values (at least one); a request
        id appears on one row."""
        request_level = self.request_level if request_level is None else request_level
        label = self.features.tasks[0].label_column
        ref = table.column(label).combine_chunks()
        if ref.null_count:
            row = int(np.flatnonzero(ref.is_null().to_numpy(zero_copy_only=False))[0])
            raise ContractError(f"{where}, column {label!r}: null value at row {row} (nulls are not allowed)")
        counts = pc.list_value_length(ref).to_numpy(zero_copy_only=False).astype(np.int64)
        if (counts == 0).any():
            row = int(np.argmax(counts == 0))
            raise ContractError(
                f"{where}, column {label!r}: row {row} has no candidates (a per-request row holds at least one)"
            )
        rows = {}
        for name in table.column_names:
            if name in request_level:
                continue
            col = table.column(name).combine_chunks()
            if col.null_count:
                row = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
                raise ContractError(f"{where}, column {name!r}: null value at row {row} (nulls are not allowed)")
            lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
            if (lengths != counts).any():
                row = int(np.argmax(lengths != counts))
                raise ContractError(
                    f"{where}, column {name!r}: row {row} holds {lengths[row]} candidate values but column "
                    f"{label!r} holds {counts[row]} (every candidate column of a request has one per candidate)"
                )
            rows[name] = col.flatten()
        rid = self.features.columns.request_id
        ids = table.column(rid).to_numpy()
        if len(np.unique(ids)) != len(ids):
            order = np.argsort(ids, kind="stable")
            dup = int(np.flatnonzero(ids[order][1:] == ids[order][:-1])[0])
            a, b = sorted((int(order[dup]), int(order[dup + 1])))
            raise ContractError(
                f"{where}, column {rid!r}: request {ids[a]} is on rows {a} and {b} (a per-request file holds "
                f"each request on one row)"
            )
        requests = table.select([n for n in table.column_names if n in request_level])
        return Requests(requests, pa.table(rows), np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))

    # --- one column -------------------------------------------------------------------------

    def _check(self, c: Column, col, place: str, locate: Callable[[int], str]) -> Dict[str, pa.Array]:
        """Checks every use of one column; returns the columns to set: the column itself when
        repaired or transformed in place, and its derived columns."""
        col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        if col.null_count:
            row = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
            raise ContractError(f"{place}: null value at {locate(row)} (nulls are not allowed)")
        inner = col
        while is_list_type(inner.type):
            inner = inner.flatten()
            if inner.null_count:
                i = int(np.flatnonzero(inner.is_null().to_numpy(zero_copy_only=False))[0])
                raise ContractError(f"{place}: null inside a list (value #{i}; nulls are not allowed)")
        out: Dict[str, pa.Array] = {}
        roles = {u.role for u in c.uses}
        seq_uses = [u for u in c.uses if u.role in SEQUENCE_ROLES]
        if seq_uses and self.data.overlong_sequence == "error":
            u = min(seq_uses, key=lambda u: u.max_length)
            lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
            if lengths.size and lengths.max() > u.max_length:
                row = int(np.argmax(lengths > u.max_length))
                group = "the group's" if len(c.uses) == 1 else f"group {u.group!r}'s"
                raise ContractError(
                    f"{place}: {locate(row)} has a sequence of {lengths[row]} events, "
                    f"more than {group} max_length {u.max_length}"
                )
        bag_uses = [u for u in c.uses if u.role == SEQ_BAG]
        if bag_uses and self.data.overlong_sequence == "error":
            u = min(bag_uses, key=lambda u: u.max_values)
            sizes = pc.list_value_length(col.flatten()).to_numpy(zero_copy_only=False)
            if sizes.size and sizes.max() > u.max_values:
                event = int(np.argmax(sizes > u.max_values))
                row = int(np.searchsorted(_offsets(col).to_numpy(), event, side="right")) - 1
                raise ContractError(
                    f"{place}: {locate(row)} has an event (#{event} of the row group) with {sizes[event]} ids, "
                    f"more than {u.what}'s max_values {u.max_values}"
                )
        id_uses = [u for u in c.uses if u.role in ID_ROLES]
        if id_uses:
            self._check_ids(c, col, id_uses, place, locate)
        if roles & {FLOAT, FLOAT_LIST}:
            fixed = self._check_floats(c, col, place, locate)
            if fixed is not None:
                out[c.name] = col = fixed
        if LABEL in roles:
            y = col.to_numpy(zero_copy_only=False)
            bad = rules.LABEL.broken(y)
            if bad.any():
                row = int(np.argmax(bad))
                raise ContractError(f"{place}: label {y[row]} at {locate(row)} is not 0 or 1", rules.LABEL)
        if PROB in roles:
            p = col.to_numpy(zero_copy_only=False)
            bad = rules.PROBABILITY.broken(p)
            if bad.any():
                row = int(np.argmax(bad))
                raise ContractError(
                    f"{place}: probability {p[row]} at {locate(row)} is outside [0, 1]", rules.PROBABILITY
                )
        if SURFACE in roles:
            out[c.name] = self._surface_index(col, place, locate)
        if TIME in roles or SEQ_TS in roles:
            t = _leaves(col).to_numpy(zero_copy_only=False).astype(np.float64)
            bad = rules.TIMESTAMP.broken(t)
            if bad.any():
                i = int(np.argmax(bad))
                row = i if not is_list_type(col.type) else int(np.searchsorted(_leaf_offsets(col), i, side="right")) - 1
                raise ContractError(
                    f"{place}: timestamp {t[i]:.0f} at {locate(row)} is outside 1990..2100 ({rules.TIMESTAMP.hint})",
                    rules.TIMESTAMP,
                )
        views = c.views
        for view in views:
            if view != (0, 0, 0):
                name = c.name if len(views) == 1 else view_name(c.name, view)
                out[name] = _apply_view(col, view)
        return out

    def _check_ids(self, c: Column, col: pa.Array, uses: List[Use], place: str, locate) -> None:
        """Ids >= 0, and below the smallest table that does not hash; only the values some use
        reads: sequences only as far as the longest group keeps them."""
        if all(u.role in (SEQ_ID, SEQ_BAG) for u in uses):
            keep = max(u.max_length for u in uses)
            values = max(u.max_values for u in uses)
            if self.data.overlong_sequence == "truncate":
                col = _apply_view(col, (0, keep, values))
        ids = _leaves(col).to_numpy(zero_copy_only=False)
        if not ids.size:
            return

        def where_is(value: int) -> str:
            if not is_list_type(col.type):
                return f"{locate(value)}, value #{value}"
            row = int(np.searchsorted(_leaf_offsets(col), value, side="right")) - 1
            return f"{locate(row)}, value #{value} of the row group"

        if ids.min() < 0:
            bad = int(np.argmax(rules.NEGATIVE_ID.broken(ids)))
            raise ContractError(f"{place}: negative id {ids[bad]} ({where_is(bad)})", rules.NEGATIVE_ID)
        bounded = [u for u in uses if not (u.hashed or u.managed)]
        if bounded:
            u = min(bounded, key=lambda u: u.table_size)
            beyond = rules.id_beyond(u.table_size)
            if ids.max() >= u.table_size:
                bad = int(np.argmax(beyond.broken(ids)))
                bound = f"its table's size {u.table_size}"
                if len(c.uses) > 1:
                    bound = f"the table size {u.table_size} of {u.what}"
                raise ContractError(
                    f"{place}: id {ids[bad]} is beyond {bound} ({where_is(bad)}); enlarge the table or set hash: true",
                    beyond,
                )

    def _check_floats(self, c: Column, col: pa.Array, place: str, locate) -> Optional[pa.Array]:
        vector = is_list_type(col.type)
        values = (col.flatten() if vector else col).to_numpy(zero_copy_only=False)
        values = np.asarray(values, dtype=np.float32)
        if vector:
            lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
            if lengths.size and (lengths != c.uses[0].dim).any():
                row = int(np.argmax(lengths != c.uses[0].dim))
                raise ContractError(
                    f"{place}: {locate(row)} has {lengths[row]} values, the config declares dim {c.uses[0].dim}"
                )
        bad = ~np.isfinite(values)
        if not bad.any():
            return None
        if self.data.nonfinite_dense == "error":
            i = int(np.argmax(bad))
            row = i // c.uses[0].dim if vector else i
            raise ContractError(
                f"{place}: non-finite value {values[i]} at {locate(row)} (value #{i}); "
                "fix the data or set data.nonfinite_dense: replace"
            )
        self._count(f"{c.name}: non-finite replaced by 0", int(bad.sum()), place)
        values = np.where(bad, np.float32(0), values)
        return pa.FixedSizeListArray.from_arrays(pa.array(values), c.uses[0].dim) if vector else pa.array(values)

    def _surface_index(self, col: pa.Array, place: str, locate) -> pa.Array:
        if is_int_type(col.type):
            idx = col.to_numpy(zero_copy_only=False)
            bad = (idx < 0) | (idx >= len(self.features.surfaces))
        else:
            idx = pc.index_in(col.cast(pa.string()), value_set=self.surface_index).to_numpy(zero_copy_only=False)
            bad = np.isnan(idx) if idx.dtype.kind == "f" else np.zeros(len(idx), bool)
        if bad.any():
            row = int(np.argmax(bad))
            raise ContractError(
                f"{place}: unknown surface {col[row].as_py()!r} at {locate(row)} "
                f"(features.surfaces lists {self.features.surfaces})"
            )
        return pa.array(np.asarray(idx, dtype=np.int64))

    def _count_truncations(self, column: Callable[[str], pa.ChunkedArray], where: str) -> None:
        """With overlong_sequence: truncate, counts each group's truncated sequences once (on its
        first id column, before any column is cut)."""
        if self.data.overlong_sequence != "truncate":
            return
        for g in self.features.sequence_groups:
            name = g.features[0].column
            lengths = pc.list_value_length(column(name)).to_numpy(zero_copy_only=False)
            n = int((np.nan_to_num(lengths, nan=0) > g.max_length).sum())
            if n:
                # Counted, but logged at INFO: reading the newest max_length events of a longer
                # stored history is the policy the config chose, not a fault in the data.
                self._count(
                    f"sequence group {g.name}: truncated to newest {g.max_length}",
                    n,
                    f"{where}, column {name!r}",
                    logging.INFO,
                )
            for f in g.features:
                if not f.multi_valued:
                    continue
                col = column(f.column)
                col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
                events = pc.list_slice(col, 0, g.max_length).flatten()
                sizes = pc.list_value_length(events).to_numpy(zero_copy_only=False)
                n = int((sizes > f.max_values).sum())
                if n:
                    self._count(
                        f"sequence group {g.name} feature {f.name}: bags cut to their first {f.max_values} ids",
                        n,
                        f"{where}, column {f.column!r}",
                    )

    def _check_aligned(self, column: Callable[[str], pa.ChunkedArray], where: str, locate) -> None:
        for g in self.features.sequence_groups:
            uses = [(g.timestamp_column, ("timestamp", g.name))]
            uses += [(f.column, ("sequence", g.name, f.name)) for f in g.features]
            uses += [(g.embedding_column, ("embedding", g.name))] if g.embedding_column else []
            (first, key), rest = uses[0], uses[1:]
            ref = pc.list_value_length(column(self.names[key])).to_numpy(zero_copy_only=False)
            for name, key in rest:
                lengths = pc.list_value_length(column(self.names[key])).to_numpy(zero_copy_only=False)
                if (lengths != ref).any():
                    row = int(np.argmax(lengths != ref))
                    raise ContractError(
                        f"{where}: ragged sequence group {g.name!r} at {locate(row)}: column {name!r} has "
                        f"{lengths[row]} events but {first!r} has {ref[row]}"
                    )
            if g.embedding_column:
                emb = column(self.names[("embedding", g.name)])
                emb = emb.combine_chunks() if isinstance(emb, pa.ChunkedArray) else emb
                inner = pc.list_value_length(emb.flatten()).to_numpy(zero_copy_only=False)
                if inner.size and (inner != g.embedding_dim).any():
                    raise ContractError(
                        f"{where}, column {g.embedding_column!r}: event embeddings of width "
                        f"{int(inner[inner != g.embedding_dim][0])}, config says {g.embedding_dim}"
                    )

    def _count(self, what: str, n: int, place: str, level: int = logging.WARNING) -> None:
        self.repairs[what] += n
        log.log(level, "%s: repaired %d value(s): %s", place, n, what)


def _apply_view(col: pa.Array, view: Tuple[int, int, int]) -> pa.Array:
    """``col`` cut to its newest ``view[1]`` events (sequences are newest first; 0: uncut), each
    event's bag to its first ``view[2]`` ids (0: uncut), then its ids mod ``view[0]`` (0: as they
    are). The same array when none changes a value."""
    mod, keep, values = view
    if keep:
        lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
        if lengths.size and lengths.max() > keep:
            col = pc.list_slice(col, 0, keep)
    if values:
        events = col.flatten()
        sizes = pc.list_value_length(events).to_numpy(zero_copy_only=False)
        if sizes.size and sizes.max() > values:
            col = pa.ListArray.from_arrays(_offsets(col), pc.list_slice(events, 0, values))
    if mod:
        ids = _leaves(col).to_numpy(zero_copy_only=False)
        if ids.size and ids.max() >= mod:
            col = _with_leaves(col, pa.array(ids % mod))
    return col


def _leaves(col: pa.Array) -> pa.Array:
    """The ids of a column: itself, or its lists' (and their lists') values, flattened."""
    while is_list_type(col.type):
        col = col.flatten()
    return col


def _with_leaves(col: pa.Array, leaves: pa.Array) -> pa.Array:
    """``col``'s nesting around other ids (as many as ``_leaves(col)``)."""
    if not is_list_type(col.type):
        return leaves
    return pa.ListArray.from_arrays(_offsets(col), _with_leaves(col.flatten(), leaves))


def _leaf_offsets(col: pa.Array) -> np.ndarray:
    """Per row of a (nested) list column, where its ids start among ``_leaves(col)``, and the end."""
    offsets = _offsets(col).to_numpy()
    inner = col.flatten()
    while is_list_type(inner.type):
        offsets = _offsets(inner).to_numpy()[offsets]
        inner = inner.flatten()
    return offsets


def _put(table: pa.Table, name: str, array: pa.Array) -> pa.Table:
    idx = table.schema.get_field_index(name)
    return table.append_column(name, array) if idx < 0 else table.set_column(idx, name, array)


def _offsets(col: pa.Array) -> pa.Array:
    lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
    return pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
