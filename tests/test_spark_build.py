"""The build on Spark (``--engine spark``, ``local[2]``) equals the build on DuckDB, row for row and
type for type: the demo's raw logs (through the command line), the Taobao fixture with its negatives
downsampled (the same rows drawn), the KuaiRand fixture, a day build; the vocabularies, the
summary's counts and the loader's reading alike. Then the translated expressions, one by one,
against DuckDB, and the errors a user's mistake gets on Spark."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from conftest import REPO, load_tiny
from dataset_fixtures import write_kuairand, write_taobao

from pinads_rec.config import ConfigError, load
from pinads_rec.data import synth as S
from pinads_rec.data.build import build, build_days
from pinads_rec.data.build.spark_engine import check_java
from pinads_rec.data.loader.contract import ContractError
from pinads_rec.data.loader.reader import RowGroupReader, list_files, list_row_groups

pytestmark = pytest.mark.slow

try:
    check_java()
except ConfigError as e:  # the image has one; a machine without it says why these did not run
    pytest.skip(str(e), allow_module_level=True)

TAOBAO = os.path.join(REPO, "configs", "datasets", "taobao_ad.yaml")
KUAIRAND = os.path.join(REPO, "configs", "datasets", "kuairand.yaml")


def _read(directory: Path) -> pa.Table:
    return pa.concat_tables(pq.read_table(p) for p in sorted(directory.glob("part-*.parquet")))


def _by_request(table: pa.Table, request_id: str) -> pa.Table:
    return table.take(pc.sort_indices(table.column(request_id)))


def assert_same_build(duck: Path, spark: Path, splits, features) -> None:
    """Every split's rows (sorted by request id), their Arrow types, the vocabularies' rows and the
    summary's counts equal; each manifest names its engine."""
    rid = features.columns.request_id
    for split in splits:
        a, b = _read(duck / split), _read(spark / split)
        assert b.schema.equals(a.schema, check_metadata=True), f"{split}: {b.schema} != {a.schema}"
        a, b = _by_request(a, rid), _by_request(b, rid)
        for name in a.column_names:
            if not b.column(name).equals(a.column(name)):
                bad = next(i for i in range(a.num_rows) if b.column(name)[i] != a.column(name)[i])
                pytest.fail(
                    f"{split}.{name}: request {a.column(rid)[bad]}: {b.column(name)[bad]} != {a.column(name)[bad]}"
                )
    for vocab in sorted((duck / "vocabularies").glob("*.parquet")) if (duck / "vocabularies").is_dir() else []:
        # Spark writes the columns nullable; the rows are what is compared.
        assert pq.read_table(spark / "vocabularies" / vocab.name).to_pylist() == pq.read_table(vocab).to_pylist()
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (duck, spark))
    for key in ("splits", "repairs", "case_else", "join_misses"):
        assert sb[key] == sa[key], key
    assert json.loads((spark / "manifest.json").read_text())["engine"] == "spark"
    assert json.loads((duck / "manifest.json").read_text())["engine"] == "duckdb"


def _both(cfg, raw: Path, root: Path) -> None:
    """Builds on both engines into root/duckdb and root/spark."""
    build(cfg, str(raw), str(root / "duckdb"), threads=2)
    build(cfg, str(raw), str(root / "spark"), threads=2, engine="spark")


# --- the demo's raw logs, through the command line --------------------------------------------------


