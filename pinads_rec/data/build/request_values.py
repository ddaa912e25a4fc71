"""A live request's values against the raw logs' types (live.py): ``RawColumn``, a raw log's column
and its DuckDB type; ``check_value``, a JSON value that fits it or a ``RequestError`` naming the
field and the value; ``raw_table``, a request's rows as an Arrow table typed as the log is.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Callable, Dict, List, Optional

import pyarrow as pa

from pinads_rec.config import ConfigError


class RequestError(ValueError):
    """A request the service refuses: ``field`` (e.g. ``requests[0].candidates[3].item_id``) and why."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclasses.dataclass
class RawColumn:
    """One column of a raw log: its DuckDB type, as read from the log's files."""

    name: str
    duck_type: str

    def arrow_type(self) -> pa.DataType:
        return _arrow_type(self.duck_type)


_INTEGER = re.compile(r"^(TINYINT|SMALLINT|INTEGER|BIGINT|HUGEINT|UTINYINT|USMALLINT|UINTEGER|UBIGINT)$")
_FLOAT = re.compile(r"^(FLOAT|DOUBLE|REAL|DECIMAL.*)$")


def check_value(value: Any, duck_type: str, place: str) -> None:
    """``value`` (JSON) fits a column of ``duck_type``, else RequestError naming ``place`` and the value."""
    if value is not None:  # None: a blank field, as a log may have (a default or the build's check decides)
        _checker(duck_type)(value, place)


@functools.lru_cache(maxsize=None)
def _checker(duck_type: str) -> Callable[[Any, str], None]:
    """The check of a non-null value of ``duck_type``, made once per type (requests carry thousands of values)."""
    inner = re.match(r"^(.*)\[(\d*)\]$", duck_type)
    if inner:
        size = int(inner.group(2)) if inner.group(2) else None
        element = inner.group(1)
        fits = _fits(element)

        def check_list(value: Any, place: str) -> None:
            if not isinstance(value, list):
                raise RequestError(place, f"{_show(value)} is not a list ({duck_type} in the raw log)")
            if size is not None and len(value) != size:
                raise RequestError(place, f"a list of {len(value)} values; the raw log's {duck_type} holds {size}")
            if fits is None or not all(v is None or fits(v) for v in value):
                for i, v in enumerate(value):  # the slow path names the element
                    check_value(v, element, f"{place}[{i}]")

        return check_list
    fits = _fits(duck_type)
    what = "an integer" if _INTEGER.match(duck_type) else "a finite number" if _FLOAT.match(duck_type) else None
    if what is None:
        what = "true or false" if duck_type == "BOOLEAN" else "a string"

    def check(value: Any, place: str) -> None:
        if fits is not None and not fits(value):
            if what == "an integer" and isinstance(value, int) and not isinstance(value, bool):
                raise RequestError(place, f"{value} does not fit a 64-bit integer")
            raise RequestError(place, f"{_show(value)} is not {what} ({duck_type} in the raw log)")

    return check


def _fits(duck_type: str) -> Optional[Callable[[Any], bool]]:
    """A fast test of a scalar of ``duck_type`` (None: not a scalar type checked here)."""
    if _INTEGER.match(duck_type):
        return lambda v: type(v) is int and -(1 << 63) <= v < (1 << 63)
    if _FLOAT.match(duck_type):
        return lambda v: (type(v) is float and math.isfinite(v)) or type(v) is int
    if duck_type in ("VARCHAR", "DATE") or duck_type.startswith("TIMESTAMP"):
        return lambda v: type(v) is str
    if duck_type == "BOOLEAN":
        return lambda v: type(v) is bool
    return None


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _arrow_type(duck_type: str) -> pa.DataType:
    inner = re.match(r"^(.*)\[(\d*)\]$", duck_type)
    if inner:
        child = _arrow_type(inner.group(1))
        return pa.list_(child, int(inner.group(2))) if inner.group(2) else pa.list_(child)
    simple = {
        "TINYINT": pa.int8(),
        "SMALLINT": pa.int16(),
        "INTEGER": pa.int32(),
        "BIGINT": pa.int64(),
        "UTINYINT": pa.uint8(),
        "USMALLINT": pa.uint16(),
        "UINTEGER": pa.uint32(),
        "UBIGINT": pa.uint64(),
        "FLOAT": pa.float32(),
        "REAL": pa.float32(),
        "DOUBLE": pa.float64(),
        "VARCHAR": pa.string(),
        "BOOLEAN": pa.bool_(),
        "DATE": pa.string(),  # given as text; the build's expressions cast it as they cast the log's
    }
    if duck_type in simple:
        return simple[duck_type]
    if duck_type.startswith("TIMESTAMP"):
        return pa.string()
    if duck_type.startswith("DECIMAL"):
        return pa.float64()
    raise ConfigError(f"a raw log column of type {duck_type}: not a type a live request can carry")


def raw_table(rows: List[dict], columns: Dict[str, RawColumn]) -> pa.Table:
    """``rows`` as a table of ``columns`` with their raw types (absent fields null)."""
    return pa.table({n: pa.array([row.get(n) for row in rows], type=c.arrow_type()) for n, c in columns.items()})
