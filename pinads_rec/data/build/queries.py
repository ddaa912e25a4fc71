"""The small queries every step, check and report of a build asks of its engine (engine.py): the
first row, a scalar, a column's type (in DuckDB's names), a relation's columns; a statement run as
one named step, the engine's refusal turned into a ContractError naming the step or the raw file's
row.
"""

from __future__ import annotations

from typing import Dict, List, Optional

from pinads_rec.data.loader.contract import ContractError
from pinads_rec.data.raw_sources import RawSource, configured
from pinads_rec.data.sql_text import first_line, sql_name

INTEGERS = {"TINYINT", "SMALLINT", "INTEGER", "BIGINT", "HUGEINT", "UTINYINT", "USMALLINT", "UINTEGER", "UBIGINT"}


class Queries:
    """The base of ``Build`` (full_build.py), whose state it reads: its engine ``engine``, its ``build:``
    section ``b`` and ``raw_dir``. A live batch (live.py) keeps the answers about types."""

    def type_of(self, expr: str, relation: Optional[str] = None) -> str:
        """The type (DuckDB's name) of SQL ``expr`` over ``relation`` (none: a constant)."""
        return self.engine.describe(f"SELECT ({expr}){f' FROM {relation}' if relation else ''}")[0][1]

    def is_integer(self, expr: str) -> bool:
        return self.type_of(expr, "impressions") in INTEGERS

    def column_type(self, table: str, column: str) -> str:
        return self.type_of(sql_name(column), table)

    def columns_of(self, relation: str) -> List[str]:
        return [name for name, _ in self.engine.describe(f"SELECT * FROM {relation}")]

    def select_list(self, table: str, replace: Optional[Dict[str, str]] = None, exclude=(), qualifier: str = "") -> str:
        """``table``'s columns as a SELECT list (each ``qualifier.column``), those in ``replace``
        given by its SQL instead, those in ``exclude`` left out: DuckDB's ``* EXCLUDE / REPLACE``
        spelled in SQL any engine reads."""
        replace = replace or {}
        prefix = f"{qualifier}." if qualifier else ""
        return ", ".join(
            f"{replace[c]} AS {sql_name(c)}" if c in replace else f"{prefix}{sql_name(c)}"
            for c in self.columns_of(table)
            if c not in exclude
        )

    def is_list_column(self, table: str, column: str) -> bool:
        return self.column_type(table, column).endswith("[]")

    def is_integer_column(self, table: str, column: str, lists_ok: bool = False) -> bool:
        kind = self.column_type(table, column)
        return kind in INTEGERS or (lists_ok and kind.endswith("[]") and kind[:-2] in INTEGERS)

    def scalar(self, sql: str):
        row = self.one(sql)
        return row[0] if row else None

    def one(self, sql: str) -> Optional[tuple]:
        """The first row (the whole result is fetched: DuckDB refuses new work beside an open one)."""
        rows = self.engine.rows(sql)
        return rows[0] if rows else None

    def rows(self, sql: str) -> List[tuple]:
        return self.engine.rows(sql)

    def scan(self, source: RawSource) -> str:
        """The table expression reading ``source``'s files on the engine."""
        return self.engine.scan(source)

    def source_columns(self, source: RawSource) -> List[str]:
        try:
            columns = self.columns_of(self.scan(source))
        except self.engine.errors as e:
            raise ContractError(
                self.engine.explain(e, [source]) or f"{source.where}: cannot read {source.files[0]}: {first_line(e)}"
            ) from None
        if self.engine.name == "duckdb" and source.read_apart():  # the file a row came from, not the file's own
            columns.remove("filename")
        return columns

    def sql(self, what: str, statement: str) -> None:
        """Runs one step, naming it in the error when the engine refuses (an unknown column in an
        expression, a type that does not convert, the memory limit)."""
        try:
            self.engine.execute(statement)
        except self.engine.errors as e:
            raise ContractError(self.explain(e) or f"build: {what}: {first_line(e)}") from None

    def explain(self, e: Exception) -> Optional[str]:
        """The engine's error about a raw file as one line naming file, line, column and value."""
        return self.engine.explain(e, configured(self.b, self.raw_dir))
