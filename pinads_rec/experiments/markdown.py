"""Markdown pieces the experiment reports are built from: a table from a header and rows."""

from __future__ import annotations

from typing import List, Sequence


def table(header: Sequence[str], rows: Sequence[Sequence[object]], align: str = "") -> List[str]:
    """Markdown table lines. ``align``: one letter per column, ``l`` (default) or ``r``."""
    align = align.ljust(len(header), "l")
    rule = "|" + "".join("---:|" if a == "r" else "---|" for a in align)
    return ["| " + " | ".join(header) + " |", rule] + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
