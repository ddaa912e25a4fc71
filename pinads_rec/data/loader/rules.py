"""The data rules: what a valid value of the contract is, stated once. The loader
(``row_group_checker.RowGroupChecker``: numpy over each row group), ``inspect`` (SQL over a whole dataset)
and the build (SQL over the raw rows it maps) check the same rules, so a bad file gets the same
verdict from all three (``tests/test_data_rules.py``); each names the rule that failed
(``ContractError.rule``, an inspect problem's ``kind``).

A rule is a predicate true where a value breaks it, as SQL over ``{x}`` and as numpy over an
array. Both see non-null values only: every tool refuses a null in a contract column before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

# Epoch seconds of 1990-01-01 and 2100-01-01 (UTC). A time outside them is a unit mistake
# (milliseconds read as seconds) or a placeholder (0), never a real impression.
EARLIEST, LATEST = 631152000, 4102444800


@dataclass(frozen=True)
class Rule:
    kind: str  # the problem's name, the same in every tool: "label not 0/1"
    sql: str  # SQL predicate over ``{x}``, true where the value breaks the rule
    broken: Callable[[np.ndarray], np.ndarray]  # the same over a numpy array
    hint: str = ""  # how to fix it, said after the message

    def where(self, x: str) -> str:
        """The SQL predicate for the expression ``x``."""
        return self.sql.format(x=x)


LABEL = Rule("label not 0/1", "NOT ({x} = 0 OR {x} = 1)", lambda v: (v != 0) & (v != 1))
PROBABILITY = Rule("probability outside [0, 1]", "NOT ({x} >= 0 AND {x} <= 1)", lambda v: ~((v >= 0) & (v <= 1)))
TIMESTAMP = Rule(
    "timestamp outside 1990..2100",
    f"NOT ({{x}} >= {EARLIEST} AND {{x}} < {LATEST})",  # NaN and inf compare false: outside
    lambda v: ~((v >= EARLIEST) & (v < LATEST)),
    "epoch seconds are expected: milliseconds? divide by 1000",
)
NEGATIVE_ID = Rule("negative id", "{x} < 0", lambda v: v < 0)


def id_beyond(size: int) -> Rule:
    """Ids at or past a table's ``size`` (a table that does not hash)."""
    return Rule(
        "id beyond its table",
        f"{{x}} >= {int(size)}",
        lambda v: v >= size,
        "enlarge the table, set hash: true, or declare a vocabulary",
    )
