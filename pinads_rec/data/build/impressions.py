"""The build's first steps, as functions over the build (``build``: full_build.Build, the engine and
the state the steps share): the impression log read and filtered, the side tables read and joined
(a dated one by the impression's date), each contract column computed from its ``build.columns``
expression and each impression given its split; the labels, users, surfaces and id types checked
(checks.py); the requests numbered and grouped (one user, one time: the earliest, one split), the
duplicated impressions and, if configured, the downsampled negatives dropped.
"""

from __future__ import annotations

from datetime import datetime
from typing import Dict, List, Optional, Tuple
from zoneinfo import ZoneInfo

from pinads_rec.config import BuildConfig, ConfigError, ImpressionsConfig
from pinads_rec.data.build.checks import (
    check_binds,
    check_default_types,
    check_id_types,
    check_no_nulls,
    check_not_null,
    check_session_names,
    check_surfaces,
    check_times,
)
from pinads_rec.data.build.queries import INTEGERS
from pinads_rec.data.build.time_sql import date_of, date_sql, seconds
from pinads_rec.data.loader.contract import ContractError
from pinads_rec.data.sql_text import columns_read, first_line, sql_literal, sql_name, sql_string


def build_impressions(build) -> None:
    """Step 1: ``imp``, one row an impression of a split (its contract columns computed, its side
    tables joined), checked, its request numbered; duplicates and, if configured, negatives dropped."""
    imp = build.b.impressions
    build.imp_source = build.raw_source(imp, "build.impressions")
    build.imp_columns = build.source_columns(build.imp_source)
    base = f"(SELECT *, filename AS __file FROM {build.scan(build.imp_source)}{where_clause(imp.filter)})"
    try:
        build.engine.execute(f"CREATE TEMP VIEW impressions AS SELECT * FROM {base}")
    except build.engine.errors:
        check_binds(
            build,
            f"(SELECT * FROM {build.scan(build.imp_source)})",
            {"build.impressions.filter": imp.filter},
            build.imp_source,
        )
        raise
    build.imp_time = seconds(build, imp.time, "impressions", "build.impressions.time", build.imp_source)
    joins, structs = [], []
    build.side_sources = {}  # side table name -> what its joins need (side_table)
    for i, side in enumerate(build.b.side_tables):
        build.side_sources[side.name] = build.side_table(i, side)
        join, struct = side_join(build, side.name, side.key, build.imp_time)
        joins.append(join)
        structs.append(struct)
    joined = "SELECT impressions.*" + "".join(", " + s for s in structs) + " FROM impressions " + " ".join(joins)
    # A history read from the impression log itself (a sequence source without a path) sees the
    # side tables too: a clicked video's author is ``video.author_id``, as in build.columns.
    try:
        build.engine.execute(f"CREATE TEMP VIEW impressions_joined AS {joined}")
    except build.engine.errors as e:
        keys = {
            f"build.side_tables[{i}].key.{k}": expr
            for i, s in enumerate(build.b.side_tables)
            for k, expr in s.key.items()
        }
        check_binds(build, "impressions", keys, build.imp_source)
        raise ContractError(build.explain(e) or f"build: joining the side tables: {first_line(e)}") from None
    split, n_splits = build.split_columns()
    keys = request_keys(build.b.impressions)
    key_columns = ", ".join(f"({k}) AS __key{i}" for i, k in enumerate(keys))
    order = imp.order or imp.item
    outputs = ", ".join(f"({build.b.columns[c]}) AS {sql_name(c)}" for c in build.computed)
    hits = "".join(f", {sql_name(s.name)}.__hit AS {sql_name('__hit_' + s.name)}" for s in build.b.side_tables)
    exprs = {f"build.columns.{c}": build.b.columns[c] for c in build.computed}
    exprs.update({"build.impressions.user": imp.user, "build.impressions.item": imp.item})
    exprs.update({"build.impressions.order": order})
    key_names = (
        ["build.impressions.request"]
        if imp.request
        else [f"build.impressions.request_key[{i}]" for i in range(len(keys))]
    )
    exprs.update(zip(key_names, keys))
    exprs.update(build.split_filters())
    read = {"build.impressions.filter": imp.filter, "build.impressions.time": imp.time, **exprs}
    check_session_names(build, "impressions_joined", read, build.imp_source)
    try:
        build.sql(
            "building the impressions",
            f"""CREATE TEMP TABLE imp AS
            SELECT {key_columns}, {build.imp_time} AS __t, ({imp.user}) AS __user, ({imp.item}) AS __item,
                   ({order}) AS __order, {split} AS __split, {n_splits} AS __n_splits,
                   __file, {outputs}{hits}
            FROM ({joined})""",
        )
    except ContractError:
        check_binds(build, "impressions_joined", exprs, build.imp_source)
        raise
    check_times(build, "imp", "__t", build.imp_source, build.imp_time, "build.impressions.time")
    check_not_null(build, "imp", "__user", build.imp_source, imp.user, "build.impressions.user", "user")
    build.check_labels()
    check_no_nulls(build, "imp", build.computed, "build.columns", build.imp_source, build.b.columns)
    build.drop_outside_splits()
    check_surfaces(build)
    number_requests(build, keys)
    build.keep_built_requests()
    check_id_types(build)
    drop_duplicates(build)
    if build.b.negative_downsampling:
        downsample(build)


