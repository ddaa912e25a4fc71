"""The SQL engine a build runs on: what the build's steps ask of it, and DuckDB, the engine on one
machine (``--engine duckdb``, the default).

Every statement of the build is written once, in DuckDB's dialect (the step modules, checks.py); an
engine runs it as it is (DuckDB) or translated (``SparkEngine``, spark_engine.py; ``open_engine``,
engines.py, starts the one ``--engine`` names). What differs beyond the
dialect is here, behind one interface: how a raw source is scanned, how a query's column types are
named (always in DuckDB's names: ``BIGINT``, ``VARCHAR``, ``BIGINT[]``), how result rows reach the
driver, how a refusal is told (``errors``) and which column it missed.
"""

from __future__ import annotations

import re
import sys
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import duckdb
import pyarrow as pa

from pinads_rec.config import ConfigError
from pinads_rec.data.raw_sources import RawSource, explain
from pinads_rec.data.sql_text import sql_string


def show_progress(con: duckdb.DuckDBPyConnection) -> None:
    """DuckDB's progress bar (drawn on stdout for a statement past 2 s) only when stdout is a
    terminal: redirected into a build log, its redraws would fill the log with thousands of bars."""
    isatty = getattr(sys.stdout, "isatty", None)
    con.execute(f"SET enable_progress_bar = {'true' if isatty is not None and isatty() else 'false'}")


class Engine:
    """The interface; ``DuckDBEngine`` and ``SparkEngine`` implement it."""

    name = ""
    errors: Tuple[type, ...] = ()  # what a statement the engine refuses raises
    hashes_integers_only = False  # whether hash() takes integer arguments alone

    def execute(self, statement: str) -> None:
        """One statement: CREATE [OR REPLACE] TEMP TABLE/VIEW ... AS, DELETE, UPDATE, SET."""
        raise NotImplementedError

    def rows(self, query: str) -> List[tuple]:
        """Every row of ``query``, fetched whole."""
        raise NotImplementedError

    def describe(self, query: str) -> List[Tuple[str, str]]:
        """(name, DuckDB type name) of each column ``query`` gives, without running it."""
        raise NotImplementedError

    def batches(self, query: str, size: int) -> Iterator[pa.RecordBatch]:
        """The rows of ``query`` in its order, as Arrow batches of up to ``size`` rows."""
        raise NotImplementedError

    def scan(self, source: RawSource) -> str:
        """A table expression reading the source's files, with their columns and ``filename``
        (the file's path as ``source.files`` names it)."""
        raise NotImplementedError

    def copy_parquet(self, query: str, path: str) -> None:
        """The rows of ``query`` as one Parquet file at ``path`` (on the driver)."""
        raise NotImplementedError

    def missing_column(self, error: Exception) -> Optional[str]:
        """The column a refused statement read and no relation has, if that was the refusal."""
        raise NotImplementedError

    def explain(self, error: Exception, sources: Sequence[RawSource]) -> Optional[str]:
        """A refusal about a raw file of ``sources`` as one line naming its file, row, column and
        value; None when it is not about one."""
        raise NotImplementedError

    def versions(self) -> Dict[str, str]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class DuckDBEngine(Engine):
    """One DuckDB connection: every core (or ``threads``), spilling into ``spill_dir`` beyond
    ``memory_limit``."""

    name = "duckdb"
    errors = (duckdb.Error,)

    def __init__(self, threads: int, spill_dir: str, memory_limit: Optional[str]):
        self.con = duckdb.connect()
        self.con.execute(f"SET threads = {int(threads)}")
        self.con.execute(f"SET temp_directory = {sql_string(spill_dir)}")
        self.con.execute("SET preserve_insertion_order = false")
        show_progress(self.con)
        if memory_limit:
            try:
                self.con.execute(f"SET memory_limit = {sql_string(memory_limit)}")
            except duckdb.Error as e:
                raise ConfigError(f"--memory-limit {memory_limit!r}: {str(e).splitlines()[0]}") from None

    def execute(self, statement: str) -> None:
        self.con.execute(statement)

    def rows(self, query: str) -> List[tuple]:
        return self.con.execute(query).fetchall()

    def describe(self, query: str) -> List[Tuple[str, str]]:
        return [(r[0], r[1]) for r in self.con.execute(f"DESCRIBE {query}").fetchall()]

    def batches(self, query: str, size: int) -> Iterator[pa.RecordBatch]:
        yield from self.con.sql(query).to_arrow_reader(size)

    def scan(self, source: RawSource) -> str:
        return source.scan()

    def copy_parquet(self, query: str, path: str) -> None:
        # DuckDB writes no page checksums (and has no option to): the manifest's sha256 guards these
        # files (the vocabularies), checked by their reader (Vocabularies.load).
        self.con.execute(f"COPY ({query}) TO {sql_string(path)} (FORMAT parquet)")

    def missing_column(self, error: Exception) -> Optional[str]:
        missing = re.search(r'Referenced column "(.+?)" not found', str(error))
        return missing.group(1) if missing else None

    def explain(self, error: Exception, sources: Sequence[RawSource]) -> Optional[str]:
        return explain(error, sources)

    def versions(self) -> Dict[str, str]:
        return {"duckdb": duckdb.__version__}

    def close(self) -> None:
        self.con.close()
