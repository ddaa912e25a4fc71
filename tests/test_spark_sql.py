"""data/build/spark_sql.py: DuckDB's statements as Spark SQL, rewrite by rewrite (the text; what it
means on Spark is tests/test_spark_build.py's), and DuckDB's hash reproduced bit for bit."""

from __future__ import annotations

import duckdb
import numpy as np
import pytest

from pinads_rec.data.build.spark_sql import Untranslatable, duckdb_hash, to_spark


def test_duckdb_hash_equals_duckdb_itself():
    rng = np.random.default_rng(0)
    values = np.concatenate(
        [rng.integers(-(2**62), 2**62, size=(200, 3)), rng.integers(-5, 5, size=(50, 3)), np.zeros((1, 3), int)]
    )
    con = duckdb.connect()
    for width in (1, 2, 3):
        got = duckdb_hash(values[:, :width]).view(np.uint64)
        calls = [", ".join(f"{int(v)}::BIGINT" for v in row[:width]) for row in values]
        want = [con.execute(f"SELECT hash({args})").fetchone()[0] for args in calls]
        assert got.tolist() == want


@pytest.mark.parametrize(
    "duck, spark",
    [
        ("SELECT [x.a FOR x IN c.l] AS y", "SELECT TRANSFORM(c.l, x -> x.a) AS y"),
        ("SELECT list_slice(l, b + 1, e)", "SELECT SLICE(l, b + 1, (e - (b + 1) + 1))"),
        ("SELECT list_reverse(l)", "SELECT REVERSE(l)"),
        ("SELECT a / 1000.0", "SELECT CAST(a AS DOUBLE) / 1000.0"),
        ("SELECT epoch(t)", "SELECT CAST(UNIX_MICROS(CAST(t AS TIMESTAMP_LTZ)) AS DOUBLE) / 1000000"),
        (
            "SELECT CAST(timezone('Asia/Shanghai', to_timestamp(s)) AS DATE)",
            "SELECT CAST(CAST(FROM_UTC_TIMESTAMP(TIMESTAMP_SECONDS(s), 'Asia/Shanghai') AS TIMESTAMP_NTZ) AS DATE)",
        ),
        (
            "SELECT epoch(timezone('UTC', CAST(x AS TIMESTAMP)))",
            "SELECT CAST(UNIX_MICROS(CAST(TO_UTC_TIMESTAMP(CAST(CAST(x AS TIMESTAMP_NTZ) AS TIMESTAMP_LTZ), 'UTC') "
            "AS TIMESTAMP_LTZ)) AS DOUBLE) / 1000000",
        ),
        ("SELECT try_strptime(d, '%Y%m%d')", "SELECT TRY_TO_TIMESTAMP(d, 'yyyyMMdd')"),
        ("SELECT row_number() OVER () AS r FROM t", "SELECT MONOTONICALLY_INCREASING_ID() AS r FROM t"),
        (
            "SELECT row_number() OVER (PARTITION BY a) FROM t",
            "SELECT ROW_NUMBER() OVER (PARTITION BY a ORDER BY a NULLS LAST) FROM t",
        ),
        (
            "SELECT list(v ORDER BY p) FROM t",
            "SELECT TRANSFORM(ARRAY_SORT(COLLECT_LIST(STRUCT(p AS __k0, v AS __v))), __s -> __s.__v) FROM t",
        ),
        (
            "SELECT r, unnest(l) AS v, generate_subscripts(l, 1) AS p FROM t",
            "SELECT r, POSEXPLODE(l) AS (p, v) FROM t",
        ),
        ("SELECT CAST(x AS FLOAT[8])", "SELECT CAST(x AS ARRAY<FLOAT>)"),
        ("SELECT * FROM read_parquet('/v/a.parquet')", "SELECT * FROM parquet.`/v/a.parquet`"),
    ],
)
def test_rewrites(duck, spark):
    assert to_spark(duck) == spark


def test_hash_is_duckdb_hash_as_an_unsigned_number():
    sql = to_spark("SELECT hash(a, b) % 10")
    assert "DUCKDB_HASH(ARRAY(CAST(a AS BIGINT), CAST(b AS BIGINT)))" in sql
    assert "AS DECIMAL(20, 0)" in sql and "18446744073709551616" in sql


@pytest.mark.parametrize(
    "duck, named",
    [
        ("SELECT generate_subscripts(l, 1) FROM t", "generate_subscripts"),
        ("SELECT list(v ORDER BY p DESC) FROM t", "DESC"),
        ("SELECT timezone('UTC', t) FROM x", "timezone"),
        ("SELECT * FROM read_csv('a.csv')", "read_csv"),
    ],
)
def test_what_has_no_rewrite_is_named(duck, named):
    with pytest.raises(Untranslatable, match=named):
        to_spark(duck)