def read_side_table(build, i: int, side) -> dict:
    """One side table read and checked (one row per key, and date if dated) into a temp table."""
    where = f"build.side_tables[{i}]"
    if side.name in build.imp_columns:
        raise ConfigError(
            f"{where}.name: {side.name!r} is also a column of the impression log; name the side table otherwise"
        )
    source = build.raw_source(side, where)
    columns = build.source_columns(source)
    for col in list(side.key) + ([side.as_of] if side.as_of else []):
        if col not in columns:
            raise ContractError(f"{where}: {source.files[0]} has no column {col!r} (its columns: {columns})")
    alias = f"__side{i}"
    keys = list(side.key)
    key_select = ", ".join(f"{sql_name(k)} AS __k{j}" for j, k in enumerate(keys))
    dated = date = ""
    if side.as_of:
        date = date_sql(build, sql_name(side.as_of), source, where + ".as_of")
        key_select += f", {date} AS __date"
        keys.append(side.as_of)
        dated = ", __date"
    check_session_names(build, f"(SELECT * FROM {build.scan(source)})", {f"{where}.filter": side.filter}, source)
    filtered = f"(SELECT * FROM {build.scan(source)}{where_clause(side.filter)})"
    fields = [c for c in columns if c not in side.key]
    # The side columns travel in one struct, so no name of theirs can clash with the impressions'.
    packed = ", ".join(f"{sql_name(c)} := {sql_name(c)}" for c in fields)
    build.engine.execute(
        f"CREATE TEMP TABLE {alias} AS SELECT {key_select}, struct_pack({packed}) AS __fields FROM {filtered}"
    )
    dup = build.one(
        f"SELECT {', '.join(f'__k{j}' for j in range(len(side.key)))}{dated}, count(*) FROM {alias} "
        f"GROUP BY ALL HAVING count(*) > 1 LIMIT 1"
    )
    if dup:
        raw_keys = [sql_name(k) for k in side.key] + ([date] if side.as_of else [])
        same = " AND ".join(f"({k}) IS NOT DISTINCT FROM {sql_literal(v)}" for k, v in zip(raw_keys, dup[:-1]))
        rows = source.places(f"({side.filter or 'true'}) AND {same}")
        raise ContractError(
            f"{where}: key {dict(zip(keys, dup[:-1]))} has {dup[-1]} rows, at {' and '.join(rows)}; "
            f"a side table needs one row per key{' and date' if side.as_of else ''}"
        )
    for col in side.defaults:
        if col not in columns:
            raise ContractError(f"{where}.defaults.{col}: {source.files[0]} has no such column ({columns})")
    check_default_types(build, side, source, where)
    blank = [c for c in side.defaults if c in fields]
    if blank:  # a default stands in for a blank value too: counted, as a missing key is (join_misses)
        counts = build.one(
            f"SELECT {', '.join(f'count(*) FILTER (WHERE __fields.{sql_name(c)} IS NULL)' for c in blank)} FROM {alias}"
        )
        for c, n in zip(blank, counts):
            build.counts[f"side table {side.name}: rows with a blank {c} (its default {side.defaults[c]} used)"] = n
    return {"alias": alias, "side": side, "fields": fields, "where": where, "source": source}


