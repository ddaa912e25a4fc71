"""The small queries every step, check and report of a build asks of its DuckDB connection: the
first row, a scalar, a column's type; a statement run as one named step, DuckDB's refusal turned
into a ContractError naming the step or the raw file's row.
"""

from __future__ import annotations

from typing import Optional

import duckdb

from pinads_rec.data.contract import ContractError
from pinads_rec.data.raw_sources import configured, explain, first_line, sql_name

INTEGERS = {"TINYINT", "SMALLINT", "INTEGER", "BIGINT", "HUGEINT", "UTINYINT", "USMALLINT", "UINTEGER", "UBIGINT"}


class Queries:
    """Mixed into ``Build``: reads its connection ``con``, its ``build:`` section ``b`` and ``raw_dir``."""

    def is_integer(self, expr: str) -> bool:
        kind = self.one(f"SELECT typeof({expr}) FROM impressions LIMIT 1")
        return bool(kind) and kind[0] in INTEGERS

    def column_type(self, table: str, column: str) -> str:
        row = self.one(f"SELECT typeof({sql_name(column)}) FROM {table} LIMIT 1")
        if row:
            return row[0]
        # No row (a day build's events of a group none of the day's users has): the declared type.
        described = self.con.execute(f"DESCRIBE SELECT {sql_name(column)} FROM {table}").fetchall()
        return described[0][1] if described else "BIGINT"

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
        rows = self.con.execute(sql).fetchall()
        return rows[0] if rows else None

    def sql(self, what: str, statement: str) -> None:
        """Runs one step, naming it in the error when DuckDB refuses (an unknown column in an
        expression, a type that does not convert, the memory limit)."""
        try:
            self.con.execute(statement)
        except duckdb.Error as e:
            raise ContractError(self.explain(e) or f"build: {what}: {first_line(e)}") from None

    def explain(self, e: duckdb.Error) -> Optional[str]:
        """DuckDB's error about a raw file as one line naming file, line, column and value."""
        return explain(e, configured(self.b, self.raw_dir))
