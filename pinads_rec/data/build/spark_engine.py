"""The build on Apache Spark (``--engine spark``): the same statements, translated (spark_sql.py), run
by Spark SQL through PySpark, on ``local[N]`` here or on whatever master ``spark-submit`` gives.

- **Tables**: a ``CREATE TEMP TABLE`` is a DataFrame computed and checkpointed (its lineage cut),
  under a temp view of its name; a table replaced by a statement reading it is computed before the
  old one is released. ``DELETE`` and ``UPDATE`` become the table re-selected (Spark's views cannot
  be changed in place). Views stay lazy, as DuckDB's.
- **Raw files**: read by Spark's own readers (``scan``): CSV with a header, the source's delimiter,
  encoding and null marker, types inferred over the whole file (integers as BIGINT, DuckDB's
  choice), files with different headers united by name (DuckDB's ``union_by_name``), every line's
  field count checked first (Spark's reader would drop or fill fields silently); Parquet as
  written. ``filename`` is each row's file as ``source.files`` names it.
- **Session**: UTC, timestamps without a zone as ``TIMESTAMP_NTZ`` (what the translated times
  assume), DuckDB's hash registered as ``duckdb_hash``. Without a master from ``spark-submit``:
  ``local[threads]``, ``--memory-limit`` as the driver's memory.
- **Errors**: Spark's refusals as one line (``SparkRefusal``); a malformed CSV line or a value that
  does not convert is found again in the raw file, as for DuckDB (raw_sources.py).

The rows come back to the driver in order (``batches``, Arrow): the contract files, vocabularies,
summary and manifest are written there by the same code as on DuckDB.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import sqlglot
from sqlglot import exp

from pinads_rec.config import ConfigError
from pinads_rec.data import page_checksums
from pinads_rec.data.build.engine import Engine
from pinads_rec.data.build.spark_sql import HASH_UDF, Untranslatable, duckdb_hash, parse, to_spark
from pinads_rec.data.loader.contract import ContractError
from pinads_rec.data.raw_sources import RawSource, explain, is_remote
from pinads_rec.data.sql_text import first_line, sql_name

MIN_JAVA = 17  # what PySpark 4 runs on
MIN_DRIVER_MIB = 512  # below ~450 MiB of heap Spark refuses to start


class SparkRefusal(Exception):
    """A statement Spark (or the translation) refused, as one line."""


def check_java() -> str:
    """The Java runtime Spark will start (``JAVA_HOME`` or ``java`` on the PATH), checked: version
    ``MIN_JAVA`` or newer; a ConfigError naming the fix otherwise."""
    home = os.environ.get("JAVA_HOME")
    java = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    fix = (
        f"install a Java {MIN_JAVA}+ runtime (Debian/Ubuntu: apt-get install openjdk-{MIN_JAVA}-jre-headless) or "
        f"set JAVA_HOME to one"
    )
    if not java or not os.access(java, os.X_OK):
        where = f"JAVA_HOME={home} has no bin/java" if home else "no java on the PATH and JAVA_HOME is unset"
        raise ConfigError(f"--engine spark: Spark needs a Java runtime, and {where}; {fix}")
    # -XX:-UsePerfData: a version check leaves no /tmp/hsperfdata_<user> file behind.
    shown = subprocess.run([java, "-XX:-UsePerfData", "-version"], capture_output=True, text=True).stderr
    found = re.search(r'version "(\d+)(?:\.(\d+))?', shown)
    major = int(found.group(1)) if found else 0
    if major == 1 and found.group(2):  # "1.8.0": Java 8
        major = int(found.group(2))
    if major < MIN_JAVA:
        raise ConfigError(f"--engine spark: {java} is Java {major or '?'}; PySpark 4 needs {MIN_JAVA}+: {fix}")
    return java


def _driver_memory(limit: str) -> str:
    """``--memory-limit`` (DuckDB's form, ``2GB`` / ``512MiB``) as Spark's ``2048m``."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", limit.upper())
    if not found:
        raise ConfigError(f"--memory-limit {limit!r}: give a size such as 2GB or 512MB")
    scale = {"": 1 / 2**20, "K": 1 / 2**10, "M": 1, "G": 2**10, "T": 2**20}[found.group(2)]
    mib = int(float(found.group(1)) * scale)
    if mib < MIN_DRIVER_MIB:
        raise ConfigError(
            f"--memory-limit {limit!r}: Spark's driver needs at least {MIN_DRIVER_MIB} MB (give 1GB or more)"
        )
    return f"{mib}m"


