"""The data contract: which columns a config needs, their types, and the checks on every row group.

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

import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Collection, Dict, List, Optional, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pinads_rec.config import DataConfig, FeaturesConfig
from pinads_rec.data import rules
from pinads_rec.data.storage_layout import Requests, request_level_columns

log = logging.getLogger(__name__)


class ContractError(ValueError):
    """Input data that breaks the contract; the message says where (file, row group, column), and
    ``rule`` which data rule failed (``pinads_rec.data.rules``), where one did."""

    def __init__(self, message: str, rule: Optional[rules.Rule] = None):
        super().__init__(message)
        self.rule = rule


# Column roles: what the loader does with each column and which Arrow types it accepts.
ID, FLOAT, FLOAT_LIST, SEQ_ID, SEQ_BAG, SEQ_TS, SEQ_EMB, LABEL, PROB, SURFACE, TIME, REQUEST = (
    "id",
    "float",
    "fixed-size float list",
    "sequence id list",
    "sequence id bag list",
    "sequence timestamp list",
    "sequence embedding list",
    "0/1 label",
    "probability",
    "surface",
    "timestamp",
    "request id",
)


ID_ROLES = (ID, SEQ_ID, SEQ_BAG)
SEQUENCE_ROLES = (SEQ_ID, SEQ_BAG, SEQ_TS, SEQ_EMB)
# Roles whose column feeds nothing else: a label or true probability read as an input would leak the
# answer; the surface column is read as a name into features.surfaces; vectors are only vectors.
_EXCLUSIVE = {
    LABEL: "a label read as a model input would leak the answer",
    PROB: "a true probability read as a model input would leak the answer",
    SURFACE: "the surface column is read as a surface name (an index into features.surfaces)",
    FLOAT_LIST: "a dense vector column feeds dense vectors of one width only",
    SEQ_EMB: "a sequence embedding column feeds sequence embeddings of one width only",
}
# The kinds of stored values each other role accepts: two uses of a column must share one.
_KINDS = {
    ID: {"integer", "list of integers"},
    REQUEST: {"integer"},
    TIME: {"integer", "float"},
    FLOAT: {"integer", "float"},
    SEQ_ID: {"list of integers"},
    SEQ_BAG: {"list of integer lists"},
    SEQ_TS: {"list of integers"},
}


@dataclass(frozen=True)
class Use:
    """One way the config reads a column: a feature, a label, the request id..."""

    role: str
    what: str  # names the use in messages: "sparse feature 'query_tokens'"
    key: Tuple[str, ...]  # ("sparse", name), ("sequence", group, feature), ("timestamp", group), ...
    table_size: int = 0  # id roles: the embedding table's size
    hashed: bool = False
    managed: bool = False  # a managed-collision table's: raw ids, any int64 >= 0 (TorchRec maps them)
    dim: int = 1  # float lists / sequence embeddings
    group: Optional[str] = None  # sequence roles: the group
    max_length: int = 0
    max_values: int = 0  # SEQ_BAG: ids per event at most

    @property
    def view(self) -> Tuple[int, int, int]:
        """What the loader does to the column's values for this use: (ids mod this, 0: none;
        sequences cut to their newest this many, 0: none; bags cut to their first this many, 0: none)."""
        return (
            self.table_size if self.hashed and self.role in ID_ROLES else 0,
            self.max_length if self.role in SEQUENCE_ROLES else 0,
            self.max_values if self.role == SEQ_BAG else 0,
        )


@dataclass(frozen=True)
class Column:
    """One Parquet column and every use the config makes of it (a column may feed several features:
    pooled and sequence, two groups...). ``request_level``: stored once per request in the
    per-request layout (data/storage_layout.py)."""

    name: str
    uses: Tuple[Use, ...]
    request_level: bool = False

    @property
    def role(self) -> str:
        return self.uses[0].role

    @property
    def roles(self) -> str:
        """The uses, for messages: "id (sparse feature 'x') and sequence id list (...)"."""
        if len(self.uses) == 1:
            return self.role
        return " and ".join(f"{u.role} ({u.what})" for u in self.uses)

    # The strictest reading over the uses, for reports of a whole column (data/inspect/).
    @property
    def hashed(self) -> bool:
        """Every id use hashes: no id is out of range."""
        ids = [u for u in self.uses if u.role in ID_ROLES]
        return bool(ids) and all(u.hashed for u in ids)

    @property
    def bounded(self) -> bool:
        """Some id use must fit its table (one that neither hashes nor is managed)."""
        return any(u.role in ID_ROLES and not (u.hashed or u.managed) for u in self.uses)

    @property
    def table_size(self) -> int:
        """The smallest table an id must fit (a use that hashes fits any id)."""
        sizes = [u.table_size for u in self.uses if u.role in ID_ROLES and not (u.hashed or u.managed)]
        sizes = sizes or [u.table_size for u in self.uses if u.role in ID_ROLES]
        return min(sizes, default=0)

    @property
    def max_length(self) -> int:
        """The shortest sequence cap among the uses (0: no sequence use)."""
        return min((u.max_length for u in self.uses if u.role in SEQUENCE_ROLES), default=0)

    @property
    def dim(self) -> int:
        return self.uses[0].dim

    @property
    def group(self) -> Optional[str]:
        return self.uses[0].group

    @property
    def views(self) -> List[Tuple[int, int]]:
        return list(dict.fromkeys(u.view for u in self.uses))

    def column_for(self, use: Use) -> str:
        """The checked table's column holding ``use``'s values: the column itself, its values hashed
        and cut in place, when every use agrees on that; otherwise, for a use that hashes or cuts, a
        derived column beside it (the column keeps its values as read)."""
        if len(self.views) == 1 or use.view == (0, 0, 0):
            return self.name
        return view_name(self.name, use.view)

    @property
    def derived(self) -> List[str]:
        """The derived columns the checker adds beside this one (see ``column_for``)."""
        if len(self.views) == 1:
            return []
        return [view_name(self.name, v) for v in self.views if v != (0, 0, 0)]


def view_name(column: str, view: Tuple[int, int, int]) -> str:
    return f"__view_{column}__mod{view[0]}_newest{view[1]}_values{view[2]}"


def contract_columns(features: FeaturesConfig) -> List[Column]:
    """Every column the config reads, once, with all its uses (in config order). Two uses of one
    column must be compatible (the same data either way); otherwise a ContractError names both."""
    uses: Dict[str, List[Use]] = {}

    def add(name: str, use: Use) -> None:
        uses.setdefault(name, []).append(use)

    names = features.columns
    add(names.request_id, Use(REQUEST, "columns.request_id", ("request",)))
    add(names.surface, Use(SURFACE, "columns.surface", ("surface",)))
    add(names.timestamp, Use(TIME, "columns.timestamp", ("timestamp",)))
    for s in features.sparse:
        t = features.table(s.table)
        # One id or a list (decided by the file's type).
        managed = t.managed_collision is not None
        add(s.column, Use(ID, f"sparse feature {s.name!r}", ("sparse", s.name), t.num_embeddings, t.hash, managed))
    for d in features.dense:
        add(
            d.column,
            Use(FLOAT if d.dim == 1 else FLOAT_LIST, f"dense feature {d.name!r}", ("dense", d.name), dim=d.dim),
        )
    for g in features.sequence_groups:
        seq = dict(group=g.name, max_length=g.max_length)
        add(g.timestamp_column, Use(SEQ_TS, f"sequence group {g.name!r} timestamps", ("timestamp", g.name), **seq))
        for f in g.features:
            t = features.table(f.table)
            managed = t.managed_collision is not None
            what = f"sequence group {g.name!r} feature {f.name!r}"
            if f.multi_valued:
                use = Use(SEQ_BAG, what, ("sequence", g.name, f.name), t.num_embeddings, t.hash, managed, **seq)
                add(f.column, dataclasses.replace(use, max_values=f.max_values))
            else:
                add(f.column, Use(SEQ_ID, what, ("sequence", g.name, f.name), t.num_embeddings, t.hash, managed, **seq))
        if g.embedding_column:
            what = f"sequence group {g.name!r} embeddings"
            add(g.embedding_column, Use(SEQ_EMB, what, ("embedding", g.name), dim=g.embedding_dim, **seq))
    for task in features.tasks:
        add(task.label_column, Use(LABEL, f"task {task.name!r} label", ("label", task.name)))
        if task.true_probability_column:
            add(task.true_probability_column, Use(PROB, f"task {task.name!r} true probability", ("prob", task.name)))
    request_level = set(request_level_columns(features))
    for name, column_uses in uses.items():
        for i, a in enumerate(column_uses):
            for b in column_uses[i + 1 :]:
                _check_compatible(name, a, b)
    return [Column(name, tuple(u), name in request_level) for name, u in uses.items()]


def _check_compatible(name: str, a: Use, b: Use) -> None:
    reason = None
    for x, y in ((a, b), (b, a)):
        if x.role in _EXCLUSIVE and (y.role != x.role or y.dim != x.dim):
            reason = _EXCLUSIVE[x.role]
            break
    if reason is None and a.role not in _EXCLUSIVE and not _KINDS[a.role] & _KINDS[b.role]:
        reason = f"one needs {_EXPECTED[a.role]}, the other {_EXPECTED[b.role]}"
    if reason:
        raise ContractError(
            f"config uses column {name!r} as both {a.role} ({a.what}) and {b.role} ({b.what}): {reason}"
        )


def checked_columns(columns: List[Column]) -> Dict[Tuple[str, ...], str]:
    """Use key (``Use.key``) -> the checked table's column holding its values (``Column.column_for``)."""
    return {u.key: c.column_for(u) for c in columns for u in c.uses}


