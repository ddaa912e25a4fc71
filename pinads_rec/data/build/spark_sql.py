"""The build's statements, written in DuckDB's dialect, as Spark SQL: sqlglot's DuckDB -> Spark
transpiler, and the rewrites where it leaves DuckDB's meaning behind (tests/test_spark_sql.py):

- ``a / b`` -> ``CAST(a AS DOUBLE) / b``: DuckDB divides as DOUBLEs, decimals too (Spark keeps a
  DECIMAL);
- ``[f(x) FOR x IN l]`` -> ``transform(l, x -> f(x))`` (sqlglot prints a comprehension Spark lacks);
- ``list_slice(l, b, e)`` -> ``slice(l, b, e - b + 1)``, ``list_reverse`` -> ``reverse``;
- ``list(x ORDER BY k)`` -> the values of ``array_sort(collect_list(struct(k, x)))`` (sqlglot drops
  the order);
- ``unnest(l) AS v, generate_subscripts(l, 1) AS p`` -> ``posexplode(l) AS (p, v)`` (Spark allows
  one generator a SELECT; positions from 0, an order all the same);
- ``row_number() OVER ()`` -> ``monotonically_increasing_id()`` (a unique number, all the build asks
  of it), and ``row_number() OVER (PARTITION BY k)`` ordered by ``k`` (Spark wants an order);
- ``epoch``, ``to_timestamp``, ``timezone(tz, ...)`` and ``try_strptime`` with DuckDB's meaning
  (fractional seconds kept; a wall-clock time read in ``tz``, an instant shown in it), for a Spark
  session in UTC whose timestamps without a zone are ``TIMESTAMP_NTZ`` (spark_engine.py sets both);
- ``hash(a, b, ...)`` -> ``duckdb_hash(array(...))``, DuckDB's own 64-bit hash of integers (a UDF,
  ``duckdb_hash``), so a negative downsampling draws the same rows on both engines;
- ``array_length`` a BIGINT; ``FLOAT[8]`` -> ``ARRAY<FLOAT>`` (Spark has no fixed-size arrays), ``read_parquet('f')`` ->
  ``parquet.`f```.

What neither covers raises ``Untranslatable`` naming the construct.
"""

from __future__ import annotations

from typing import List

import numpy as np
import sqlglot
from sqlglot import exp
from sqlglot.dialects.spark import Spark
from sqlglot.time import format_time

HASH_UDF = "duckdb_hash"
_MASK = (1 << 64) - 1
_MIX = 0xD6E8FEB86659FD93  # DuckDB's MurmurHash64 multiplier


class Untranslatable(ValueError):
    """A DuckDB construct with no Spark SQL rewrite here."""


def parse(statement: str) -> exp.Expression:
    return sqlglot.parse_one(statement, read="duckdb")


def to_spark(query) -> str:
    """A DuckDB query (text or a parsed tree) as Spark SQL."""
    tree = parse(query) if isinstance(query, str) else query.copy()
    return rewrite(tree).sql(dialect="spark")


def rewrite(tree: exp.Expression) -> exp.Expression:
    """The rewrites above, children before their parents."""
    for node in reversed(list(tree.walk(bfs=False))):
        new = _rewrite(node)
        if new is not node:
            if node is tree:
                tree = new
            else:
                node.replace(new)
    for node in tree.find_all(exp.Anonymous):
        if node.name.upper() == "GENERATE_SUBSCRIPTS":
            raise Untranslatable("generate_subscripts but beside unnest of the same list in one SELECT")
    return tree