def side_join(build, name: str, key: Dict[str, str], time: str) -> Tuple[str, str]:
    """The LEFT JOIN of side table ``name`` on ``key`` (side column -> SQL expression over the
    joining row; a dated table also on the date of ``time``, seconds) and the struct its columns
    are read through (``<name>.<column>``: a struct field), defaults applied."""
    info = build.side_sources[name]
    alias, side = info["alias"], info["side"]
    on = " AND ".join(f"{alias}.__k{j} = ({key[k]})" for j, k in enumerate(side.key))
    if side.as_of:
        on += f" AND {alias}.__date = {date_of(build.b.timezone, time)}"
    values = {c: f"{alias}.__fields.{sql_name(c)}" for c in info["fields"]}
    packed = ", ".join(
        f"{sql_name(c)} := " + (f"coalesce({v}, {side.defaults[c]})" if c in side.defaults else v)
        for c, v in values.items()
    )
    struct = f"struct_pack({packed}, __hit := {alias}.__k0 IS NOT NULL) AS {sql_name(side.name)}"
    return f"LEFT JOIN {alias} ON {on}", struct


def split_test(build, i: int) -> str:
    s = build.b.splits[i]
    tests = []
    if s.start:
        tests.append(f"{build.imp_time} >= {_time_of_day(s.start, build.b.timezone, f'build.splits[{i}].start')}")
    if s.end:
        tests.append(f"{build.imp_time} < {_time_of_day(s.end, build.b.timezone, f'build.splits[{i}].end')}")
    if s.filter:
        tests.append(f"({s.filter})")
    return "(" + (" AND ".join(tests) or "true") + ")"


def split_columns(build) -> Tuple[str, str]:
    """SQL over the joined impression row: ``__split``, the split it falls in (NULL: none), and
    ``__n_splits``, how many splits it falls in."""
    tests = [split_test(build, i) for i in range(len(build.b.splits))]
    case = "CASE " + " ".join(f"WHEN {t} THEN {sql_string(s)}" for t, s in zip(tests, build.splits)) + " END"
    return case, " + ".join(f"CAST(coalesce({t}, false) AS INTEGER)" for t in tests)


def split_filters(b: BuildConfig) -> Dict[str, str]:
    """The splits' filters by config key (to name the one DuckDB refused)."""
    return {f"build.splits[{i}].filter": s.filter for i, s in enumerate(b.splits) if s.filter}


def drop_outside_splits(build) -> None:
    over = build.scalar("SELECT count(*) FROM imp WHERE __n_splits > 1")
    if over:
        raise ContractError(
            f"build.splits: {over} impression(s) fall in more than one split; make the windows and filters disjoint"
        )
    build.counts["impressions outside every split (dropped)"] = build.scalar(
        "SELECT count(*) FROM imp WHERE __split IS NULL"
    )
    build.sql("dropping the impressions outside every split", "DELETE FROM imp WHERE __split IS NULL")
    if not build.scalar("SELECT count(*) FROM imp"):
        raise ContractError(f"build.splits: no impression of {build.imp_source.files[0]}... falls in any split")


def request_keys(imp: ImpressionsConfig) -> List[str]:
    """SQL over the impression log: the request id, or the columns that together key a request."""
    return [imp.request] if imp.request else list(imp.request_key)