class SparkEngine(Engine):
    name = "spark"
    errors = (SparkRefusal,)
    hashes_integers_only = True  # duckdb_hash reproduces DuckDB's hash of integers

    def __init__(self, threads: int, spill_dir: str, memory_limit: Optional[str]):
        try:
            from pyspark import SparkConf
            from pyspark.sql import SparkSession
        except ImportError:
            raise ConfigError(
                "--engine spark: PySpark is not installed (make setup installs the locked version)"
            ) from None
        check_java()
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # workers import this environment's numpy
        builder = SparkSession.builder.appName("pinads_rec build")
        local = not SparkConf().contains("spark.master")  # spark-submit sets the master
        if local:
            builder = builder.master(f"local[{int(threads)}]")
            builder = builder.config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
            builder = builder.config("spark.sql.shuffle.partitions", str(max(2, 2 * int(threads))))
            if memory_limit:
                builder = builder.config("spark.driver.memory", _driver_memory(memory_limit))
        self.spark = builder.getOrCreate()
        self.spark.sparkContext.setLogLevel("FATAL")  # its refusals reach the user as ContractErrors
        conf = self.spark.conf
        conf.set("spark.sql.session.timeZone", "UTC")
        conf.set("spark.sql.timestampType", "TIMESTAMP_NTZ")
        conf.set("spark.sql.execution.arrow.pyspark.enabled", "true")
        self._register_hash()
        self.tables: Dict[str, object] = {}  # name -> its persisted DataFrame
        self.scans: Dict[Tuple, str] = {}  # a source's files and format -> its view

    def _register_hash(self) -> None:
        from pyspark.sql.functions import pandas_udf

        self.spark.udf.register(HASH_UDF, pandas_udf(_hash_rows, "bigint"))

    # --- statements ------------------------------------------------------------------------------

    def execute(self, statement: str) -> None:
        with _refusals():
            tree = parse(statement)
            if isinstance(tree, exp.Create):
                name = tree.this.name
                df = self.spark.sql(to_spark(tree.expression))
                if tree.args.get("kind", "").upper() == "VIEW":
                    df.createOrReplaceTempView(name)
                else:
                    self._store(name, df)
            elif isinstance(tree, exp.Delete):
                name = tree.this.name
                where = to_spark(tree.args["where"].this)
                self._store(name, self.spark.sql(f"SELECT * FROM {name} WHERE NOT coalesce(({where}), false)"))
            elif isinstance(tree, exp.Update):
                self._update(tree)
            else:
                raise Untranslatable(f"a {type(tree).__name__} statement ({first_line(statement)})")

    def _update(self, tree) -> None:
        name = tree.this.name
        if tree.args.get("from_") or tree.args.get("from"):
            raise Untranslatable(f"UPDATE {name} ... FROM (write it as a join)")
        sets = {eq.this.name: to_spark(eq.expression) for eq in tree.expressions}
        where = tree.args.get("where")
        test = f"coalesce(({to_spark(where.this)}), false)" if where else "true"
        columns = [
            f"CASE WHEN {test} THEN ({sets[c]}) ELSE `{c}` END AS `{c}`" if c in sets else f"`{c}`"
            for c in self.spark.table(name).columns
        ]
        self._store(name, self.spark.sql(f"SELECT {', '.join(columns)} FROM {name}"))

    def _store(self, name: str, df) -> None:
        """``df`` computed and kept as table ``name``, its lineage cut (a plan over every earlier
        step would be analysed again at each use): checkpointed where the session has a checkpoint
        directory (reliable, on a cluster), else locally (the executors' blocks, memory then disk)."""
        if self.spark.sparkContext.getCheckpointDir():
            df = df.checkpoint(eager=True)
        else:
            df = df.localCheckpoint(eager=True)
        old = self.tables.get(name)
        df.createOrReplaceTempView(name)
        self.tables[name] = df
        if old is not None:
            old.unpersist()

    def rows(self, query: str) -> List[tuple]:
        with _refusals():
            return [tuple(r) for r in self.spark.sql(to_spark(query)).collect()]

    def describe(self, query: str) -> List[Tuple[str, str]]:
        with _refusals():
            schema = self.spark.sql(to_spark(query)).schema
        return [(f.name, duckdb_type(f.dataType)) for f in schema.fields]

    def batches(self, query: str, size: int) -> Iterator[pa.RecordBatch]:
        with _refusals():
            table = self.spark.sql(to_spark(query)).toArrow()
        yield from table.to_batches(max_chunksize=size)

    def copy_parquet(self, query: str, path: str) -> None:
        with _refusals():
            table = self.spark.sql(to_spark(query)).toArrow()
        pq.write_table(table, path, **page_checksums.WRITE)

    # --- raw files -------------------------------------------------------------------------------

    def scan(self, source: RawSource) -> str:
        key = (source.files, source.format, source.delimiter, source.null_values, source.names, source.encoding)
        if key in self.scans:
            return self.scans[key]
        with _refusals():
            df = self._read_csv(source) if source.format == "csv" else self._read_parquet(source)
            named = {os.path.abspath(f): f for f in source.files}
            from pyspark.sql import functions as F

            local = F.regexp_replace(F.expr("url_decode(_metadata.file_path)"), "^file:", "")
            mapping = F.create_map(*[F.lit(x) for pair in named.items() for x in pair])
            df = df.select("*", F.coalesce(F.element_at(mapping, local), local).alias("filename"))
        view = f"__raw{len(self.scans)}"
        df.createOrReplaceTempView(view)
        self.scans[key] = view
        return view

    def _read_csv(self, source: RawSource):
        markers = [v for v in source.null_values if v != ""]
        if len(markers) > 1:
            raise ConfigError(
                f"{source.where}.null_values: {source.null_values}: Spark reads one null marker besides the blank "
                f"field; keep one"
            )
        reader = self.spark.read.options(
            header=not source.names,
            sep=source.delimiter,
            encoding=source.encoding,
            inferSchema=True,
            escape='"',
            mode="FAILFAST",
            nullValue=markers[0] if markers else "",
        )
        groups: Dict[Tuple[str, ...], List[str]] = {}  # files of one header read together
        for path in source.files:
            header = () if is_remote(path) else tuple(source.header(path))  # remote: Spark reads it
            groups.setdefault(header, []).append(path)
        frames = []
        for header, files in groups.items():
            df = reader.csv(files)
            header = header or tuple(c.strip() for c in df.columns)
            self._check_fields(source, files, len(header))
            frames.append(df.toDF(*header) if len(header) == len(df.columns) else df)
        df = frames[0]
        for other in frames[1:]:
            df = df.unionByName(other, allowMissingColumns=True)
        from pyspark.sql import functions as F
        from pyspark.sql.types import IntegerType, LongType, ShortType

        def column(f):
            c = F.col("`" + f.name.replace("`", "``") + "`")
            return c.cast(LongType()).alias(f.name) if isinstance(f.dataType, (IntegerType, ShortType)) else c

        return df.select(*[column(f) for f in df.schema.fields])

    def _check_fields(self, source: RawSource, files: List[str], width: int) -> None:
        """Every line of ``files`` holds ``width`` fields, or a ContractError naming the first that
        does not (its file, row, line and what is wrong: raw_sources.py). Spark's reader would drop
        a surplus field and fill a missing one with null without a word."""
        from pyspark.sql import functions as F

        d = re.escape(source.delimiter)
        field = f'(?:^|{d})(?:"(?:[^"]|"")*"|[^{d}"]*)'
        lines = self.spark.read.text(files).select(F.col("value"), F.col("_metadata.file_path").alias("file"))
        bad = lines.where((F.length("value") > 0) & (F.regexp_count("value", F.lit(field)) != width)).limit(1).collect()
        if not bad:
            return
        found = _first_bad_line(source, files)  # the exact line, re-read on the driver
        if found:
            raise ContractError(found)
        raise ContractError(
            f"{source.where}: {bad[0]['file']}: a line of other than {width} fields: {bad[0]['value']!r}"
        )

    def _read_parquet(self, source: RawSource):
        return self.spark.read.option("mergeSchema", "true").parquet(*source.files)

    # --- errors ----------------------------------------------------------------------------------

    def missing_column(self, error: Exception) -> Optional[str]:
        found = re.search(r"name `?([^`\s]+?)`? cannot be resolved", str(error))
        return found.group(1).split(".")[-1].strip("`") if found else None

    def explain(self, error: Exception, sources: Sequence[RawSource]) -> Optional[str]:
        text = str(error)
        if "MALFORMED" in text:  # a line Spark could not parse: found again in the CSV files
            for source in sources:
                found = _first_bad_line(source, source.files) if source.format == "csv" else None
                if found:
                    return found
        cast = re.search(r"The value '(.*?)' of the type \"STRING\" cannot be cast to \"(\w+)\"", text)
        if cast:  # as DuckDB says it, for the search in the raw files
            return explain(f"Could not convert string '{cast.group(1)}' to {cast.group(2)}", sources)
        return None

    def versions(self) -> Dict[str, str]:
        return {"spark": self.spark.version, "sqlglot": sqlglot.__version__}

    def close(self) -> None:
        for df in self.tables.values():
            df.unpersist()
        self.spark.catalog.clearCache()
        self.spark.stop()


