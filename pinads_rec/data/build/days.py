"""Builds by day (``--day``): each day's requests as a partition of their own, ``<out>/days/<day>/``.

    python -m pinads_rec.data.build --config X.yaml --raw RAW --out OUT --day 2024-01-03 --vocabularies FULL
    python -m pinads_rec.data.build ... --day 2024-01-03:2024-01-09      (a range, both ends included)

A day is a calendar day in ``build.timezone``, and a request falls on the day of its time (its
earliest impression), as a side table dated ``as_of`` is joined by the impression's own date. A day
build is the full build cut to those requests, row for row (tests/test_build_days.py):

- **Sequences** come from the whole behaviour log up to each request, point in time, as in the
  full build: the events of earlier days count. Only the events that can precede one of the day's
  requests are kept (its users', before its last request) -- the rest could never be counted.
- **Request ids**: the log's own, or the keys numbered over the whole impression log read (as the
  full build numbers them over its splits' impressions: the same ids when its splits cover the log).
- **Vocabularies** are not fitted: a day alone would renumber ids from day to day. Every day maps
  its ids with the vocabularies of one existing build (``--vocabularies DIR``: the full build that
  fitted them), so an id means the same on every day; a raw id that build never kept is 0.
- **Negative downsampling**, when configured, applies to every day built (the day is training
  data; ``negative_downsampling.splits`` names splits, which a day build has none of). The draw is the
  full build's (request, item, seed): a day keeps the rows the full build keeps on that day when the
  day lies in one of its sampled splits. ``--set build.negative_downsampling=null`` builds a day
  unsampled (to evaluate on).
- **build.splits** is ignored (a day has no train/eval split: the daily loop trains on day D and
  evaluates on day D+1); the command line says so.

Each partition holds the day's files at its top (``part-*.parquet``, one row per request in time
order, the layout metadata), its ``summary.json`` and ``manifest.json``, and is all or nothing as a
whole build is (data/build_output.py): written into ``.<day>.building-<pid>`` beside it and swapped
in once complete. A range is read and computed once, then swapped in day by day, in time order. A
day with no request is an error naming it, and nothing is written.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from contextlib import ExitStack
from datetime import date, timedelta
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from pinads_rec.config import BuildConfig, ConfigError, ExperimentConfig
from pinads_rec.data import build_output
from pinads_rec.data.build.config_checks import check_build
from pinads_rec.data.build.full_build import Build
from pinads_rec.data.build.time_sql import date_of
from pinads_rec.data.build.vocabularies import apply_vocabulary
from pinads_rec.data.build.writer import build_manifest
from pinads_rec.data.loader.contract import ContractError
from pinads_rec.data.sql_text import identifier, sql_string

DAYS = "days"  # <out>/days/<day>/: the partitions


def parse_days(text: str, flag: str = "--day") -> List[str]:
    """``2024-01-03`` or ``2024-01-03:2024-01-09`` (both ends included) -> the days, in order, as
    ``YYYY-MM-DD``; ConfigError naming ``flag`` otherwise."""
    usage = "give a day YYYY-MM-DD or a range YYYY-MM-DD:YYYY-MM-DD (both ends included)"
    parts = text.strip().split(":")
    if len(parts) > 2:
        raise ConfigError(f"{flag} {text!r}: {usage}")
    try:
        ends = [date.fromisoformat(p) if re.fullmatch(r"\d{4}-\d\d-\d\d", p) else None for p in parts]
    except ValueError as e:
        raise ConfigError(f"{flag} {text!r}: {e}; {usage}") from None
    if None in ends:
        raise ConfigError(f"{flag} {text!r}: not a day; {usage}")
    first, last = ends[0], ends[-1]
    if last < first:
        raise ConfigError(f"{flag} {text!r}: the range ends before it starts")
    return [(first + timedelta(days=i)).isoformat() for i in range((last - first).days + 1)]


def day_dir(out_dir: str, day: str) -> Path:
    """Where the partition of ``day`` of the day builds into ``out_dir`` lies."""
    return Path(out_dir) / DAYS / day


def build_days(
    cfg: ExperimentConfig,
    raw_dir: str,
    out_dir: str,
    days: List[str],
    vocabularies: Optional[str] = None,
    memory_limit: Optional[str] = None,
    threads: Optional[int] = None,
    engine: str = "duckdb",
) -> Dict[str, dict]:
    """Builds ``days`` (``parse_days``) of ``cfg.build`` from the files under ``raw_dir`` into
    ``out_dir/days/<day>/``, each replaced whole, or not at all on an error; ``vocabularies``: the
    build whose vocabularies map the ids (required when the config declares any). Returns each
    day's summary (also its ``summary.json``)."""
    out = Path(out_dir)
    if not days:
        raise ConfigError("--day: no day given")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out_dir}: is a file; a day build writes {out_dir}/{DAYS}/<day>/")
    if (out / build_output.MANIFEST).is_file():
        raise ConfigError(
            f"--out {out_dir}: holds a full build ({build_output.MANIFEST}); its day partitions ({DAYS}/<day>/) "
            f"would be files its manifest does not list, and its next rebuild would delete them: give another "
            f"directory (its vocabularies go to --vocabularies)"
        )
    source = vocabulary_source(cfg.build, vocabularies)
    build_output.recover_under(out / DAYS)  # what killed builds of any day left
    with ExitStack() as stack:
        # Entered last day first, so they are left -- swapped in -- first day first.
        works = {day: stack.enter_context(build_output.replacing(str(day_dir(out_dir, day)))) for day in days[::-1]}
        return DayBuild(cfg, raw_dir, {d: works[d] for d in days}, source, memory_limit, threads, engine).run()


