"""The data contract: which columns a config needs, their roles and Arrow types, and the schema check.

``contract_columns(features)`` lists every column the config reads, once, with each use it makes of
the column (``Column``, ``Use``): a feature's ids, a label, a sequence's timestamps... Two uses of one
column must read the same data. ``check_schema`` fails at open, naming the file and column, when a
column is missing or of the wrong type; ``RowGroupChecker`` (data/loader/row_group_checker.py)
checks and repairs the values of every row group. Both raise ``ContractError``, as do the build,
inspect and serve for input data that breaks the contract.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Collection, Dict, List, Optional, Tuple

import pyarrow as pa

from pinads_rec.config import FeaturesConfig
from pinads_rec.data.loader import rules
from pinads_rec.data.loader.storage_layout import request_level_columns


class ContractError(ValueError):
    """Input data that breaks the contract; the message says where (file, row group, column), and
    ``rule`` which data rule failed (``pinads_rec.data.loader.rules``), where one did."""

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
    per-request layout (data/loader/storage_layout.py)."""

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


def is_int_type(t: pa.DataType) -> bool:
    return pa.types.is_integer(t)


def is_num_type(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t)


def is_list_type(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _type_ok(role: str, t: pa.DataType) -> bool:
    if role in (ID, REQUEST):
        return is_int_type(t) or (role == ID and is_list_type(t) and is_int_type(t.value_type))
    if role in (FLOAT, LABEL, PROB, TIME):
        return is_num_type(t)
    if role == FLOAT_LIST:
        return is_list_type(t) and is_num_type(t.value_type)
    if role in (SEQ_ID, SEQ_TS):
        return is_list_type(t) and is_int_type(t.value_type)
    if role == SEQ_BAG:
        return is_list_type(t) and is_list_type(t.value_type) and is_int_type(t.value_type.value_type)
    if role == SEQ_EMB:
        return is_list_type(t) and is_list_type(t.value_type) and is_num_type(t.value_type.value_type)
    if role == SURFACE:
        return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_dictionary(t) or is_int_type(t)
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
    ``storage_layout.stored_request_level``; default the config's) is a list of its per-row type, one per
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