def test_demo_raw_logs_build_the_same_on_spark_from_the_command_line(tmp_path):
    cfg = load_tiny(tmp_path / "synth", ["synth.num_users=120", "synth.sequence_length=100"])
    S.generate(cfg, tmp_path / "synth", raw=True)
    bounds = S.split_boundaries(cfg.synth)
    iso = lambda t: time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))  # noqa: E731
    splits = [
        f"build.splits=[{{name: train, end: '{iso(bounds['train'][1])}'}}, "
        f"{{name: calibration, start: '{iso(bounds['calibration'][0])}', end: '{iso(bounds['calibration'][1])}'}}, "
        f"{{name: eval, start: '{iso(bounds['eval'][0])}'}}]"
    ]
    config_file = tmp_path / "demo.yaml"
    config_file.write_text(f"extends: {os.path.join(REPO, 'configs', 'demo.yaml')}\n")
    for engine in ("duckdb", "spark"):
        cmd = [sys.executable, "-m", "pinads_rec.data.build", "--config", str(config_file), "--raw"]
        cmd += [str(tmp_path / "synth" / "raw"), "--out", str(tmp_path / engine), "--engine", engine, "--threads", "2"]
        cmd += [a for o in splits + ["synth.num_users=120"] for a in ("--set", o)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "train:" in done.stdout and "requests" in done.stdout
    cfg = load(str(config_file))
    assert_same_build(tmp_path / "duckdb", tmp_path / "spark", ["train", "calibration", "eval"], cfg.features)
    # The trainer's reader takes Spark's files as they are (schema checked when listed).
    groups = list_row_groups(list_files(str(tmp_path / "spark" / "train")), cfg.features)
    rows = RowGroupReader(cfg.features, cfg.data).read(groups[0])
    assert rows.num_rows > 0


# --- the dataset fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def taobao(tmp_path_factory):
    root = tmp_path_factory.mktemp("spark_taobao")
    write_taobao(root / "raw")
    return root


def test_taobao_fixture_builds_the_same_on_spark_negatives_downsampled_alike(taobao):
    # One build pair for both (a Spark build is mostly its jobs' fixed cost, not the rows): the
    # whole build, and the seeded draw of the negatives keeping the same rows.
    cfg = load(TAOBAO, ["build.negative_downsampling={task: click, rates: {'430548_1007': 0.3, '430539_1007': 0.6}}"])
    _both(cfg, taobao / "raw", taobao / "full")
    summary = json.loads((taobao / "full" / "spark" / "summary.json").read_text())
    assert summary["repairs"]["negatives of click downsampled away"] > 1000
    assert_same_build(
        taobao / "full" / "duckdb", taobao / "full" / "spark", [s.name for s in cfg.build.splits], cfg.features
    )


def test_kuairand_fixture_builds_the_same_on_spark(tmp_path):
    write_kuairand(tmp_path / "raw")
    cfg = load(KUAIRAND)
    _both(cfg, tmp_path / "raw", tmp_path)
    assert_same_build(tmp_path / "duckdb", tmp_path / "spark", [s.name for s in cfg.build.splits], cfg.features)


def test_a_day_build_on_spark_equals_duckdbs(taobao, tmp_path):
    cfg = load(TAOBAO)
    full = taobao / "full" / "duckdb"  # its vocabularies map the day's ids on both engines
    if not (full / "manifest.json").is_file():
        build(cfg, str(taobao / "raw"), str(full), threads=2)
    for engine in ("duckdb", "spark"):
        build_days(
            cfg, str(taobao / "raw"), str(tmp_path / engine), ["2017-05-12"], str(full), threads=2, engine=engine
        )
    day = Path("days") / "2017-05-12"
    a, b = _read(tmp_path / "duckdb" / day), _read(tmp_path / "spark" / day)
    assert a.num_rows > 100 and b.schema.equals(a.schema, check_metadata=True)
    rid = cfg.features.columns.request_id
    assert _by_request(b, rid).equals(_by_request(a, rid))


# --- the translation's meaning, and a user's mistakes ---------------------------------------------------


EXPRESSIONS = [
    "epoch(timezone('Asia/Shanghai', CAST(ts AS TIMESTAMP)))",
    "CAST(timezone('Asia/Shanghai', to_timestamp(s)) AS DATE)",
    "coalesce(TRY_CAST(txt AS DOUBLE), epoch(timezone('UTC', TRY_CAST(txt AS TIMESTAMP))))",
    "CAST(try_strptime(CAST(d AS VARCHAR), '%Y%m%d') AS DATE)",
    "n / 1000.0",
    "n / 7",
    "list_reverse(list_slice(l, greatest(k - 2, 0) + 1, k))",
    "[x + 1 FOR x IN l]",
    "list_filter(list_transform(string_split(tags, ','), lambda x: TRY_CAST(trim(x) AS BIGINT) + 1), "
    "lambda x: x IS NOT NULL)",
    "(hash(CAST(n AS BIGINT), CAST(k AS BIGINT), CAST(7 AS BIGINT)) % 1000000) / 1000000.0",
    "CASE WHEN n > 50 THEN 'big' ELSE 'small' END || '_' || k",
    "array_length(l)",
    # A typed header (RecBole's user_id:token) is named double-quoted, as on DuckDB.
    '"n:token" * 2 + n',
    """CASE "n:token" WHEN 1 THEN 'one' ELSE 'other' END""",
]


def test_translated_expressions_mean_what_they_mean_on_duckdb(tmp_path):
    from pinads_rec.data.build.spark_engine import SparkEngine

    rows = pa.table(
        {
            "ts": ["2017-05-06 23:59:59.250", "2024-03-10 02:30:00", "2000-01-01 00:00:00"],
            "s": [1494086399.5, 1710037800.0, 946684800.0],
            "txt": ["1494086399.25", "2024-03-10 02:30:00", "x"],
            "d": [20220408, 20200229, 19991231],
            "n": [123, -45, 0],
            "k": [3, 1, 0],
            "l": [[1, 2, 3, 4], [5], [6, 7]],
            "tags": ["1, 2,x", "", "40"],
            "n:token": [1, 2, 3],
        }
    )
    pq.write_table(rows, tmp_path / "t.parquet")
    con = duckdb.connect()
    con.execute(f"CREATE VIEW t AS SELECT * FROM read_parquet('{tmp_path / 't.parquet'}')")
    engine = SparkEngine(2, str(tmp_path / "spill"), None)
    try:
        engine.execute(f"CREATE TEMP VIEW t AS SELECT * FROM read_parquet('{tmp_path / 't.parquet'}')")
        for expr in EXPRESSIONS:
            want = con.execute(f"SELECT {expr} FROM t ORDER BY n").fetchall()
            got = engine.rows(f"SELECT {expr} FROM t ORDER BY n")
            assert [tuple(r) for r in got] == want, expr
            kind = con.execute(f"SELECT typeof({expr}) FROM t LIMIT 1").fetchone()[0]
            assert engine.describe(f"SELECT {expr} FROM t")[0][1] == kind, expr
    finally:
        engine.close()


def test_a_users_mistakes_get_the_same_errors_on_spark(tmp_path):
    write_taobao(tmp_path / "raw", users=40)
    cfg = load(TAOBAO, ["build.columns.pid=pid_typo"])
    with pytest.raises(ContractError, match=r"build.columns.pid: 'pid_typo' reads column 'pid_typo'"):
        build(cfg, str(tmp_path / "raw"), str(tmp_path / "out"), threads=2, engine="spark")
    # A ragged line: its file, row and line named; nothing written.
    raw = tmp_path / "raw" / "raw_sample.csv"
    lines = raw.read_text().splitlines()
    lines[5] = lines[5] + ",surplus"
    raw.write_text("\n".join(lines) + "\n")
    with pytest.raises(ContractError, match=r"raw_sample.csv, row 4 \(line 6\): .*an extra value 'surplus'"):
        build(load(TAOBAO), str(tmp_path / "raw"), str(tmp_path / "out"), threads=2, engine="spark")
    assert not (tmp_path / "out").exists()


def test_spark_refuses_string_item_ids_for_the_draw_and_says_so(tmp_path):
    write_taobao(tmp_path / "raw", users=40)
    over = ["build.impressions.item=CAST(adgroup_id AS VARCHAR)"]
    over += ["build.negative_downsampling={task: click, rates: {'430548_1007': 0.5}}"]
    with pytest.raises(ContractError, match=r"negative_downsampling: on --engine spark .*item gives VARCHAR"):
        build(load(TAOBAO, over), str(tmp_path / "raw"), str(tmp_path / "out"), threads=2, engine="spark")


def test_no_java_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "nojava"))
    with pytest.raises(ConfigError, match=r"needs a Java runtime, and JAVA_HOME=.* has no bin/java; install a Java 17"):
        check_java()