@contextmanager
def _refusals():
    """Spark's exceptions (and an untranslatable statement) as ``SparkRefusal``: one line, the
    innermost error class Spark names (a task's failure wraps the cause in its stage's)."""
    from py4j.protocol import Py4JError
    from pyspark.errors import PySparkException

    try:
        yield
    except Untranslatable as error:
        raise SparkRefusal(f"not translated to Spark SQL: {error}") from None
    except (PySparkException, Py4JError, sqlglot.errors.SqlglotError) as error:
        raise SparkRefusal(_one_line(str(error))) from None


def _first_bad_line(source: RawSource, files: Sequence[str]) -> Optional[str]:
    """The first line of the local ``files`` of ``source`` that is not a row of it, named (file, row,
    line, what is wrong: raw_sources.py); None when every line is one."""
    for path in files:
        if not is_remote(path):
            found = source.first_bad_line(path)
            if found:
                return f"{source.where}: {source.at(path, found[0] - 1 - (not source.names))}: {found[1]}"
    return None


def _hash_rows(rows: pd.Series) -> pd.Series:
    """``duckdb_hash`` over a batch of rows, each an array of the hashed integers."""
    hashed = duckdb_hash(np.stack(rows.to_numpy())) if len(rows) else []
    return pd.Series(hashed, dtype="int64")