def _rewrite(node: exp.Expression) -> exp.Expression:
    items = node.expressions if isinstance(node, exp.Array) else []
    if len(items) == 1 and isinstance(items[0], exp.Comprehension):
        return _comprehension(items[0])
    if isinstance(node, exp.Anonymous):
        return _function(node)
    if isinstance(node, exp.Div) and not node.args.get("typed"):  # DuckDB's / is a DOUBLE's, decimals' too
        node.set("this", exp.cast(node.this, "DOUBLE"))
        return node
    if isinstance(node, exp.ArraySize):  # array_length: a BIGINT, as DuckDB's (Spark's size is an INT)
        return exp.cast(exp.func("SIZE", node.this), "BIGINT")
    if isinstance(node, exp.TimeToUnix):  # epoch(ts): seconds with their fraction
        micros = exp.func("UNIX_MICROS", exp.cast(node.this, "TIMESTAMP_LTZ", dialect="spark"))
        return exp.Div(this=exp.cast(micros, "DOUBLE"), expression=exp.Literal.number(1000000))
    if isinstance(node, exp.UnixToTime):  # to_timestamp(seconds): an instant
        scale = node.args.get("scale")
        if scale is not None and scale.name not in ("0", "seconds"):
            raise Untranslatable(f"to_timestamp with a scale ({node.sql('duckdb')}): give seconds")
        return exp.func("TIMESTAMP_SECONDS", node.this)
    if isinstance(node, exp.Window) and isinstance(node.this, exp.RowNumber) and not node.args.get("order"):
        partition = node.args.get("partition_by")
        if not partition:
            return exp.func("MONOTONICALLY_INCREASING_ID")
        node.set("order", exp.Order(expressions=[exp.Ordered(this=p.copy()) for p in partition]))
        return node
    if isinstance(node, exp.ArrayAgg) and isinstance(node.this, exp.Order):
        return _ordered_list(node.this)
    if isinstance(node, exp.DataType) and node.is_type(exp.DataType.Type.ARRAY) and node.args.get("values"):
        node.set("values", None)  # FLOAT[8] -> ARRAY<FLOAT>
        return node
    if isinstance(node, exp.Select):
        _posexplode(node)
        return node
    if isinstance(node, exp.ReadParquet):
        paths = node.expressions
        if len(paths) != 1 or not isinstance(paths[0], exp.Literal):
            raise Untranslatable(f"read_parquet of several files ({node.sql('duckdb')})")
        return exp.Table(this=exp.to_identifier(paths[0].name, quoted=True), db=exp.to_identifier("parquet"))
    if isinstance(node, exp.ReadCSV):
        raise Untranslatable("read_csv: the engine reads raw files itself (SparkEngine.scan)")
    return node


def _comprehension(c: exp.Comprehension) -> exp.Expression:
    var = c.expression
    items = c.args["iterator"]
    if c.args.get("condition") is not None:
        items = exp.func("FILTER", items, exp.Lambda(this=c.args["condition"], expressions=[var.copy()]))
    return exp.func("TRANSFORM", items, exp.Lambda(this=c.this, expressions=[var.copy()]))


def _function(node: exp.Anonymous) -> exp.Expression:
    name, args = node.name.upper(), node.expressions
    if name == "LIST_SLICE":
        items, begin, end = args
        span = exp.Sub(this=end, expression=exp.Paren(this=begin.copy()))
        length = exp.Add(this=span, expression=exp.Literal.number(1))
        return exp.func("SLICE", items, begin, exp.Paren(this=length))
    if name == "LIST_REVERSE":
        return exp.func("REVERSE", *args)
    if name == "HASH":
        return _unsigned(exp.func(HASH_UDF, exp.Array(expressions=[exp.cast(a, "BIGINT") for a in args])))
    if name == "TIMEZONE":
        zone, moment = args
        if _is_wall_clock(moment):  # a time without a zone, read in ``zone``: the instant
            return exp.func("TO_UTC_TIMESTAMP", exp.cast(moment, "TIMESTAMP_LTZ", dialect="spark"), zone)
        if isinstance(moment, exp.Anonymous) and moment.name.upper() == "TIMESTAMP_SECONDS":  # an instant
            shown = exp.func("FROM_UTC_TIMESTAMP", moment, zone)
            return exp.cast(shown, "TIMESTAMP_NTZ", dialect="spark")
        raise Untranslatable(
            f"timezone({zone.sql('duckdb')}, ...) of {moment.sql('duckdb')}: cast it to TIMESTAMP (a wall-clock "
            f"time) or give to_timestamp(seconds) (an instant)"
        )
    if name == "TRY_STRPTIME":
        text, fmt = args
        if not fmt.is_string:
            raise Untranslatable(f"try_strptime with a format that is not a string ({node.sql('duckdb')})")
        spark_format = format_time(fmt.name, Spark.INVERSE_TIME_MAPPING, Spark.INVERSE_TIME_TRIE)
        return exp.func("TRY_TO_TIMESTAMP", text, exp.Literal.string(spark_format))
    return node  # GENERATE_SUBSCRIPTS: its SELECT rewrites it beside its unnest (_posexplode)


