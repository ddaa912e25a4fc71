"""The ``build:`` section: which raw file is what and how it becomes the contract
(``pinads_rec/data/build/``; docs/data_build.md), declared beside the build that reads it. Its values
are checked by the build (``build/config_checks.py``: ``check_build``). Expressions are SQL (DuckDB's
dialect, which Spark SQL also reads for everything used here).

A leaf module outside the ``build`` package on purpose: the config composes this section, and
importing ``pinads_rec.data.build.<x>`` would run the package's ``__init__``, which imports the
config back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Literal, Optional


@dataclass
class RawSourceConfig:
    """One raw table: files and how to read them."""

    # Files or globs, relative to the build's --raw directory (or absolute). CSV or Parquet.
    path: List[str] = field(default_factory=list)
    # auto: told from the file names' extensions.
    format: Literal["auto", "csv", "parquet"] = "auto"
    # CSV: the delimiter and the strings read as null (blank fields always are). Header names are
    # stripped of surrounding spaces (Taobao's user_profile.csv ends its header with one).
    delimiter: str = ","
    # CSV: the strings read as null (besides blank fields).
    null_values: List[str] = field(default_factory=lambda: ["", "NULL"])
    # CSV without a header line (MovieLens' u.data, u.item): its column names, in file order.
    names: List[str] = field(default_factory=list)
    # CSV text encoding: utf-8, utf-16 or latin-1 (MovieLens-100K's u.item).
    encoding: str = "utf-8"
    # SQL predicate over the file's columns: only matching rows are used.
    filter: Optional[str] = None


@dataclass
class ImpressionsConfig(RawSourceConfig):
    """The impression log: one row per ad shown (who, which ad, where, when, what they did)."""

    # SQL predicate over the log's columns: the impressions built, and the rows a history read from
    # this log has (a sequence source without a path). Behaviour logs keep every user's events
    # (event_users). Requests, labels and the vocabularies' impression counts see matching rows only.
    filter: Optional[str] = None
    user: str = "user_id"  # SQL expression: the user key (joins the behaviour logs)
    # SQL expression: the impression time, epoch seconds (a number, fractions allowed) or a TIMESTAMP.
    time: str = "timestamp"
    # SQL expression of the request id; empty: derived from request_key (a request = one value of
    # those expressions, numbered in time order).
    request: Optional[str] = None
    # SQL expressions whose values together make a request (used when request is empty).
    request_key: List[str] = field(default_factory=list)
    # SQL expression ordering a request's candidates (its slot or position); default: the item.
    order: Optional[str] = None
    item: str = "item_id"  # SQL expression: the candidate (duplicates are judged on request + item)
    # The same (request, item) twice: stop with an error naming both rows, or keep the first (by
    # order, then highest labels) and count the others.
    duplicates: Literal["error", "drop"] = "drop"
    # An impression whose surface is not one of features.surfaces: stop with an error naming its
    # file and row, or drop it (counted in the summary).
    unknown_surface: Literal["error", "drop"] = "error"
    # Whose events the sequence sources keep: all users' (all count in the vocabularies), or built:
    # the users with a request built, after filter, splits and drops (the rest dropped, counted). A
    # filter that samples users then samples the event logs and the vocabularies with it; the
    # sequences hold the same events either way (only users with a request built get sequences).
    event_users: Literal["all", "built"] = "all"


@dataclass
class SideTableConfig(RawSourceConfig):
    """A table joined to impressions by key: item attributes, user profile, daily item statistics.
    Its columns are named ``<name>.<column>`` in build.columns."""

    # Its name: build.columns and the sequence sources read its columns as <name>.<column>.
    name: str = ""
    # side table column -> SQL expression over the impression row it must equal.
    key: Dict[str, str] = field(default_factory=dict)
    # A side table that changes over time: its date column (a DATE, or text/integer such as
    # 20220408 or 2022-04-08); an impression joins the row of its own date (build.timezone).
    as_of: Optional[str] = None
    # column -> SQL literal used when the impression's key has no row (counted) or the value is null.
    defaults: Dict[str, str] = field(default_factory=dict)


@dataclass
class SequenceSourceConfig(RawSourceConfig):
    """Where one sequence group's events come from. ``path`` empty: the impression log itself
    (its rows, filtered, are the events: a user's earlier clicks are their history)."""

    group: str = ""  # a features.sequence_groups name
    user: str = "user_id"  # SQL expression: the user key
    time: str = "timestamp"  # SQL expression: event time, as ImpressionsConfig.time
    # The group's contract columns (its id features' and embedding columns) -> SQL expression over
    # the event row. The group's timestamp column is the event time (whole seconds).
    columns: Dict[str, str] = field(default_factory=dict)
    # Only events at least this long before the impression (e.g. the logging delay of the real
    # feature pipeline); 0: every event strictly before it.
    min_gap_s: float = 0.0
    # Events whose user expression is null: stop with an error naming file and row, or drop and count.
    missing_user: Literal["error", "drop"] = "error"
    # Side tables (build.side_tables, by name) joined to the events of a source with a path, so
    # ``columns`` can read them as ``<name>.<column>``: side table name -> {side table column: SQL
    # expression over the event row}; a dated side table joins the row of the event's own date. A
    # source without a path (the impression log) sees every side table, joined as the impressions are.
    side_tables: Dict[str, Dict[str, str]] = field(default_factory=dict)


@dataclass
class SplitConfig:
    """One output split: impressions with start <= time < end (dates or datetimes in
    build.timezone; either side open when empty) that match ``filter``."""

    # The split's name: its output directory (<out>/<name>/), and what fit_split and splits name.
    name: str
    # Impressions at or after this date or datetime; empty: from the first.
    start: Optional[str] = None
    # Impressions before this date or datetime; empty: to the last.
    end: Optional[str] = None
    filter: Optional[str] = None  # SQL predicate over the impression row (KuaiRand: is_rand = 1)


@dataclass
class NegativeDownsamplingConfig:
    """Keep each negative of ``task`` (label 0) of a training split with probability rates[surface]
    (1.0 for surfaces not listed); the rates go to the manifest. Only ``splits`` are sampled: fit the
    calibration layers on an unsampled split and they correct the sampled model's bias."""

    # The task whose negatives (label 0) are sampled.
    task: str = ""
    # surface -> the probability that a negative of it is kept (1.0 for surfaces not listed).
    rates: Dict[str, float] = field(default_factory=dict)
    # The splits sampled (the others are written whole).
    splits: List[str] = field(default_factory=lambda: ["train"])
    # Seeds the keep/drop draw (a hash of request and item: reproducible).
    seed: int = 0


@dataclass
class VocabularyConfig:
    """Raw ids of ``table`` mapped to 1..V by frequency on the fitting split (every column feeding
    the table: candidate and sequence ones); 0 is the out-of-vocabulary bucket, trained by the id
    dropout (docs/data_build.md, "Cold start"). V is at most num_embeddings - 1; ids seen fewer than
    min_count times are out of vocabulary. Saved as <out>/vocabularies/<table>.parquet for serving."""

    # The features.tables entry whose raw ids are mapped.
    table: str
    # Ids seen fewer times than this on fit_split are out of vocabulary (0).
    min_count: int = 1
    # The build.splits entry the frequencies are counted on.
    fit_split: str = "train"
    # Training only: each id of the table in a training batch becomes 0 at this rate, so the
    # out-of-vocabulary row (ids new since fit_split) is trained. 0: only ids below min_count train it.
    dropout: float = 0.02


@dataclass
class BuildConfig:
    impressions: ImpressionsConfig = field(default_factory=ImpressionsConfig)
    side_tables: List[SideTableConfig] = field(default_factory=list)
    sequences: List[SequenceSourceConfig] = field(default_factory=list)
    # Every contract column not made by a sequence source (and not the request id or timestamp) ->
    # SQL expression over the impression row and the side tables' <name>.<column>.
    columns: Dict[str, str] = field(default_factory=dict)
    splits: List[SplitConfig] = field(default_factory=list)
    timezone: str = "UTC"  # where days matter: split boundaries, as-of dates
    negative_downsampling: Optional[NegativeDownsamplingConfig] = None
    vocabularies: List[VocabularyConfig] = field(default_factory=list)
    # Output: requests per Parquet row group, and per file (files are in time order).
    requests_per_row_group: int = 2048
    # Requests per output Parquet file.
    requests_per_file: int = 200000
