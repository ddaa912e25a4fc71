"""The raw data's checks on the way through a build: times, nulls, labels, id types and ranges,
surfaces, the side tables' defaults, and a failed step's expressions named by their config keys.
Each error names the file, column and row; each repair (a side table's default, a dropped
surface) is counted in the summary, and so, apart, are the rows a CASE gave its own ELSE.

Each check is a function over the build (``build``: full_build.Build): it reads the tables its steps
made (``imp``, the events tables) and its state (``b``, ``features``, ``columns``, ``computed``,
``imp_source``, ``side_sources``, ``group_sources``), and adds to its ``counts`` (repairs and
drops) and ``case_else``.
"""

from __future__ import annotations

import json
import re
from typing import Dict, List, Optional

import duckdb

from pinads_rec.data.build.queries import INTEGERS
from pinads_rec.data.loader import rules
from pinads_rec.data.loader.contract import ID, ID_ROLES, ContractError
from pinads_rec.data.raw_sources import RawSource
from pinads_rec.data.sql_text import column_value, columns_read, first_line, sql_name, sql_string

# DuckDB's parser, for the config's expressions (written in its dialect whatever the engine).
_PARSER = duckdb.connect()
# A column name SQL reads without double quotes.
_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Bare names DuckDB reads as a value of the session where no column has them: ``user`` over a log
# that lost its user column is 'duckdb' on every row, not a missing column.
SESSION_NAMES = {
    "user",
    "current_user",
    "session_user",
    "current_role",
    "current_schema",
    "current_catalog",
    "current_date",
    "current_time",
    "current_timestamp",
    "localtime",
    "localtimestamp",
}


def check_times(build, table: str, column: str, source: RawSource, expr: str, where: str) -> None:
    """Each time (``column`` of ``table``, SQL ``expr`` over the raw file) present and in 1990..2100;
    an error names the first bad row's file, line, column and value."""
    _refuse_nulls(build, table, column, source, expr, where, "timestamp(s) missing or unparsable")
    stamp = rules.TIMESTAMP
    bad = build.one(
        f"SELECT __file, count(*), min({column}), max({column}) FROM {table} "
        f"WHERE {stamp.where(column)} GROUP BY __file LIMIT 1"
    )
    if bad:
        total = build.scalar(f"SELECT count(*) FROM {table} WHERE {stamp.where(column)}")
        hint = " (milliseconds? divide by 1000 in the expression)" if bad[3] >= rules.LATEST else ""
        raise ContractError(
            f"{where}: {total} timestamp(s) outside 1990..2100, first at "
            f"{source.place(bad[0], stamp.where(f'({expr})'), reads=expr)}{hint}",
            stamp,
        )


def check_not_null(build, table: str, column: str, source: RawSource, expr: str, where: str, what: str) -> None:
    _refuse_nulls(build, table, column, source, expr, where, f"impression(s) with no {what}")


def _refuse_nulls(build, table: str, column: str, source: RawSource, expr: str, where: str, counted: str) -> None:
    """A null ``column`` of ``table`` (SQL ``expr`` over the raw file) refused: how many (``counted``
    names them) and the first one's file, line, column and value."""
    bad = build.one(f"SELECT __file, count(*) FROM {table} WHERE {column} IS NULL GROUP BY __file LIMIT 1")
    if bad:
        total = build.scalar(f"SELECT count(*) FROM {table} WHERE {column} IS NULL")
        raise ContractError(
            f"{where}: {total} {counted}, first at {source.place(bad[0], f'({expr}) IS NULL', reads=expr)}"
        )


def check_no_nulls(build, table: str, columns: List[str], where: str, source: RawSource, exprs: dict) -> None:
    """A null in a contract column (a blank field, a side table's missing key without a default)."""
    if not columns:
        return
    counts = build.one(
        f"SELECT {', '.join(f'count(*) FILTER (WHERE {sql_name(c)} IS NULL)' for c in columns)} FROM {table}"
    )
    for c, n in zip(columns, counts):
        if n:
            path = build.scalar(f"SELECT any_value(__file) FROM {table} WHERE {sql_name(c)} IS NULL")
            raise ContractError(
                f"{where}.{c}: {n} null value(s), first at "
                f"{source.place(path, f'({exprs[c]}) IS NULL', reads=exprs[c])}; give a value with coalesce(...) "
                f"in the expression (or a side table's defaults)"
            )
    count_else(build, table, columns, where, exprs)