def vocabulary_source(build: BuildConfig, vocabularies: Optional[str]) -> Optional[Path]:
    """The build whose vocabularies a day build applies, checked: complete, and one file per
    ``build.vocabularies`` table. None when the config declares none."""
    tables = [v.table for v in build.vocabularies]
    if not tables:
        return None
    if vocabularies is None:
        raise ConfigError(
            f"--vocabularies: build.vocabularies maps the ids of {', '.join(tables)}; a day build takes the "
            f"mapping of an existing build rather than fitting one on its day (which would renumber the ids day "
            f"by day): give --vocabularies DIR, the full build that fitted them"
        )
    root = Path(vocabularies)
    if not root.is_dir():
        raise ConfigError(f"--vocabularies {vocabularies}: no such directory (give a build's --out)")
    build_output.require_complete(vocabularies)
    for i, table in enumerate(tables):
        if not (root / "vocabularies" / f"{table}.parquet").is_file():
            raise ConfigError(
                f"--vocabularies {vocabularies}: has no vocabularies/{table}.parquet, which "
                f"build.vocabularies[{i}] (table {table!r}) needs; give the build that fitted it"
            )
    # DuckDB reads them below, verifying nothing: their bytes against the manifest first.
    build_output.require_unchanged(str(root / "vocabularies" / f"{t}.parquet") for t in tables)
    return root


