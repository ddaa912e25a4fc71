"""What the config and the settings declared beside their owners share: ``ConfigError``, the value
checks ``positive`` and ``unique``, and ``CANDIDATE_PREFIX``.

A leaf (it imports nothing of the package): the modules that declare a section of their own
(``modules/encoders.py``, ``data/synth_settings.py``, ``data/build_settings.py``) raise the same
error as the config that composes their sections, without importing it. ``pinads_rec.config``
re-exports all four.
"""

from __future__ import annotations

import math
from typing import List


class ConfigError(ValueError):
    """A config that cannot be used; the message names the offending key."""


# A candidate-side feature's ids in the sequence KJT, beside the events' (a shared table's):
# key "candidate.<feature>". No sequence group may take the name.
CANDIDATE_PREFIX = "candidate."


def positive(path: str, value: float, allow_zero: bool = False) -> None:
    if not math.isfinite(value):
        raise ConfigError(f"{path}: must be a finite number, got {value}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{path}: must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def unique(path: str, names: List[str]) -> None:
    seen = set()
    for i, n in enumerate(names):
        if n in seen:
            raise ConfigError(f"{path}[{i}].name: duplicate name {n!r}")
        seen.add(n)