def check_label(build, column: str) -> None:
    col = sql_name(column)
    label = rules.LABEL
    bad = build.one(
        f"SELECT __file, count(*), any_value({col}) FROM imp WHERE {col} IS NULL OR {label.where(col)} "
        f"GROUP BY __file LIMIT 1"
    )
    if bad:
        expr = f"({build.b.columns[column]})"
        raise ContractError(
            f"build.columns.{column}: {bad[1]} label(s) not 0/1 (e.g. {bad[2]!r}), first at "
            f"{build.imp_source.place(bad[0], f'{expr} IS NULL OR {label.where(expr)}', reads=expr)}",
            label if bad[2] is not None else None,
        )


def check_id_types(build) -> None:
    for name, c in build.columns.items():
        if name not in build.computed or c.role != ID:
            continue
        if not build.is_integer_column("imp", name, lists_ok=True) and not vocab_for(build, name):
            raise ContractError(
                f"build.columns.{name}: gives {build.column_type('imp', name)} values; an id must be an integer "
                f"(map it with CASE, or declare a vocabulary for its table)"
            )


def check_id_ranges(build) -> None:
    """Ids (after the vocabularies) inside their tables, unless the table hashes: found here,
    naming the row, rather than by the loader at training time."""
    places = {c: ("imp", "build.columns", build.imp_source, build.b.columns) for c in build.computed}
    for i, (events, source, group) in enumerate(build.group_sources.values()):
        raw = build.raw_source(source, f"build.sequences[{i}]") if source.path else build.imp_source
        for f in group.features:
            places[f.column] = (events, f"build.sequences[{i}].columns", raw, source.columns)
    for name, (table, where, raw, exprs) in places.items():
        c = build.columns[name]
        if not c.table_size or not c.bounded:
            continue
        col = sql_name(name)
        is_list = build.column_type(table, name).endswith("[]")
        low, high = (f"list_min({col})", f"list_max({col})") if is_list else (col, col)
        bad = build.one(
            f"SELECT __file, {low}, {high} FROM {table} WHERE {low} < 0 OR {high} >= {c.table_size} LIMIT 1"
        )
        if bad:
            value = bad[1] if bad[1] < 0 else bad[2]
            expr = exprs[name]
            test = (
                f"list_min({expr}) < 0 OR list_max({expr}) >= {c.table_size}"
                if is_list
                else (f"({expr}) < 0 OR ({expr}) >= {c.table_size}")
            )
            at = side_place(build, expr, test) or raw.place(bad[0], test, reads=expr)
            raise ContractError(
                f"{where}.{name}: id {value} at {at} is outside [0, {c.table_size}), the "
                f"table of {c.uses[0].what}; enlarge the table, set hash: true, or declare a vocabulary",
                rules.NEGATIVE_ID if value < 0 else rules.id_beyond(c.table_size),
            )


def check_binds(build, relation: str, exprs: Dict[str, str], source: RawSource) -> None:
    """After a step failed: the first expression that fails alone over ``relation``, named by its
    config key (the engine's message names no file, and DuckDB's blames an output alias --
    "referenced that exists in the SELECT clause" -- for a column the file lacks)."""
    for key, expr in exprs.items():
        if not expr:  # an optional expression not given
            continue
        try:
            build.engine.describe(f"SELECT ({expr}) FROM {relation}")
        except build.engine.errors as e:
            missing = build.engine.missing_column(e)
            if not missing:
                hint = bare_name_hint(build, expr, relation)
                text = text_value(build, key, expr, relation, source, e)
                raise ContractError(build.explain(e) or text or f"{key}: {expr!r}: {first_line(e)}{hint}") from None
            raise missing_column_error(build, key, expr, missing, relation, source) from None


def text_value(build, key: str, expr: str, relation: str, source: RawSource, error: Exception) -> Optional[str]:
    """For an expression refused over types (``coalesce(brand, 0)``: "Cannot mix values of type
    VARCHAR and INTEGER_LITERAL"): the first raw value that made a column it reads text, as the
    error's one line; None if there is none."""
    if "VARCHAR" not in str(error):
        return None
    kinds = {name.lower(): kind for name, kind in build.engine.describe(f"SELECT * FROM {relation}")}
    for column in columns_read(expr):
        if kinds.get(column.lower()) != "VARCHAR":
            continue
        name = sql_name(column)
        for path in source.files:
            found = source.find(path, f"{name} IS NOT NULL AND TRY_CAST({name} AS DOUBLE) IS NULL", name)
            if found:
                return (
                    f"{key}: {source.at(path, found[0])}, {column_value(column, found[1])} makes the column text, "
                    f"and {expr!r} reads it as a number; fix the value, or cast it in the expression "
                    f"({first_line(error)})"
                )
    return None