def number_requests(build, keys: List[str]) -> None:
    """``__req``: the log's integer request id as it is; otherwise each distinct key numbered
    1, 2, ... in key order (only the keys are sorted, not the impressions)."""
    if len(keys) == 1 and build.is_integer(keys[0]):
        build.sql(
            "taking the request ids",
            f"CREATE OR REPLACE TEMP TABLE imp AS SELECT {build.select_list('imp', exclude=['__key0'])}, "
            f"__key0 AS __req FROM imp",
        )
        return
    names = [f"__key{i}" for i in range(len(keys))]
    listed = ", ".join(names)
    build.sql(
        "numbering the requests",
        f"""CREATE TEMP TABLE __request_ids AS
        SELECT {listed}, CAST(row_number() OVER (ORDER BY {listed}) AS BIGINT) AS __req
        FROM (SELECT DISTINCT {listed} FROM imp)""",
    )
    same = " AND ".join(f"imp.{n} IS NOT DISTINCT FROM r.{n}" for n in names)
    build.sql(
        "numbering the requests",
        f"CREATE OR REPLACE TEMP TABLE imp AS SELECT {build.select_list('imp', exclude=names, qualifier='imp')}, "
        f"r.__req FROM imp JOIN __request_ids r ON {same}",
    )


def group_requests(build) -> None:
    """One row per request: its user, time (the earliest of its impressions) and split."""
    build.sql(
        "grouping the requests",
        """CREATE TEMP TABLE req AS
        SELECT __req, any_value(__user) AS __user, min(__t) AS __t, arg_min(__split, __t) AS __split,
               count(DISTINCT __user) AS __users, count(DISTINCT __t) AS __times,
               count(DISTINCT __split) AS __splits
        FROM imp GROUP BY __req""",
    )
    bad = build.one("SELECT __req, __users FROM req WHERE __users > 1 LIMIT 1")
    if bad:
        raise ContractError(
            f"build.impressions: request {bad[0]} has impressions of {bad[1]} users"
            f"{differing(build, bad[0], build.b.impressions.user)}; a request is one user's (check "
            f"build.impressions.request / request_key)"
        )
    build.counts["requests with impressions at several times (request time = the earliest)"] = build.scalar(
        "SELECT count(*) FROM req WHERE __times > 1"
    )
    moved = build.scalar("SELECT count(*) FROM req WHERE __splits > 1")
    if moved:
        build.counts[build.ACROSS] = moved
        build.sql(
            "moving requests to one split",
            "CREATE OR REPLACE TEMP TABLE imp AS SELECT "
            + build.select_list("imp", {"__split": "req.__split"}, qualifier="imp")
            + " FROM imp JOIN req USING (__req)",
        )
    for col in build.user_side:
        bad = build.one(
            f"SELECT __req, count(DISTINCT {sql_name(col)}) FROM imp GROUP BY __req "
            f"HAVING count(DISTINCT {sql_name(col)}) > 1 LIMIT 1"
        )
        if bad:
            raise ContractError(
                f"build.columns.{col}: a user-side feature, but request {bad[0]} has {bad[1]} different values "
                f"among its impressions{differing(build, bad[0], build.b.columns[col])} (it must be one per request)"
            )


def drop_duplicates(build) -> None:
    """The same (request, item) twice: an error, or keep the first by order then labels."""
    dup = build.one(
        "SELECT __req, __item, count(*), list(DISTINCT __file) FROM imp GROUP BY __req, __item "
        "HAVING count(*) > 1 LIMIT 1"
    )
    if not dup:
        build.counts["duplicated impressions (dropped)"] = 0
        return
    total = build.scalar(
        "SELECT sum(n - 1) FROM (SELECT count(*) AS n FROM imp GROUP BY __req, __item HAVING count(*) > 1)"
    )
    if build.b.impressions.duplicates == "error":
        item = build.b.impressions.item
        rows = build.imp_source.places(f"{request_rows(build, dup[0])} AND ({item}) = {sql_literal(dup[1])}")
        named = columns_read(item)
        column = f" (column {named[0]!r})" if named == [item] else ""
        raise ContractError(
            f"build.impressions: {total} duplicated impression(s); request {dup[0]} shows item {dup[1]!r} {dup[2]} "
            f"times{column}, at {' and '.join(rows) or ', '.join(dup[3])}; set build.impressions.duplicates: "
            f"drop to keep the first"
        )
    # The first by order, then the highest labels (those built: a live request has none).
    order = ", ".join(
        ["__order"]
        + [f"{sql_name(t.label_column)} DESC" for t in build.features.tasks if t.label_column in build.computed]
    )
    build.engine.execute(
        f"""CREATE OR REPLACE TEMP TABLE imp AS SELECT {build.select_list("imp")} FROM (
            SELECT *, row_number() OVER (PARTITION BY __req, __item ORDER BY {order}) AS __dup FROM imp)
        WHERE __dup = 1"""
    )
    build.counts["duplicated impressions (dropped)"] = int(total)


