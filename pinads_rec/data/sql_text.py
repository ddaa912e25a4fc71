"""SQL text of the build's statements and messages: names and strings quoted, a returned value
written as SQL again, the bare columns an expression reads (by DuckDB's own parser), and an engine's
message cut to one printable line (a raw value quoted in it can hold control bytes).
"""

from __future__ import annotations

import json
from typing import List

import duckdb


def sql_string(text: str) -> str:
    """``text`` as a SQL string literal; a NUL byte, which a literal cannot hold, as ``chr(0)``."""
    return " || chr(0) || ".join("'" + part.replace("'", "''") + "'" for part in text.split("\x00"))


def sql_name(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


_PARSER = duckdb.connect()  # DuckDB's parser, for the config's expressions


def columns_read(expr: str) -> List[str]:
    """The bare column names SQL ``expr`` reads, in order, once each (``profile.x``, a side
    table's field, is not one); none if it does not parse."""
    if not expr:
        return []
    tree = json.loads(_PARSER.execute(f"SELECT json_serialize_sql({sql_string('SELECT ' + expr)})").fetchone()[0])
    names: List[str] = []

    def walk(node) -> None:
        if isinstance(node, dict):
            if node.get("class") == "COLUMN_REF" and len(node.get("column_names", [])) == 1:
                name = node["column_names"][0]
                if name not in names:
                    names.append(name)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    if not tree.get("error"):
        walk(tree.get("statements", []))
    return names


def column_value(column: str, value) -> str:
    """``column 'c': value 'v'`` as an error names a raw value (``no value``: blank or a null marker)."""
    return f"column {column!r}: " + ("no value" if value is None else f"value {printable(repr(value))}")


# Values a query returns that SQL writes as a cast of their text.
_CAST_AS = {"date": "DATE", "datetime": "TIMESTAMP", "time": "TIME", "Decimal": "DECIMAL(38, 10)", "float": "DOUBLE"}


def sql_literal(value) -> str:
    """A value a query returned, as SQL again (to find the rows holding it)."""
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, int):
        return str(value)
    kind = _CAST_AS.get(type(value).__name__)
    return f"CAST({sql_string(str(value))} AS {kind})" if kind else sql_string(str(value))


def first_line(e) -> str:
    """DuckDB's message (an error, or its text) without the hints and context below it, printable."""
    return printable(str(e).strip().splitlines()[0])


def printable(text: str) -> str:
    """``text`` with each character a terminal would act on (control bytes, a stray escape) written
    as its Python escape: a value quoted from a raw file in a message."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def identifier(name: str) -> str:
    """``name`` with each character but a letter or digit as ``_``: a part of a temp table's name."""
    return "".join(ch if ch.isalnum() else "_" for ch in name)