def _one_line(text: str) -> str:
    classes = re.findall(r"(\[[A-Z][A-Z0-9_.]+\][^\n]*)", text)
    return (classes[-1] if classes else first_line(text)).strip()


def duckdb_type(kind) -> str:
    """A Spark SQL type under DuckDB's name for it (``BIGINT``, ``VARCHAR``, ``BIGINT[]``)."""
    from pyspark.sql import types as T

    simple = {
        T.LongType: "BIGINT",
        T.IntegerType: "INTEGER",
        T.ShortType: "SMALLINT",
        T.ByteType: "TINYINT",
        T.DoubleType: "DOUBLE",
        T.FloatType: "FLOAT",
        T.StringType: "VARCHAR",
        T.BooleanType: "BOOLEAN",
        T.DateType: "DATE",
        T.TimestampType: "TIMESTAMP WITH TIME ZONE",
        T.TimestampNTZType: "TIMESTAMP",
        T.BinaryType: "BLOB",
        T.NullType: '"NULL"',
    }
    for cls, name in simple.items():
        if isinstance(kind, cls):
            return name
    if isinstance(kind, T.DecimalType):
        return f"DECIMAL({kind.precision},{kind.scale})"
    if isinstance(kind, T.ArrayType):
        return duckdb_type(kind.elementType) + "[]"
    if isinstance(kind, T.StructType):
        return "STRUCT(" + ", ".join(f"{sql_name(f.name)} {duckdb_type(f.dataType)}" for f in kind.fields) + ")"
    return kind.simpleString().upper()