def request_rows(build, req) -> str:
    """SQL over the impression log's columns: its rows of request ``req`` (``__req``), as the
    filter kept them."""
    keys = request_keys(build.b.impressions)
    if len(keys) == 1 and build.is_integer(keys[0]):
        values = [req]
    else:
        listed = ", ".join(f"__key{i}" for i in range(len(keys)))
        found = build.one(f"SELECT {listed} FROM __request_ids WHERE __req = {sql_literal(req)}")
        if found is None:  # not numbered here: no raw row to name
            return "(false)"
        values = list(found)
    same = [f"({k}) IS NOT DISTINCT FROM {sql_literal(v)}" for k, v in zip(keys, values)]
    return "(" + " AND ".join([f"({build.b.impressions.filter or 'true'})"] + same) + ")"


def differing(build, req, expr: str) -> str:
    """Where request ``req``'s impressions differ in SQL ``expr``: its first row and the first
    with another value, each with its value, as an error names them (empty if not found)."""
    rows, source = request_rows(build, req), build.imp_source

    def first(condition: str) -> Optional[tuple]:
        for path in source.files:
            found = source.find(path, condition, f"({expr})")
            if found:
                return source.at(path, found[0]), found[1]
        return None

    one = first(rows)
    other = one and first(f"{rows} AND ({expr}) IS DISTINCT FROM {sql_literal(one[1])}")
    return f" ({expr!r} is {one[1]!r} at {one[0]} and {other[1]!r} at {other[0]})" if other else ""


def downsample(build) -> None:
    d = build.b.negative_downsampling
    if build.engine.hashes_integers_only:
        for column, key in (("__req", "request"), ("__item", "item")):
            kind = build.column_type("imp", column)
            if kind not in INTEGERS:
                raise ContractError(
                    f"build.negative_downsampling: on --engine {build.engine.name} the draw hashes (request, item) "
                    f"as DuckDB does for integers, and build.impressions.{key} gives {kind} values: give it as "
                    f"an integer (a vocabulary maps ids after the draw), or build on --engine duckdb"
                )
    label = sql_name(next(t.label_column for t in build.features.tasks if t.name == d.task))
    surface = sql_name(build.features.columns.surface)
    rate = "CASE " + " ".join(
        f"WHEN CAST({surface} AS VARCHAR) IN ({sql_string(s)}, {sql_string(str(build.features.surfaces.index(s)))}) "
        f"THEN {float(r)}"
        for s, r in d.rates.items()
    )
    rate += " ELSE 1.0 END"
    # Integers hashed as BIGINTs (DuckDB hashes a negative INTEGER otherwise), as on every engine.
    keys = [f"CAST({c} AS BIGINT)" if build.is_integer_column("imp", c) else c for c in ("__req", "__item")]
    draw = f"hash({', '.join(keys)}, CAST({int(d.seed)} AS BIGINT))"
    drop = f"{build.sampled()} AND {label} = 0 AND ({draw} % 1000000) / 1000000.0 >= {rate}"
    build.counts[f"negatives of {d.task} downsampled away"] = build.scalar(f"SELECT count(*) FROM imp WHERE {drop}")
    build.engine.execute(f"DELETE FROM imp WHERE {drop}")


def _time_of_day(text: str, tz: str, where: str) -> float:
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(f"{where}: {text!r} is not a date or datetime (YYYY-MM-DD[THH:MM[:SS]])") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=ZoneInfo(tz))
    return moment.timestamp()


def where_clause(predicate: Optional[str]) -> str:
    """`` WHERE (predicate)``, or nothing without one."""
    return f" WHERE ({predicate})" if predicate else ""