def _is_int(t: pa.DataType) -> bool:
    return pa.types.is_integer(t)


def _is_num(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _type_ok(role: str, t: pa.DataType) -> bool:
    if role in (ID, REQUEST):
        return _is_int(t) or (role == ID and _is_list(t) and _is_int(t.value_type))
    if role in (FLOAT, LABEL, PROB, TIME):
        return _is_num(t)
    if role == FLOAT_LIST:
        return _is_list(t) and _is_num(t.value_type)
    if role in (SEQ_ID, SEQ_TS):
        return _is_list(t) and _is_int(t.value_type)
    if role == SEQ_BAG:
        return _is_list(t) and _is_list(t.value_type) and _is_int(t.value_type.value_type)
    if role == SEQ_EMB:
        return _is_list(t) and _is_list(t.value_type) and _is_num(t.value_type.value_type)
    if role == SURFACE:
        return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_dictionary(t) or _is_int(t)
    raise AssertionError(role)


_EXPECTED = {
    ID: "int64 or list<int64>",
    REQUEST: "integer",
    FLOAT: "float",
    LABEL: "integer or float 0/1",
    PROB: "float",
    TIME: "integer or float seconds",
    FLOAT_LIST: "list<float>",
    SEQ_ID: "list<int64>",
    SEQ_BAG: "list<list<int64>>",
    SEQ_TS: "list<int64>",
    SEQ_EMB: "list<fixed_size_list<float>>",
    SURFACE: "string (or integer index)",
}


def check_schema(
    path: str,
    schema: pa.Schema,
    columns: List[Column],
    per_request: bool = False,
    request_level: Optional[Collection[str]] = None,
) -> None:
    """Fail at open, naming the file and column, when a column is missing or of the wrong type. In a
    ``per_request`` file a column not stored per request (``request_level``: the file's, see
    ``layout.stored_request_level``; default the config's) is a list of its per-row type, one per
    candidate."""
    for c in columns:
        idx = schema.get_field_index(c.name)
        if idx < 0:
            raise ContractError(f"{path}: missing column {c.name!r} (the config uses it as {c.roles})")
        t = schema.field(idx).type
        stored_once = c.request_level if request_level is None else c.name in request_level
        per_candidate = per_request and not stored_once
        if per_candidate:
            if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
                raise ContractError(
                    f"{path}: column {c.name!r} has type {t}, expected list<{_EXPECTED[c.role]}> (one value per "
                    f"candidate: the file is per request, its label column being a list)"
                )
            t = t.value_type
        for u in c.uses:
            if not _type_ok(u.role, t):
                used_as = u.role if len(c.uses) == 1 else f"{u.role}, {u.what}"
                per = ", per candidate of a per-request file" if per_candidate else ""
                raise ContractError(
                    f"{path}: column {c.name!r} has type {t}, expected {_EXPECTED[u.role]} ({used_as}{per})"
                )


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
        # Held once per request in memory (data/storage_layout.py): request-level columns and their derived ones.
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
        while _is_list(inner.type):
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
                row = i if not _is_list(col.type) else int(np.searchsorted(_leaf_offsets(col), i, side="right")) - 1
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
            if not _is_list(col.type):
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
        vector = _is_list(col.type)
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
        if _is_int(col.type):
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
    while _is_list(col.type):
        col = col.flatten()
    return col


def _with_leaves(col: pa.Array, leaves: pa.Array) -> pa.Array:
    """``col``'s nesting around other ids (as many as ``_leaves(col)``)."""
    if not _is_list(col.type):
        return leaves
    return pa.ListArray.from_arrays(_offsets(col), _with_leaves(col.flatten(), leaves))


def _leaf_offsets(col: pa.Array) -> np.ndarray:
    """Per row of a (nested) list column, where its ids start among ``_leaves(col)``, and the end."""
    offsets = _offsets(col).to_numpy()
    inner = col.flatten()
    while _is_list(inner.type):
        offsets = _offsets(inner).to_numpy()[offsets]
        inner = inner.flatten()
    return offsets


def _put(table: pa.Table, name: str, array: pa.Array) -> pa.Table:
    idx = table.schema.get_field_index(name)
    return table.append_column(name, array) if idx < 0 else table.set_column(idx, name, array)


def _offsets(col: pa.Array) -> pa.Array:
    lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
    return pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))


def summarize_repairs(repairs: Counter) -> List[Tuple[str, int]]:
    return sorted(repairs.items())