def _is_wall_clock(node: exp.Expression) -> bool:
    if isinstance(node, (exp.Cast, exp.TryCast)):
        to = node.args["to"]
        return to.is_type(exp.DataType.Type.TIMESTAMP) or to.is_type(exp.DataType.Type.TIMESTAMPNTZ)
    return isinstance(node, exp.Paren) and _is_wall_clock(node.this)


def _unsigned(signed: exp.Expression) -> exp.Expression:
    """A BIGINT holding 64 hash bits as the unsigned number DuckDB's UBIGINT is (DECIMAL(20, 0))."""
    wide = exp.cast(signed, exp.DataType.build("DECIMAL(20, 0)"))
    wrap = exp.If(
        this=exp.LT(this=signed.copy(), expression=exp.Literal.number(0)),
        true=exp.Literal.number(1 << 64),
        false=exp.Literal.number(0),
    )
    return exp.Paren(this=exp.Add(this=wide, expression=wrap))


def _ordered_list(order: exp.Order) -> exp.Expression:
    keys = order.expressions
    if any(k.args.get("desc") for k in keys):
        raise Untranslatable(f"list(... ORDER BY ... DESC) ({order.sql('duckdb')})")
    fields = [exp.alias_(k.this.copy(), f"__k{i}") for i, k in enumerate(keys)]
    fields.append(exp.alias_(order.this.copy(), "__v"))
    pairs = exp.func("ARRAY_SORT", exp.func("COLLECT_LIST", exp.func("STRUCT", *fields)))
    var = exp.to_identifier("__s")
    value = exp.Dot(this=exp.column("__s"), expression=exp.to_identifier("__v"))
    return exp.func("TRANSFORM", pairs, exp.Lambda(this=value, expressions=[var]))


def _posexplode(select: exp.Select) -> None:
    """``unnest(l) AS v, generate_subscripts(l, 1) AS p`` in one SELECT -> ``posexplode(l) AS (p, v)``."""
    items = select.expressions
    unnests = {
        i: e for i, e in enumerate(items) if isinstance(e, exp.Alias) and isinstance(e.this, (exp.Explode, exp.Unnest))
    }
    for i, e in enumerate(items):
        if not (isinstance(e, exp.Alias) and isinstance(e.this, exp.Anonymous)):
            continue
        if e.this.name.upper() != "GENERATE_SUBSCRIPTS":
            continue
        listed = e.this.expressions[0]
        j = next((j for j, u in unnests.items() if _unnested(u.this) == listed), None)
        if j is None:
            continue
        value = unnests[j]
        pos = exp.Aliases(
            this=exp.func("POSEXPLODE", listed.copy()),
            expressions=[exp.to_identifier(e.alias), exp.to_identifier(value.alias)],
        )
        kept: List[exp.Expression] = [x for k, x in enumerate(items) if k not in (i, j)]
        select.set("expressions", kept + [pos])
        return


def _unnested(node: exp.Expression) -> exp.Expression:
    return node.this if isinstance(node, exp.Explode) else node.expressions[0]


# --- DuckDB's hash ---------------------------------------------------------------------------


def duckdb_hash(values: np.ndarray) -> np.ndarray:
    """DuckDB's ``hash(a, b, ...)`` of integer columns (rows x columns, int64), as int64 bits:
    MurmurHash64 of each value, combined left to right (tests/test_spark_sql.py checks it against
    DuckDB itself)."""
    with np.errstate(over="ignore"):
        x = values.astype(np.int64).view(np.uint64)
        h = _murmur(x[:, 0])
        for k in range(1, x.shape[1]):
            h = h ^ (h >> np.uint64(32))
            h = h * np.uint64(_MIX)
            h = h ^ _murmur(x[:, k])
    return h.view(np.int64)


def _murmur(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(32))
    x = x * np.uint64(_MIX)
    x = x ^ (x >> np.uint64(32))
    x = x * np.uint64(_MIX)
    return x ^ (x >> np.uint64(32))