def check_session_names(build, relation: str, exprs: Dict[str, str], source: RawSource) -> None:
    """An expression naming a column ``relation`` lacks but DuckDB reads as the session's value
    (``user``: SESSION_NAMES) is refused as a missing column, before any row is built on it."""
    have = None
    for key, expr in exprs.items():
        named = [c for c in columns_read(expr) if c.lower() in SESSION_NAMES] if expr else []
        if not named:
            continue
        have = have or {name.lower() for name, _ in build.engine.describe(f"SELECT * FROM {relation}")}
        for name in named:
            if name.lower() not in have:
                raise missing_column_error(build, key, expr, name, relation, source)


def missing_column_error(build, key: str, expr: str, column: str, relation: str, source: RawSource) -> ContractError:
    """The error for config key ``key``'s ``expr`` reading ``column``, which ``relation`` lacks."""
    described = build.engine.describe(f"SELECT * FROM {relation}")
    hidden = {"filename"} if source.read_apart() else set()  # the scan's own column: the file a row came from
    have = [f"{n}.<column>" if kind.startswith("STRUCT") else n for n, kind in described if n not in hidden]
    files = source.files[0] + (" ..." if len(source.files) > 1 else "")
    return ContractError(
        f"{key}: {expr!r} reads column {column!r}, which {files} does not have (its columns: "
        f"{', '.join(h for h in have if not h.startswith('__'))})"
    )


def bare_name_hint(build, expr: str, relation: str) -> str:
    """How SQL names a column of ``relation`` (or a field of a side table's struct there) that
    ``expr`` writes bare although it is no plain name (a typed header, ``user_id:token``: a syntax
    error), as the end of an error message; empty when there is none."""
    quoted = {}
    for name, kind in build.engine.describe(f"SELECT * FROM {relation}"):
        if not _PLAIN.fullmatch(name):
            quoted[name] = sql_name(name)
        if kind.startswith("STRUCT("):  # a side table: DuckDB quotes exactly the fields that need it
            for field in re.findall(r'"((?:[^"]|"")+)"', kind):
                field = field.replace('""', '"')
                quoted[f"{name}.{field}"] = f"{name}.{sql_name(field)}"
    bare = [(n, q) for n, q in quoted.items() if n in expr and q not in expr]
    if not bare:
        return ""
    name, right = bare[0]
    return (
        f"; column {name!r} is no plain SQL name: write it double-quoted, {right} (in YAML, inside single "
        f"quotes: '{right}')"
    )


def check_default_types(build, side, source: RawSource, where: str) -> None:
    """A number for the default of a column DuckDB reads as text (one text value makes it so)
    names that value; DuckDB would say only "Cannot mix values of type VARCHAR and ..."."""
    if not side.defaults:
        return
    kinds = dict(build.engine.describe(f"SELECT * FROM {build.scan(source)}"))
    for col, default in side.defaults.items():
        try:
            kind = build.type_of(default)
        except build.engine.errors:
            continue
        if kinds[col] != "VARCHAR" or not (kind in INTEGERS or kind.startswith(("DECIMAL", "DOUBLE", "FLOAT"))):
            continue
        name = sql_name(col)
        for path in source.files:
            found = source.find(path, f"{name} IS NOT NULL AND TRY_CAST({name} AS DOUBLE) IS NULL", name)
            if found:
                raise ContractError(
                    f"{where}.defaults.{col}: {source.at(path, found[0])}, column {col!r}: value {found[1]!r} "
                    f"makes the column text, and its default {default} is a number; fix the value, or quote the "
                    f"default"
                )
        raise ContractError(
            f"{where}.defaults.{col}: column {col!r} of {source.files[0]} is read as text (blank throughout?) "
            f"but its default {default} is a number; quote the default"
        )


