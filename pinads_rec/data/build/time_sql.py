"""Times and dates as SQL over the build's relations (``build``: full_build.Build, whose engine
is asked an expression's type): epoch seconds from numbers, timestamps or text, a side table's
date column as a DATE, and the date in ``build.timezone`` of a time.
"""

from __future__ import annotations

from typing import Optional

from pinads_rec.data.build.checks import bare_name_hint, missing_column_error
from pinads_rec.data.loader.contract import ContractError
from pinads_rec.data.raw_sources import RawSource
from pinads_rec.data.sql_text import first_line, sql_string


def seconds(build, expr: str, relation: str, where: str, source: Optional[RawSource] = None) -> str:
    """SQL giving ``expr`` as epoch seconds (DOUBLE): numbers as they are; timestamps without a
    zone and dates in build.timezone; text as a number, else as a timestamp. ``source``: the raw
    file ``relation`` reads, named when ``expr`` reads a column it lacks."""
    try:
        kind = build.one(f"SELECT typeof({expr}) FROM {relation} LIMIT 1")
    except build.engine.errors as e:
        missing = build.engine.missing_column(e)
        if missing and source is not None:
            raise missing_column_error(build, where, expr, missing, relation, source) from None
        hint = bare_name_hint(build, expr, relation)
        raise ContractError(f"{where}: {expr!r}: {first_line(e)}{hint}") from None
    kind = kind[0] if kind else "DOUBLE"
    tz = sql_string(build.b.timezone)
    if kind == "TIMESTAMP WITH TIME ZONE":
        return f"epoch({expr})"
    if kind.startswith("TIMESTAMP") or kind == "DATE":
        return f"epoch(timezone({tz}, CAST(({expr}) AS TIMESTAMP)))"
    if kind == "VARCHAR":
        return f"coalesce(TRY_CAST(({expr}) AS DOUBLE), epoch(timezone({tz}, TRY_CAST(({expr}) AS TIMESTAMP))))"
    return f"CAST(({expr}) AS DOUBLE)"


def date_sql(build, expr: str, source: RawSource, where: str) -> str:
    """A side table's date column as a DATE: DATE/TIMESTAMP, 20220408 or '2022-04-08'."""
    kind = build.one(f"SELECT typeof({expr}) FROM {build.scan(source)} LIMIT 1")
    kind = kind[0] if kind else "DATE"
    if kind == "DATE" or kind.startswith("TIMESTAMP"):
        return f"CAST({expr} AS DATE)"
    if kind == "VARCHAR":
        return f"coalesce(TRY_CAST({expr} AS DATE), CAST(try_strptime({expr}, '%Y%m%d') AS DATE))"
    return f"CAST(try_strptime(CAST({expr} AS VARCHAR), '%Y%m%d') AS DATE)"


def date_of(timezone: str, seconds: str) -> str:
    """SQL: the DATE, in ``timezone`` (build.timezone), of ``seconds`` (SQL giving epoch seconds)."""
    return f"CAST(timezone({sql_string(timezone)}, to_timestamp({seconds})) AS DATE)"
