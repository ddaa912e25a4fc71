"""What a build needs of the config beyond its types (``check_build``); ConfigError names the key."""

from __future__ import annotations

from typing import List
from zoneinfo import ZoneInfo

from pinads_rec.config import BuildConfig, ConfigError, FeaturesConfig, SequenceGroupConfig
from pinads_rec.data.loader.contract import contract_columns


def embedding_columns(g: SequenceGroupConfig) -> List[str]:
    """The group's embedding column as a list: empty when it has none."""
    return [g.embedding_column] if g.embedding_column else []


def check_build(b: BuildConfig, f: FeaturesConfig, by_day: bool = False) -> None:
    """What a build needs of the build section, beyond its types, to make the features' contract;
    ConfigError names the key. ``by_day``: a day build (days.py), which ignores build.splits and the
    split names that refer to them (negative_downsampling.splits, vocabularies[].fit_split)."""
    if not b.impressions.path:
        raise ConfigError("build.impressions.path: the config has no build section (no impression log given)")
    if not b.splits and not by_day:
        raise ConfigError("build.splits: declare at least one split (e.g. train and eval by time)")
    names = [s.name for s in b.splits]
    for i, n in enumerate(names):
        if n in names[:i] or not n or "/" in n:
            raise ConfigError(f"build.splits[{i}].name: {n!r} is empty, repeated or not a directory name")
    if not b.impressions.request and not b.impressions.request_key:
        raise ConfigError(
            "build.impressions.request: give the request id column, or request_key (e.g. [user, time, placement])"
        )
    groups = {g.name: g for g in f.sequence_groups}
    sourced = [s.group for s in b.sequences]
    for i, s in enumerate(b.sequences):
        if s.group not in groups:
            raise ConfigError(f"build.sequences[{i}].group: no sequence group {s.group!r} in features.sequence_groups")
        if s.group in sourced[:i]:
            raise ConfigError(f"build.sequences[{i}].group: {s.group!r} has two sources")
        g = groups[s.group]
        need = [x.column for x in g.features] + embedding_columns(g)
        for c in need:
            if c not in s.columns:
                raise ConfigError(f"build.sequences[{i}].columns.{c}: no expression for the group's column {c!r}")
        for c in s.columns:
            if c not in need:
                raise ConfigError(f"build.sequences[{i}].columns.{c}: not a column of group {s.group!r} ({need})")
        if s.min_gap_s < 0:
            raise ConfigError(f"build.sequences[{i}].min_gap_s: must be >= 0, got {s.min_gap_s}")
        sides = {t.name: t for t in b.side_tables}
        for name, key in s.side_tables.items():
            where = f"build.sequences[{i}].side_tables.{name}"
            if not s.path:
                raise ConfigError(
                    f"{where}: the events come from the impression log, which sees every side table already "
                    f"(joined as the impressions are); remove side_tables"
                )
            if name not in sides:
                raise ConfigError(f"{where}: no side table {name!r} in build.side_tables ({sorted(sides)})")
            if sorted(key) != sorted(sides[name].key):
                raise ConfigError(
                    f"{where}: give an event expression for each key column of {name!r} "
                    f"({sorted(sides[name].key)}), got {sorted(key)}"
                )
    for g in f.sequence_groups:
        if g.name not in sourced:
            raise ConfigError(f"build.sequences: no source for sequence group {g.name!r}")
    made = {f.columns.request_id, f.columns.timestamp} | {
        c
        for g in f.sequence_groups
        for c in [g.timestamp_column] + [x.column for x in g.features] + embedding_columns(g)
    }
    for c in contract_columns(f):
        if c.name not in made and c.name not in b.columns:
            raise ConfigError(f"build.columns.{c.name}: no expression for contract column {c.name!r} ({c.role})")
    for i, side in enumerate(b.side_tables):
        if not side.name.isidentifier():
            raise ConfigError(f"build.side_tables[{i}].name: {side.name!r} must be a plain name (letters, digits, _)")
        if not side.key:
            raise ConfigError(f"build.side_tables[{i}].key: map at least one side column to an impression expression")
    try:
        ZoneInfo(b.timezone)
    except Exception:
        raise ConfigError(f"build.timezone: unknown time zone {b.timezone!r} (e.g. UTC, Asia/Shanghai)") from None
    d = b.negative_downsampling
    if d is not None:
        if d.task not in [t.name for t in f.tasks]:
            raise ConfigError(f"build.negative_downsampling.task: no task {d.task!r}")
        for s, r in d.rates.items():
            if s not in f.surfaces:
                raise ConfigError(f"build.negative_downsampling.rates.{s}: not one of features.surfaces")
            if not 0.0 < r <= 1.0:
                raise ConfigError(f"build.negative_downsampling.rates.{s}: must be in (0, 1], got {r}")
        for s in [] if by_day else d.splits:
            if s not in names:
                raise ConfigError(f"build.negative_downsampling.splits: no split {s!r}")
    tables = {t.name for t in f.tables}
    for i, v in enumerate(b.vocabularies):
        if v.table not in tables:
            raise ConfigError(f"build.vocabularies[{i}].table: no table {v.table!r} in features.tables")
        if v.fit_split not in names and not by_day:
            raise ConfigError(f"build.vocabularies[{i}].fit_split: no split {v.fit_split!r}")
        if v.min_count < 1:
            raise ConfigError(f"build.vocabularies[{i}].min_count: must be >= 1, got {v.min_count}")
    if b.requests_per_row_group < 1 or b.requests_per_file < 1:
        raise ConfigError("build.requests_per_row_group / requests_per_file: must be >= 1")