class DayBuild(Build):
    """The build's steps with the days as its splits (``works``: day -> the directory its partition
    is written into); the vocabularies read from ``source``, never fitted."""

    ACROSS = "requests across midnight (put in the day of their earliest impression)"

    def __init__(
        self,
        cfg: ExperimentConfig,
        raw_dir: str,
        works: Dict[str, Path],
        source: Optional[Path],
        memory_limit: Optional[str],
        threads: Optional[int],
        engine: str = "duckdb",
    ):
        # The engine spills into the first day's directory (removed before its manifest is written).
        super().__init__(cfg, raw_dir, str(next(iter(works.values()))), memory_limit, threads, engine)
        self.works, self.source = works, source
        self.splits = list(works)

    def check_config(self) -> None:
        check_build(self.cfg.build, self.cfg.features, by_day=True)

    def run(self) -> Dict[str, dict]:
        start = time.time()
        outputs = self.steps()
        seconds = time.time() - start
        summaries, manifests, applied = {}, {}, self.vocabularies_from()
        for day, work in self.works.items():
            on_day = f"(SELECT * FROM imp WHERE __split = {sql_string(day)})"
            summary = {"day": day, **self.summarize({day: outputs[day]}, seconds, work, on_day)}
            (work / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            manifest = build_manifest(self, {day: outputs[day]}, summary, on_day)
            manifests[day] = {"day": day, "timezone": self.b.timezone, **manifest, **applied}
            summaries[day] = summary
        self.engine.close()  # no query left that could spill again into the files the manifests list
        shutil.rmtree(self.tmp, ignore_errors=True)
        for day, work in self.works.items():
            build_output.write_manifest(work, manifests[day], [])  # the day's files are at its top: no split
        return summaries

    # --- the days as the splits ------------------------------------------------------------------

    def split_columns(self) -> Tuple[str, str]:
        """Every impression is on its own day (in build.timezone); its request's day is decided
        once the requests are numbered (keep_built_requests)."""
        return f"CAST({date_of(self.b.timezone, self.imp_time)} AS VARCHAR)", "1"

    def split_filters(self) -> Dict[str, str]:
        return {}

    def drop_outside_splits(self) -> None:
        """Every impression has a day; those of the other days go once requests are numbered."""

    def keep_built_requests(self) -> None:
        """The requests whose time (their earliest impression) falls on a day built, with all their
        impressions (a request across midnight keeps those after it); an error naming the days
        without a request."""
        days = ", ".join(sql_string(d) for d in self.splits)
        self.sql(
            "finding the day of each request",
            "CREATE TEMP TABLE __request_days AS SELECT __req, arg_min(__split, __t) AS __day FROM imp GROUP BY __req",
        )
        found = dict(self.rows(f"SELECT __day, count(*) FROM __request_days WHERE __day IN ({days}) GROUP BY __day"))
        empty = [d for d in self.splits if d not in found]
        if empty:
            first, last = self.one("SELECT min(__day), max(__day) FROM __request_days")
            where = f"{self.imp_source.files[0]}{' ...' if len(self.imp_source.files) > 1 else ''}"
            span = f"its requests' days run {first}..{last}" if first else "it has no request"
            raise ContractError(
                f"--day: no request of {where} falls on {', '.join(empty)} (days in build.timezone "
                f"{self.b.timezone}; {span}); nothing written"
            )
        self.counts["impressions of requests on the other days (not built)"] = self.scalar(
            f"SELECT count(*) FROM imp WHERE __req NOT IN (SELECT __req FROM __request_days WHERE __day IN ({days}))"
        )
        self.sql(
            "keeping the requests of the days built",
            f"""CREATE OR REPLACE TEMP TABLE imp AS SELECT * FROM imp
            WHERE __req IN (SELECT __req FROM __request_days WHERE __day IN ({days}))""",
        )

    def sampled(self) -> str:
        return "true"  # every day built is sampled (the module docstring says why)

    def prune_events(self, events: str) -> None:
        """Only the events that can precede a request built: its users', before the last request."""
        self.sql(
            f"keeping the events before the requests built ({events})",
            f"""DELETE FROM {events}
            WHERE __user NOT IN (SELECT DISTINCT __user FROM req) OR __t >= (SELECT max(__t) FROM req)""",
        )

    def vocabulary(self, vocab) -> None:
        """The source build's mapping of ``vocab.table`` applied as it is (never refitted)."""
        path = self.source / "vocabularies" / f"{vocab.table}.parquet"
        name = f"vocab_{identifier(vocab.table)}"
        self.sql(
            f"reading the vocabulary of table {vocab.table!r} ({path})",
            f"""CREATE TEMP TABLE {name} AS
            SELECT CAST(raw AS VARCHAR) AS raw, CAST(idx AS BIGINT) AS idx, count
            FROM read_parquet({sql_string(str(path))})""",
        )
        apply_vocabulary(self, vocab.table, name)

    def vocabularies_from(self) -> dict:
        """The manifest's record of the vocabularies applied: their build, its fingerprint, each
        file's sha256 (equal on two days: the same mapping)."""
        if self.source is None:
            return {}
        listed = {}
        try:
            listed = json.loads((self.source / build_output.MANIFEST).read_text())
        except FileNotFoundError:
            pass
        files = {}
        for v in self.b.vocabularies:
            rel = f"vocabularies/{v.table}.parquet"
            files[rel] = build_output.sha256(self.source / rel)
        return {
            "vocabularies_from": {
                "build": str(self.source.resolve()),
                "fingerprint": listed.get("fingerprint"),
                "files": files,
            }
        }

    # --- the partitions ----------------------------------------------------------------------------

    def split_dir(self, split: str) -> Tuple[Path, Path]:
        """A day's files go to the top of its partition."""
        return self.works[split], self.works[split]