def check_surfaces(build) -> None:
    """Every impression's surface is one of features.surfaces (else the loader refuses the
    output at training time): an error naming the row, or dropped and counted (unknown_surface)."""
    name, surfaces = build.features.columns.surface, build.features.surfaces
    if build.is_integer_column("imp", name):  # surfaces as indices

        def unknown(x: str) -> str:
            return f"({x}) < 0 OR ({x}) >= {len(surfaces)}"
    else:

        def unknown(x: str) -> str:
            return f"CAST(({x}) AS VARCHAR) NOT IN ({', '.join(sql_string(s) for s in surfaces)})"

    bad = unknown(sql_name(name))
    n = build.scalar(f"SELECT count(*) FROM imp WHERE {bad}")
    if n and build.b.impressions.unknown_surface == "error":
        path, value = build.one(f"SELECT __file, {sql_name(name)} FROM imp WHERE {bad} LIMIT 1")
        expr = build.b.columns[name]
        raise ContractError(
            f"build.columns.{name}: {n} impression(s) on a surface not in features.surfaces {surfaces} (e.g. "
            f"{value!r}), first at {build.imp_source.place(path, unknown(expr), reads=expr)}; add it to "
            f"features.surfaces, or set build.impressions.unknown_surface: drop"
        )
    build.counts["impressions on a surface not in features.surfaces (dropped)"] = n
    if n:
        build.engine.execute(f"DELETE FROM imp WHERE {bad}")


def count_else(build, table: str, columns: List[str], where: str, exprs: Dict[str, str]) -> None:
    """Counts the rows a CASE gave its ELSE in an id column, so the summary shows what no WHEN
    matched (a behaviour type the mapping did not foresee). Not a repair: the ELSE is the
    config's own value, chosen on purpose (``case_else`` in the summary, beside the repairs,
    which are the build's own fills and drops). A label's ELSE is its negative class, and a
    surface's is checked by check_surfaces: neither is counted."""
    what = "impressions" if table == "imp" else "events"
    for c in columns:
        if build.columns[c].role not in ID_ROLES:
            continue
        default = build.else_value(exprs[c])
        if default is not None and not build.is_list_column(table, c):
            n = build.scalar(f"SELECT count(*) FROM {table} WHERE {sql_name(c)} = {default}")
            build.case_else[f"{where}.{c}: {what} given the CASE's ELSE value {default}"] = n


def case_else_value(expr: str) -> Optional[str]:
    """The ELSE of ``expr`` as SQL when ``expr`` is a CASE whose ELSE is a constant that no THEN
    gives too (then its rows are exactly the unmatched ones); None otherwise."""
    tree = json.loads(_PARSER.execute(f"SELECT json_serialize_sql({sql_string('SELECT ' + expr)})").fetchone()[0])
    try:
        node = tree["statements"][0]["node"]
        case = node["select_list"][0]
    except (KeyError, IndexError):
        return None  # not parsed: the step itself says why
    otherwise = case.get("else_expr") or {}
    if case.get("class") != "CASE" or otherwise.get("class") != "CONSTANT":
        return None
    if otherwise.get("literal", {}).get("kind") == "NULL_LITERAL":
        return None

    def sql(e: dict) -> str:
        node["select_list"] = [e]
        return _PARSER.execute(f"SELECT json_deserialize_sql({sql_string(json.dumps(tree))})").fetchone()[0][7:]

    value = sql(otherwise)
    return None if any(sql(check["then_expr"]) == value for check in case["case_checks"]) else value


def side_place(build, expr: str, test: str) -> Optional[str]:
    """Where ``test`` first holds in a side table's file when ``expr`` reads that one side table
    alone (``profile.cms_segid + 1``): the value is there, not in the impression log."""
    read = [s.name for s in build.b.side_tables if re.search(rf"\b{re.escape(s.name)}\s*\.", expr)]
    if len(read) != 1 or read[0] not in build.side_sources:
        return None
    source = build.side_sources[read[0]]["source"]
    fields = set(re.findall(rf"\b{re.escape(read[0])}\s*\.\s*(\w+)", expr))
    column = f", column {fields.pop()!r}" if len(fields) == 1 else ""
    for path in source.files:
        row = source.locate(path, test, row_as=read[0])
        if row is not None:
            return f"{source.at(path, row)}{column} (side table {read[0]})"
    return None


def vocab_for(build, column: str) -> bool:
    tables = {s.table for s in build.features.sparse if s.column == column}
    return any(v.table in tables for v in build.b.vocabularies)
