"""Raw log files as DuckDB relations: which files a source names, how they are scanned, and where a
bad row sits (file and row) when a check fails.

A source is a list of files or globs (relative to the raw directory), CSV or Parquet. Scans are
lazy SQL (``read_csv`` / ``read_parquet``): DuckDB streams them, in parallel, under the build's
memory limit. Header names are stripped of surrounding spaces. Every scan exposes DuckDB's virtual
``filename`` column, so a check can name the file; ``locate`` then finds the first offending row
of that file with a single-threaded ordered scan (only on the error path).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

import duckdb

from pinads_rec.config import RawSourceConfig
from pinads_rec.data.contract import ContractError

CSV_SUFFIXES = (".csv", ".csv.gz", ".tsv", ".tsv.gz", ".txt")
PARQUET_SUFFIXES = (".parquet", ".pq")


def sql_string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def sql_name(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


@dataclass(frozen=True)
class RawSource:
    """One configured raw table: ``where`` names it in errors (``build.impressions``)."""

    where: str
    files: Tuple[str, ...]
    format: str  # csv | parquet
    delimiter: str
    null_values: Tuple[str, ...]
    names: Tuple[str, ...] = ()  # a CSV without a header: its column names
    encoding: str = "utf-8"

    @classmethod
    def of(cls, cfg: RawSourceConfig, raw_dir: str, where: str) -> "RawSource":
        if not cfg.path:
            raise ContractError(f"{where}.path: no file given")
        files: List[str] = []
        for pattern in cfg.path:
            full = pattern if os.path.isabs(pattern) else os.path.join(raw_dir, pattern)
            found = sorted(glob.glob(full)) if glob.has_magic(full) else ([full] if os.path.isfile(full) else [])
            if not found:
                raise ContractError(f"{where}.path: no file matches {pattern!r} (looked for {full})")
            files += found
        fmt = cfg.format
        if fmt == "auto":
            kinds = {_kind(f) for f in files}
            if None in kinds or len(kinds) != 1:
                raise ContractError(
                    f"{where}.format: cannot tell CSV from Parquet for {files[:3]} by their names; "
                    f"set format: csv or parquet"
                )
            fmt = kinds.pop()
        return cls(where, tuple(files), fmt, cfg.delimiter, tuple(cfg.null_values), tuple(cfg.names), cfg.encoding)

    def scan(self, files: Optional[Tuple[str, ...]] = None) -> str:
        """The SQL table expression reading the files (all of them by default)."""
        names = "[" + ", ".join(sql_string(f) for f in (files or self.files)) + "]"
        if self.format == "parquet":
            return f"read_parquet({names}, union_by_name = true)"
        nulls = "[" + ", ".join(sql_string(v) for v in self.null_values) + "]"
        header = "header = true"
        if self.names:
            header = "header = false, names = [" + ", ".join(sql_string(n) for n in self.names) + "]"
        return (
            f"read_csv({names}, {header}, delim = {sql_string(self.delimiter)}, nullstr = {nulls}, "
            f"encoding = {sql_string(self.encoding)}, union_by_name = true)"
        )

    def columns(self, con: duckdb.DuckDBPyConnection) -> List[str]:
        try:
            return [row[0] for row in con.execute(f"DESCRIBE SELECT * FROM {self.scan()}").fetchall()]
        except duckdb.Error as e:
            raise ContractError(f"{self.where}: cannot read {self.files[0]}: {_first_line(e)}") from None

    def locate(self, path: str, condition: str) -> Optional[int]:
        """The 0-based data row (header excluded) of ``path`` where ``condition`` (SQL over the
        file's columns) first holds, scanning in file order on one thread; None if it never does."""
        con = duckdb.connect()
        con.execute("SET threads = 1")
        con.execute("SET preserve_insertion_order = true")
        try:
            row = con.execute(
                f"SELECT __row FROM (SELECT row_number() OVER () - 1 AS __row, * FROM {self.scan((path,))}) "
                f"WHERE {condition} ORDER BY __row LIMIT 1"
            ).fetchone()
        except duckdb.Error:
            return None
        finally:
            con.close()
        return None if row is None else int(row[0])

    def place(self, path: str, condition: str) -> str:
        """``file, row N`` (CSV: also its line) of the first row where condition holds."""
        row = self.locate(path, condition)
        if row is None:
            return path
        line = f" (line {row + 1 + (not self.names)})" if self.format == "csv" else ""
        return f"{path}, row {row}{line}"


def _kind(path: str) -> Optional[str]:
    low = path.lower()
    if low.endswith(CSV_SUFFIXES):
        return "csv"
    if low.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return None


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0]
