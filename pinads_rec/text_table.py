"""Fixed-width text tables: the one formatter behind the console's metrics table, the planner's
report and ``inspect``'s report (and the experiments' console output)."""

from __future__ import annotations

import re
from typing import Iterable, List, Optional, Sequence

# A cell that reads as a number: 12, -3.5, 1,024, 45%, 1.2e-05, 3.00x ("-" and "n/a" are blanks).
_NUMBER = re.compile(r"[-+]?[\d,]*\.?\d+(e[-+]?\d+)?[%x]?")
_BLANKS = {"", "-", "n/a", "nan", "None"}


def is_number(cell: object) -> bool:
    return bool(_NUMBER.fullmatch(str(cell)))


def format_table(header: Sequence[str], rows: Iterable[Sequence[object]], left: Optional[Sequence[int]] = None) -> str:
    """``header`` over ``rows``, columns two spaces apart under a dashed rule, trailing blanks cut.

    Columns of numbers are right-aligned so digits line up, text columns left-aligned; ``left``
    names the left-aligned columns instead (by index) where a column mixes both. Cells are shown
    with ``str``: format numbers before.
    """
    body = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(header)]
    if left is None:
        left = [
            i
            for i in range(len(header))
            if not any(is_number(r[i]) for r in body) or any(not is_number(r[i]) and r[i] not in _BLANKS for r in body)
        ]
    at_left = set(left)

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i in at_left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    out: List[str] = [line(list(header)), "  ".join("-" * w for w in widths)]
    out.extend(line(r) for r in body)
    return "\n".join(out)
