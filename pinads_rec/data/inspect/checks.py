"""The checks of the scan: one SQL expression per contract problem, counted and located in one
aggregate pass (``column_checks`` per contract column, ``group_checks`` per sequence group), and the
SQL quoting the scan and the draft share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import pyarrow as pa

from pinads_rec.config import DataConfig, FeaturesConfig
from pinads_rec.data.loader import rules
from pinads_rec.data.loader.contract import (
    FLOAT,
    FLOAT_LIST,
    ID,
    LABEL,
    PROB,
    SEQ_BAG,
    SEQ_EMB,
    SEQ_ID,
    SEQ_TS,
    SURFACE,
    TIME,
    Column,
    is_list_type,
)
from pinads_rec.data.sql_text import sql_name, sql_string

# What the loader does with a problem.
ERROR = "error"
UNCHECKED = "read unchecked"


@dataclass
class Check:
    kind: str
    column: str
    unit: str
    loader: str
    count_sql: str  # per view row: how many of this problem it holds
    detail: str = ""


def count_if(cond: str) -> str:
    return f"CASE WHEN {cond} THEN 1 ELSE 0 END"


def count_in(list_sql: str, cond: str, cheap_test: Optional[str] = None) -> str:
    """How many elements of a list meet ``cond``; ``cheap_test`` (a whole-list test, e.g. on its
    minimum) skips the lambda on the rows that cannot hold one (DuckDB's CASE runs lazily)."""
    exact = f"coalesce(len(list_filter({list_sql}, lambda e: {cond})), 0)"
    return exact if cheap_test is None else f"CASE WHEN {cheap_test} THEN {exact} ELSE 0 END"


def _nested_depth(t: pa.DataType) -> int:
    d = 0
    while is_list_type(t):
        t, d = t.value_type, d + 1
    return d


def column_checks(c: Column, t: pa.DataType, data: DataConfig, features: FeaturesConfig) -> List[Check]:
    """The value checks of one contract column whose (per-row) Arrow type ``t`` the contract accepts."""
    x = sql_name(c.name)
    out = []
    depth = _nested_depth(t)
    if depth:
        flat = x
        for _ in range(depth - 1):
            flat = f"flatten({flat})"
        out.append(
            Check("null inside a list", c.name, "values", ERROR, f"coalesce(len({flat}) - list_count({flat}), 0)")
        )
    if c.role in (ID, SEQ_ID, SEQ_BAG):
        # The loader truncates a sequence before it checks the ids: only the kept head is seen.
        vals = x
        if c.role in (SEQ_ID, SEQ_BAG) and data.overlong_sequence == "truncate":
            vals = f"{x}[1:{c.max_length}]"
        if c.role == SEQ_BAG:
            max_values = min(u.max_values for u in c.uses if u.role == SEQ_BAG)
            if data.overlong_sequence == "truncate":
                vals = f"flatten(list_transform({vals}, lambda b: b[1:{max_values}]))"
            else:
                out.append(
                    Check(
                        "bag longer than max_values",
                        c.name,
                        "events",
                        ERROR,
                        count_in(x, f"len(e) > {max_values}"),
                        f"max_values {max_values} (set data.overlong_sequence: truncate to keep the first ids)",
                    )
                )
                vals = f"flatten({vals})"
        negative = rules.NEGATIVE_ID
        if depth:
            neg = count_in(vals, negative.where("e"), negative.where(f"list_min({vals})"))
        else:
            neg = count_if(negative.where(x))
        out.append(Check(negative.kind, c.name, "values", ERROR, neg))
        if not c.hashed:
            beyond = rules.id_beyond(c.table_size)
            if depth:
                count = count_in(vals, beyond.where("e"), beyond.where(f"list_max({vals})"))
            else:
                count = count_if(beyond.where(x))
            out.append(
                Check(
                    beyond.kind,
                    c.name,
                    "values",
                    ERROR,
                    count,
                    f"table size {c.table_size}, hash: false (enlarge the table or set hash: true)",
                )
            )
    elif c.role == FLOAT:
        out.append(_nonfinite(c, count_if(f"NOT isfinite({x}::DOUBLE)"), data))
    elif c.role == FLOAT_LIST:
        out.append(Check("wrong dense width", c.name, "rows", ERROR, count_if(f"len({x}) != {c.dim}"), f"dim {c.dim}"))
        test = f"NOT isfinite(list_sum({x}::DOUBLE[]))"
        out.append(_nonfinite(c, count_in(x, "NOT isfinite(e::DOUBLE)", test), data))
    elif c.role == LABEL:
        out.append(Check(rules.LABEL.kind, c.name, "rows", ERROR, count_if(rules.LABEL.where(x))))
    elif c.role == PROB:
        out.append(Check(rules.PROBABILITY.kind, c.name, "rows", ERROR, count_if(rules.PROBABILITY.where(x))))
    elif c.role == SURFACE:
        n = len(features.surfaces)
        if pa.types.is_integer(t):
            bad = f"{x} < 0 OR {x} >= {n}"
        else:
            bad = f"{x}::VARCHAR NOT IN ({', '.join(sql_string(s) for s in features.surfaces)})"
        out.append(Check("unknown surface", c.name, "rows", ERROR, count_if(bad), f"surfaces {features.surfaces}"))
    elif c.role == TIME:
        out.append(
            Check(
                rules.TIMESTAMP.kind,
                c.name,
                "rows",
                ERROR,
                count_if(rules.TIMESTAMP.where(f"{x}::DOUBLE")),
                rules.TIMESTAMP.hint,
            )
        )
    elif c.role == SEQ_TS:
        stamp = rules.TIMESTAMP
        count = count_in(
            x,
            stamp.where("e::DOUBLE"),
            f"{stamp.where(f'list_min({x})::DOUBLE')} OR {stamp.where(f'list_max({x})::DOUBLE')}",
        )
        out.append(Check(stamp.kind, c.name, "events", ERROR, count, stamp.hint))
    elif c.role == SEQ_EMB:
        dim = next(g.embedding_dim for g in features.sequence_groups if g.name == c.group)
        out.append(
            Check(
                "wrong event embedding width",
                c.name,
                "events",
                ERROR,
                count_in(x, f"len(e) != {dim}", f"len(flatten({x})) != {dim} * len({x})"),
                f"embedding_dim {dim}",
            )
        )
    return out


def _nonfinite(c: Column, count_sql: str, data: DataConfig) -> Check:
    loader = ERROR if data.nonfinite_dense == "error" else "repaired: replaced by 0"
    return Check(
        "non-finite dense value", c.name, "values", loader, count_sql, f"data.nonfinite_dense: {data.nonfinite_dense}"
    )


def group_checks(features: FeaturesConfig, data: DataConfig, usable: Dict[str, Column]) -> List[Check]:
    """Per sequence group: ragged columns, overlong sequences, events at or after the impression,
    events not newest first."""
    out = []
    ts_col = features.columns.timestamp
    for g in features.sequence_groups:
        ts = g.timestamp_column
        if ts not in usable:
            continue
        cols = [f.column for f in g.features] + ([g.embedding_column] if g.embedding_column else [])
        for name in dict.fromkeys(cols):
            if name in usable and name != ts:
                out.append(
                    Check(
                        "ragged sequence group",
                        name,
                        "rows",
                        ERROR,
                        count_if(f"len({sql_name(name)}) != len({sql_name(ts)})"),
                        f"group {g.name!r}: its length differs from {ts!r}",
                    )
                )
        loader = f"repaired: truncated to the newest {g.max_length}" if data.overlong_sequence == "truncate" else ERROR
        out.append(
            Check(
                "sequence longer than max_length",
                ts,
                "rows",
                loader,
                count_if(f"len({sql_name(ts)}) > {g.max_length}"),
                f"group {g.name!r}, max_length {g.max_length}, data.overlong_sequence: {data.overlong_sequence}",
            )
        )
        if ts_col in usable:
            out.append(
                Check(
                    "sequence event at or after the impression",
                    ts,
                    "rows",
                    UNCHECKED,
                    count_if(f"list_max({sql_name(ts)}) >= {sql_name(ts_col)}"),
                    f"group {g.name!r}: a leak of the future into the features",
                )
            )
        out.append(
            Check(
                "sequence not newest first",
                ts,
                "rows",
                UNCHECKED,
                count_if(
                    f"NOT list_has_any({sql_name(ts)}, [NULL]) AND {sql_name(ts)} != list_reverse_sort({sql_name(ts)})"
                ),
                f"group {g.name!r}: truncation keeps the head of the list",
            )
        )
    return out
