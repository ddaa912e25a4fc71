"""The experiment config's schema: every section a dataclass, every default in one place.

Each field's meaning is the ``#`` comment above it (``config_reference`` renders them as
docs/config.md). A config file only states what differs from these defaults; ``loading.py`` turns a
YAML mapping into these classes, ``checks.py`` checks their values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Literal, Optional

# TorchRec's sharding types by name (train.sharding_types; the planner's --sharding-types).
SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise", "data_parallel")


class ConfigError(ValueError):
    """A config that cannot be used; the message names the offending key."""


CANDIDATE_PREFIX = "candidate."

# The keys a config must state although the schema gives them a placeholder (None, an empty list) so
# that the sections build without them: key -> what it is, for the error that names it
# (checks.require). No default is a demo's path or surface: a config that forgot one would silently
# read or write the demo's files. features.* are checked on every config (checks.validate); the paths
# by the tool that reads them (training: the Trainer), so the planner, build, inspect and serve load
# a config without them.
REQUIRED = {
    "features.surfaces": "the surface names, at least one (the heads' logits, calibration and metrics are per surface)",
    "features.tasks": "the prediction tasks, at least one, each a label column",
    "data.train_dir": "the directory of the training Parquet files",
    "data.eval_dir": "the directory of the evaluation Parquet files",
    "train.run_dir": "the directory the run writes metrics.jsonl, config.json and its checkpoints to",
}


# --------------------------------------------------------------------------------------------
# Feature declarations: which Parquet column is what. Nothing about columns is hard-coded.
# --------------------------------------------------------------------------------------------


@dataclass
class AdmissionConfig:
    """Which new ids a managed-collision table gives a slot at an eviction round (TorchRec's
    threshold filters over the ids' counts in the round)."""

    # all: every id seen in the round; min_count: ids seen at least min_count times in it; average:
    # more often than the round's mean count; dynamic: more than skew x the mean; probabilistic:
    # each occurrence admits with probability (an id seen n times: 1 - (1 - p)^n).
    kind: Literal["all", "min_count", "average", "dynamic", "probabilistic"] = "all"
    # kind min_count: occurrences in one round an id needs.
    min_count: int = 2
    # kind dynamic: the multiple of the mean count an id must exceed.
    skew: float = 10.0
    # kind probabilistic: the chance one occurrence admits its id.
    probability: float = 0.01


@dataclass
class ManagedCollisionConfig:
    """A table whose raw ids TorchRec's managed collision maps to its num_embeddings slots
    (MCHManagedCollisionModule): an id keeps its own row until evicted; ids go in unchanged, any
    int64 >= 0 (no hashing, no vocabulary). The last slot of each shard is the row every id without
    a slot shares. docs/continuous.md."""

    # Which slot an id without one takes at an eviction round: the least recently seen id's (lru),
    # the least often seen's (lfu), or by frequency discounted by age (distance_lfu).
    eviction: Literal["lru", "lfu", "distance_lfu"] = "lru"
    # Training steps between eviction rounds: new ids get slots (and evicted ones lose theirs, their
    # rows starting fresh) only at a round; until then they share the unknown row.
    eviction_interval: int = 10
    # distance_lfu: how fast age discounts frequency (TorchRec's decay_exponent).
    decay_exponent: float = 1.0
    # Which new ids are admitted at a round.
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)


@dataclass
class TableConfig:
    """One embedding table; several features may share it."""

    # The table's name, as the features using it give it in their table key.
    name: str
    # Rows of the table: ids 0..num_embeddings - 1 (hash says what happens to larger ones).
    num_embeddings: int
    # Width of each row (the embedding of one id).
    embedding_dim: int
    # Ids >= num_embeddings are hashed into range (id mod size); without it they are an error.
    hash: bool = False
    # Raw ids mapped to slots by TorchRec's managed collision (admission, eviction) instead of used
    # as rows: num_embeddings is then the slot count. None: the ids are rows.
    managed_collision: Optional[ManagedCollisionConfig] = None


@dataclass
class SparseFeatureConfig:
    """A categorical feature of the candidate row: an int64 column (one id) or list<int64> column
    (multi-hot), pooled by an EmbeddingBagCollection. A candidate-side feature whose table is also
    used by sequence features is looked up by the EmbeddingCollection instead (and pooled the same
    way), so the candidate and the user's events share one embedding space (e.g. the candidate's
    topic and the events' topics, a video's tags and the clicked videos' tags)."""

    # The feature's name (unique among features.sparse).
    name: str
    # The Parquet column: int64 (one id) or list<int64> (several ids).
    column: str
    # The features.tables entry its ids are looked up in.
    table: str
    # How several ids become one embedding: their sum or mean.
    pooling: Literal["sum", "mean"] = "sum"
    # True for the user-side features (same for every candidate of a request): these may be
    # computed once per request and broadcast.
    user_side: bool = False


@dataclass
class DenseFeatureConfig:
    """A float column (dim 1) or a fixed-size list<float> column (dim > 1)."""

    # The feature's name (unique among features.dense).
    name: str
    # The Parquet column: float (dim 1) or fixed_size_list<float, dim>.
    column: str
    # Values per row: 1, a float column; more, a fixed-size list of that many.
    dim: int = 1
    # Per-feature normalization before the dense arch: signed log, min-max clip, layer norm, plain
    # BatchNorm1d, or Resilient Batch Norm (hyper-parameters in model.resilient_bn).
    norm: Literal["none", "log", "minmax", "layer_norm", "batch_norm", "resilient_bn"] = "none"
    # norm minmax: [clip_min, clip_max] maps to [0, 1], values outside it are clipped.
    clip_min: float = 0.0
    # The top of the minmax range (must exceed clip_min).
    clip_max: float = 1.0
    # Same value for every candidate of a request (e.g. the user's activity): the two-tower model
    # puts it in the user tower.
    user_side: bool = False


@dataclass
class SequenceFeatureConfig:
    """One id attribute of a sequence event (item id, action type, taxonomy id...), or a bag of ids
    per event (a movie's genres, a video's tags, a query's tokens): ``max_values`` > 1, the column a
    list<list<int64>> (a list of ids per event), each event's bag pooled to one embedding."""

    # The attribute's name (unique in its group; model.sequence.retrieval.attribute names one).
    name: str
    # The Parquet column: list<int64>, one id per event (list<list<int64>> for a bag).
    column: str
    # The features.tables entry its ids are looked up in.
    table: str
    # Ids per event: 1, one id (the column a list<int64>); more, a bag of at most this many (longer
    # bags are an error, or keep their first max_values under data.overlong_sequence: truncate).
    max_values: int = 1
    # How a bag becomes the event's attribute embedding (an empty bag is zeros).
    pooling: Literal["sum", "mean"] = "mean"

    @property
    def multi_valued(self) -> bool:
        return self.max_values > 1


@dataclass
class SequenceGroupConfig:
    """Aligned list columns describing the user's recent engagement events, newest first."""

    # The group's name (model.sequence_groups and build.sequences name groups by it).
    name: str
    # List column: each event's time in seconds, aligned with the attributes' lists.
    timestamp_column: str
    # The events' id attributes (at least one of them a single id per event).
    features: List[SequenceFeatureConfig]
    # Events kept per request, the newest (data.overlong_sequence: what happens to more).
    max_length: int = 100
    # Optional list<fixed_size_list<float, dim>> column: a pretrained embedding per event.
    embedding_column: Optional[str] = None
    # Width of embedding_column's vectors (used only with it).
    embedding_dim: int = 0


@dataclass
class TaskConfig:
    # The task's name (metrics, logs and train.early_stop.task use it).
    name: str
    # The task's label column (1 positive, 0 negative).
    label_column: str
    # The task's weight in the training loss (a weighted sum over tasks).
    weight: float = 1.0
    # Column holding the probability the label was drawn from (synthetic data): enables oracle metrics.
    true_probability_column: Optional[str] = None


@dataclass
class ColumnsConfig:
    # The request id column: a request's candidate rows share it.
    request_id: str = "request_id"
    # The user id column.
    user_id: str = "user_id"
    # The candidate (ad) id column.
    item_id: str = "item_id"
    # The surface column: a name in features.surfaces, or its index.
    surface: str = "surface"
    # The request time column, in seconds (events' time deltas are taken from it).
    timestamp: str = "timestamp"


@dataclass
class FeaturesConfig:
    # Names of the identity columns every row has.
    columns: ColumnsConfig = field(default_factory=ColumnsConfig)
    # Surface names, at least one: the heads' logits, calibration and metrics are per surface.
    surfaces: List[str] = field(default_factory=list)
    # The prediction tasks, at least one, each a label column.
    tasks: List[TaskConfig] = field(default_factory=list)
    tables: List[TableConfig] = field(default_factory=list)
    sparse: List[SparseFeatureConfig] = field(default_factory=list)
    dense: List[DenseFeatureConfig] = field(default_factory=list)
    sequence_groups: List[SequenceGroupConfig] = field(default_factory=list)

    def table(self, name: str) -> TableConfig:
        return next(t for t in self.tables if t.name == name)


# --------------------------------------------------------------------------------------------
# Data loading, synthetic data, model and training.
# --------------------------------------------------------------------------------------------


@dataclass
class RowFilterConfig:
    # An int64 column of the contract (a sparse feature's, surface, user_id or item_id).
    column: str
    # The values kept.
    values: List[int]


@dataclass
class DataConfig:
    # Directory of the training Parquet files (the contract: docs/data_build.md). Training requires
    # it; the planner, build, inspect (it is --data's default) and serve do not.
    train_dir: Optional[str] = None
    # Directory of the evaluation Parquet files (the final evaluation's). Training requires it
    # (serve's default data).
    eval_dir: Optional[str] = None
    # Candidate rows per rank per step: the global batch is batch_size x the world size.
    batch_size: int = 512
    # Rows held for shuffling (whole requests are shuffled, never split by the buffer).
    shuffle_buffer_rows: int = 16384
    # DataLoader worker processes per rank reading row groups (0: read in the training process).
    num_workers: int = 1
    # Batches each loader worker keeps ready (DataLoader's prefetch_factor; unused without workers).
    prefetch_factor: int = 4
    # NaN/inf in a dense column: stop with an error, or replace by 0 and count the repair.
    nonfinite_dense: Literal["error", "replace"] = "error"
    # Sequences longer than max_length: keep the newest max_length events and count them (logged at
    # INFO: the policy chosen here, not a fault in the data), or error.
    overlong_sequence: Literal["truncate", "error"] = "truncate"
    # Keep only rows whose `column` holds one of `values` (ad-type segmentation: train and evaluate
    # a standard-only or shopping-only model on the relevant data only).
    row_filter: Optional[RowFilterConfig] = None
    # Request-level broadcasting bound: a batch closes early (padded with rows marked invalid) rather
    # than hold more unique users (requests) than this; the user-side pooled lookups always run on
    # this many slots (a fixed shape, as sharded pooled lookups need). 0 = batch_size (no bound).
    max_unique_users_per_batch: int = 0
    # Fraction of the training row groups -- the last ones in file order, so name the files in time
    # order -- kept out of training to fit the calibration layers on at the end (at least one row
    # group per rank). 0 with data.calibration_dir or model.calibration: none.
    calibration_holdout: float = 0.05
    # Files never trained on to fit the calibration layers on instead (e.g. the latest day's,
    # written by synth.calibration_requests); set data.calibration_holdout: 0 with it. Its size sets
    # the calibration's precision: ~1 / sqrt(positives) of the rarest (surface, task).
    calibration_dir: Optional[str] = None


@dataclass
class FaultsConfig:
    """Feature faults the generator can plant (to exercise Resilient Batch Norm)."""

    # Dense column zero-filled for requests whose time falls in [start, end) (fractions of the span).
    zero_fill_column: Optional[str] = None
    # [start, end) of the zero-fill, as fractions of the data's time span.
    zero_fill_window: List[float] = field(default_factory=lambda: [0.4, 0.5])
    # Dense column whose distribution shifts (scale x shift_scale + shift_offset) after a time point.
    shift_column: Optional[str] = None
    # The time point (a fraction of the span) from which shift_column is shifted.
    shift_after: float = 0.7
    # The shift's factor.
    shift_scale: float = 5.0
    # The shift's offset (added after the scaling).
    shift_offset: float = 3.0
    # Fraction of rows whose dense values are stale (copied from an earlier row of the user).
    stale_fraction: float = 0.0


@dataclass
class LongHistoryConfig:
    """Long pins histories and a planted dormant interest (docs/synthetic_data.md, "Long histories
    and a dormant interest"). Off: the data are exactly those of the generator without it."""

    # Plant long histories and the dormant interest (false: the plain generator's data).
    enabled: bool = False
    # Each user's total pins events over the 90-day log: LogNormal with this median and 90th
    # percentile, rounded and clipped to [1, max_length]; max_length is also the pins cap a request
    # carries (sequence_caps()["pins"]).
    median: float = 200.0
    # The 90th percentile of that LogNormal.
    p90: float = 1500.0
    # The clip of a user's event count, and the pins cap a request carries.
    max_length: int = 4000
    # Users with at least min_history pins events have a dormant topic outside their mixture: a burst
    # of burst_share of their events on it in the log's first burst_days days, candidates of it with
    # probability candidate_share and dormant_coef on the click logit, on the surfaces listed.
    min_history: int = 300
    # Fraction of a dormant user's events in the burst on the dormant topic.
    burst_share: float = 0.1
    # The burst falls in the log's first burst_days days.
    burst_days: float = 15.0
    # Probability that a candidate of such a user is of the dormant topic.
    candidate_share: float = 0.1
    # Added to the click logit of a candidate of the user's dormant topic.
    dormant_coef: float = 3.0
    # The surfaces where the dormant topic's candidates appear.
    surfaces: List[str] = field(default_factory=lambda: ["home_feed", "related_pins"])


@dataclass
class DriftConfig:
    """A world that drifts day by day, written one directory a day (docs/synthetic_data.md, "A
    drifting world"): ads launch and retire, users' interests rotate, a topic trends for a few days.
    Set (e.g. ``--set synth.drift.days=14``) it replaces the train / calibration / eval splits."""

    # Consecutive calendar days from 2023-11-15 (UTC): <out>/days/<YYYY-MM-DD>/ each.
    days: int = 14
    # Requests per day (synth.train_requests, eval_requests and calibration_requests are not read).
    requests_per_day: int = 20000
    # From the second day: share of a day's candidate draws that go to the ads launched that day.
    new_ads_share: float = 0.2
    # Days an ad is shown: round(num_items / ad_lifetime_days) ads launch a day (new ids, above all
    # earlier ones) and about as many retire (no impressions after); the first day's over its first days.
    ad_lifetime_days: int = 10
    # Users' interests rotate: each day this fraction of every topic's weight in a user's mixtures
    # (long-term and shopping) moves on to the next topic (k -> k + 1, the last to the first).
    interest_shift_per_day: float = 0.1
    # A trending topic lasts this many days, then another one trends.
    trend_days: int = 3
    # Added to the click logit of a candidate of the day's trending topic.
    trend_boost: float = 1.5


@dataclass
class SynthConfig:
    """Sizes and seed of the planted-truth synthetic data (see docs/synthetic_data.md)."""

    # Seeds every random draw of the generator: same seed and sizes, same data.
    seed: int = 0
    # Requests in the train split.
    train_requests: int = 20000
    # Requests in the eval split (after every training one in time).
    eval_requests: int = 4000
    # Requests of the training period's latest part (after every train request, before every eval
    # one), written to calibration/ (fit the calibration layers on them with data.calibration_dir).
    # 0: no calibration split.
    calibration_requests: int = 0
    # Mean candidate rows per request: 1 + Poisson(candidates_per_request - 1).
    candidates_per_request: float = 12.0
    # Users the requests are drawn from (a user makes several).
    num_users: int = 200000
    # Candidate items (ads): item_id in [0, num_items).
    num_items: int = 50000
    # Advertisers; each item belongs to one.
    num_advertisers: int = 2000
    # Topics of the planted world (items, interests, queries).
    num_topics: int = 32
    # L: the pins group's cap (L / 2 for ads and queries), also the background events' scale.
    sequence_length: int = 100
    # Width of the pretrained per-event embedding of the pins group (a noisy topic vector). It is
    # repeated on every candidate row of a request, so it dominates the file size.
    event_embedding_dim: int = 32
    # Train files (eval and calibration get proportionally fewer, at least 2).
    num_files: int = 4
    # Rows per Parquet row group, at most (row groups hold whole requests).
    row_group_size: int = 8192
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    long_history: LongHistoryConfig = field(default_factory=LongHistoryConfig)
    # A world that drifts day by day (DriftConfig); null: the fixed world and its splits.
    drift: Optional[DriftConfig] = None


# --------------------------------------------------------------------------------------------
# Building the contract from raw logs (pinads_rec/data/build/; docs/data_build.md).
# Expressions are SQL (DuckDB's dialect, which Spark SQL also reads for everything used here).
# --------------------------------------------------------------------------------------------


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


@dataclass
class EarlyInteractionConfig:
    """Early feature interaction (sequence-modeling article, "More Feature Interaction")."""

    # Cosine similarity between each event and these representations, added as event attributes.
    cosine: List[Literal["candidate", "user"]] = field(default_factory=list)
    # These representations fed into the Transformer's self-attention as extra tokens (in the groups
    # with a Transformer).
    tokens: List[Literal["candidate", "user"]] = field(default_factory=list)


@dataclass
class SequenceProjectionConfig:
    """DCNv2 projection of the (wide) Transformer output into a small representation (in the groups
    with a Transformer)."""

    dim: int = 0  # 0: off
    # DCNv2 cross layers before the linear map to dim (0: the linear map alone).
    num_layers: int = 2
    # Rank of the cross layers' weights (0: full rank).
    low_rank: int = 16


@dataclass
class HSTUConfig:
    """The HSTU encoder (modules/hstu.py): pointwise SiLU attention with relative position and time
    biases, run per request without padding waste."""

    # Stacked HSTU layers.
    num_layers: int = 2
    # Attention heads; they divide the event width.
    num_heads: int = 2
    # Dropout rate in the HSTU layers.
    dropout: float = 0.0
    # Relative attention biases: log2 buckets of |i - j| positions and of |t_i - t_j| seconds.
    position_buckets: int = 32
    # Buckets of the time bias (log2 of |t_i - t_j| seconds).
    time_buckets: int = 24


@dataclass
class RetrievalConfig:
    """Target-aware retrieval from a long history (SIM's hard search; modules/retrieval.py): per
    candidate, the newest ``max_events`` events whose ``attribute`` equals the candidate's
    ``candidate`` feature, encoded with target attention. With bags on either side (a multi-valued
    attribute, a multi-hot candidate feature) an event matches when the two share an id. Groups
    whose attributes differ each set their own under model.sequence_groups.<group>.retrieval."""

    # A feature of the group (model.sequence's must be one of every group that lists retrieval and
    # has no model.sequence_groups entry: a group with other attributes sets its own there).
    attribute: str = "topic"
    candidate: str = "item_topic"  # a candidate-side sparse feature on the attribute's table
    # Events retrieved per candidate: the newest that match.
    max_events: int = 32


@dataclass
class SequenceEncoderConfig:
    """How one sequence group becomes features (modules/sequence.py; docs/ablations.md compares the choices)."""

    # Event representation: each attribute (and the pretrained embedding) projected to d_model and
    # summed ("sum"), or concatenated at their own widths ("concat": the event is as wide as the sum
    # of its attributes' widths, and so is the Transformer).
    combine: Literal["sum", "concat"] = "sum"
    # Width of an event with combine: sum (each attribute is projected to it).
    d_model: int = 32
    # Time-delta position embedding: bucket = floor(log2(1 + seconds)), clamped to num_buckets - 1.
    time_buckets: int = 24
    # Encoders, any subset: "transformer"; "sum" pooling; "period_sum" pooling (one sum per time
    # period, concatenated); "din" (DIN target attention, per candidate); "long_short" (the latest
    # short_length events through a light DIN-like attention: the short-term interest, joined to
    # what the other encoders make of the whole sequence).
    # "hstu" (HSTU over the events, ``hstu``); "retrieval" (per candidate, the events sharing its
    # category from the whole history: ``retrieval``).
    # Any other name registered in modules/encoders.py's registry is accepted too.
    encoders: List[str] = field(default_factory=lambda: ["transformer"])
    # The newest ``window`` events feed every encoder but "retrieval", which searches the group's
    # whole max_length (0: every encoder reads all of it).
    window: int = 0
    # How the attention encoders (transformer, hstu) meet sequences of different lengths:
    # "max_length" pads every request to the group's max_length; "buckets" sorts the batch's
    # requests by length and pads each bucket only to its longest (modules/length_buckets.py). Same
    # outputs; docs/long_sequences.md measures both.
    padding: Literal["max_length", "buckets"] = "max_length"
    # Transformer.
    # Its encoder layers.
    num_layers: int = 1
    # Attention heads; they divide the event width (d_model, or the concatenated width).
    num_heads: int = 1
    # Hidden width of each layer's feed-forward network.
    ffn_dim: int = 64
    # Dropout rate in the Transformer layers.
    dropout: float = 0.0
    # What the Transformer's encoded events become: "summary" (a prepended summary token's output),
    # "mean" (masked mean) -- once per request -- "transact" (TransAct-style: max-pool plus the latest
    # transact_recent tokens), and "target" (each candidate attends over the encoded events).
    poolings: List[Literal["summary", "mean", "transact", "target"]] = field(
        default_factory=lambda: ["summary", "mean", "target"]
    )
    # Latest encoded events the transact pooling keeps beside its max-pool.
    transact_recent: int = 4
    # Period sum pooling: period boundaries in seconds of time delta (request time - event time);
    # [a, b, c] makes the periods [0, a), [a, b), [b, c), [c, inf). Future events are left out.
    period_boundaries_s: List[float] = field(default_factory=lambda: [3600.0, 86400.0, 7 * 86400.0])
    # DIN: hidden widths of the attention MLP over [q, k, q - k, q * k].
    din_hidden: List[int] = field(default_factory=lambda: [32])
    # Long/short interest: the short-term part's window and attention MLP.
    short_length: int = 8
    # Hidden widths of the short-term part's attention MLP.
    short_hidden: List[int] = field(default_factory=lambda: [16])
    early_interaction: EarlyInteractionConfig = field(default_factory=EarlyInteractionConfig)
    projection: SequenceProjectionConfig = field(default_factory=SequenceProjectionConfig)
    hstu: HSTUConfig = field(default_factory=HSTUConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)


@dataclass
class DCNConfig:
    # DCNv2 cross layers over the concatenated input features (the ranker's, or a tower's).
    num_layers: int = 2
    # Low-rank cross layers (DCNv2 "mixture" style matrix factorization); 0 = full-rank.
    low_rank: int = 32


@dataclass
class MMoEConfig:
    # Shared expert MLPs, mixed by one softmax gate per task.
    num_experts: int = 4
    # Hidden widths of each expert MLP (the last is the experts' output width).
    expert_dims: List[int] = field(default_factory=lambda: [128, 64])
    # Hidden widths of each task's tower before its output layer (empty: a linear map).
    tower_dims: List[int] = field(default_factory=lambda: [32])


@dataclass
class ResilientBNConfig:
    """Resilient Batch Norm (sequence-modeling article; pinads_rec/modules/resilient_bn.py)."""

    # A column whose batch variance is below this is left out of the running-statistics update.
    minimal_variance: float = 1e-4
    # A column whose batch variance differs from the running variance by more than this factor
    # (either way) is left out of the update.
    variance_shift_threshold: float = 10.0
    # Running-statistics update rate, as BatchNorm1d's momentum.
    momentum: float = 0.1
    # Added to the variance before dividing by its root, as BatchNorm1d's eps.
    eps: float = 1e-5


@dataclass
class TwoTowerConfig:
    """The lightweight two-tower ranker (two-tower article): user tower and ad tower, each MMoE-DCN,
    one dot product per task."""

    # Width of each task's user and ad vectors.
    embedding_dim: int = 32
    # Each tower's DCNv2 cross network.
    dcn: DCNConfig = field(default_factory=lambda: DCNConfig(num_layers=1, low_rank=16))
    # Each tower's MMoE (its per-task outputs are the embedding_dim-wide vectors).
    mmoe: MMoEConfig = field(default_factory=lambda: MMoEConfig(num_experts=2, expert_dims=[64], tower_dims=[]))


@dataclass
class PrecisionConfig:
    """Mixed precision: the large layers (Transformer, DCNv2 cross network, MMoE experts) run in
    this dtype; embeddings, small layers, calibration and the loss stay float32."""

    # The large layers' dtype in training.
    train: Literal["fp32", "bf16", "fp16"] = "fp32"
    # auto: BF16 where the serving device has fast BF16 (CUDA with native BF16, a CPU with AMX or
    # avx512_bf16), FP32 elsewhere, where BF16 is emulated and slower (modules/precision.py resolve).
    inference: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    # FP16 overflowed (inf/NaN out of a large layer): stop with an error naming the layer, or
    # redo that layer in BF16 (counted).
    fp16_overflow: Literal["error", "bf16"] = "error"


@dataclass
class ModelConfig:
    # The model: the unified ranker, or the two-tower ranker (model.two_tower).
    kind: Literal["ranker", "two_tower"] = "ranker"
    # Every sequence group's encoder; sequence_groups.<group> changes some keys for one group
    # (the unset ones are model.sequence's).
    sequence: SequenceEncoderConfig = field(default_factory=SequenceEncoderConfig)
    # Per-group encoders: sequence group name -> the keys that differ from model.sequence.
    sequence_groups: Dict[str, SequenceEncoderConfig] = field(default_factory=dict)
    # The ranker's DCNv2 cross network.
    dcn: DCNConfig = field(default_factory=DCNConfig)
    # The ranker's MMoE: shared experts, a gate and a tower per task, a logit per surface.
    mmoe: MMoEConfig = field(default_factory=MMoEConfig)
    # Calibration on top of the logits: one affine map per (surface, task), one per task shared by
    # all surfaces ("global"), or none; fit after training on data.calibration_holdout.
    calibration: Literal["surface", "global", "none"] = "surface"
    # Request-level broadcasting: user-side work (user features, sequence encoders) runs once per
    # unique request and is broadcast to its candidates; off, it runs once per row (same outputs).
    broadcast: bool = True
    resilient_bn: ResilientBNConfig = field(default_factory=ResilientBNConfig)
    two_tower: TwoTowerConfig = field(default_factory=TwoTowerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)

    def sequence_for(self, group: str) -> SequenceEncoderConfig:
        return self.sequence_groups.get(group, self.sequence)


@dataclass
class EvalEveryConfig:
    """How often training pauses to evaluate (train.eval_every): every ``epochs`` epochs (at the
    epoch's end) or every ``steps`` steps; set exactly one."""

    # Evaluate every this many epochs, at the epoch's end (0: by steps).
    epochs: int = 0
    # Evaluate every this many steps (0: by epochs).
    steps: int = 0


# The metrics an evaluation can select on, and the direction in which each is better.
SELECTION_METRICS = {"auc": "max", "ne": "min", "log_loss": "min", "ece": "min"}


@dataclass
class EarlyStopConfig:
    """Which evaluation is the best (its weights are the run's model) and when training stops
    (train.early_stop; used with train.eval_every)."""

    # A metric of the evaluation rows (pinads_rec/metrics.py), averaged over the cells chosen below.
    metric: Literal["auc", "ne", "log_loss", "ece"] = "auc"
    # A task's name, or null: the mean over the tasks.
    task: Optional[str] = None
    # "mean": over the surfaces (per-surface AUC ignores the surfaces' different base rates, which
    # an uncalibrated model gets wrong); "all": the rows of all surfaces pooled; or a surface's name.
    surface: str = "mean"
    # Better is higher (max) or lower (min); null: the metric's own (auc max; ne, log_loss, ece min).
    mode: Optional[Literal["max", "min"]] = None
    # Evaluations in a row without improvement before training stops; 0: it never stops early (the
    # best evaluation's weights are still the run's model).
    patience: int = 0
    # An evaluation improves on the best by more than this, or not at all.
    min_delta: float = 0.0

    @property
    def better(self) -> str:
        return self.mode or SELECTION_METRICS[self.metric]


@dataclass
class TrainConfig:
    # Seeds the model's initialization, the row-group deal and the request shuffle.
    seed: int = 0
    # Passes over data.train_dir (train.max_steps may stop earlier).
    epochs: int = 1
    # Stop after this many steps (0: run the epochs).
    max_steps: int = 0
    # Peak learning rate of the dense layers' AdamW (after the warm-up, before the decay).
    lr: float = 1e-3
    # Steps of linear warm-up to lr (dense layers).
    warmup_steps: int = 50
    # Linear decay to lr * final_lr_ratio at the last step.
    final_lr_ratio: float = 0.1
    # AdamW weight decay of the dense layers.
    weight_decay: float = 0.0
    # The dense AdamW's implementation in torch.optim: "fused" (one kernel for all parameters),
    # "foreach" (multi-tensor kernels) or "for_loop" (per parameter). Same update up to rounding;
    # the choice is speed (benchmarks/train_throughput.py compares them).
    dense_optimizer_kernel: Literal["fused", "foreach", "for_loop"] = "fused"
    # Learning rate of the embedding tables' optimizer (constant: the schedule is the dense layers').
    embedding_lr: float = 0.05
    # Fused embedding optimizer; on CPU only the exact SGD/Adagrad family is available.
    embedding_optimizer: Literal["rowwise_adagrad", "adagrad", "sgd", "adam"] = "rowwise_adagrad"
    # Where the run writes metrics.jsonl, config.json, checkpoints and TensorBoard events. Training
    # requires it.
    run_dir: Optional[str] = None
    # Steps between checkpoints (0: none but the run's last and the best evaluation's).
    checkpoint_every: int = 0
    # Newest checkpoints kept (older ones are pruned; the best evaluation's is spared).
    keep_checkpoints: int = 3
    # Warm start (not a resume): a run directory (its newest checkpoint: the run's final model) or a
    # checkpoint directory (<run_dir>/checkpoints/step-N) whose weights start this run, on new data
    # and any world size (its sharding plan is reused, its shards re-placed). The step, epoch, LR
    # schedule (warm-up included), RNG, metrics and best evaluation start fresh; its features and
    # model must be this config's (a difference is an error naming the keys). Ignored once this
    # run's own train.run_dir holds a checkpoint: a relaunch resumes from that.
    init_from: Optional[str] = None
    # Optimizer state the warm start carries over: "all" (the dense AdamW moments and the embedding
    # optimizer's), "embedding" (the embedding tables' only; the dense layers' moments start at
    # zero) or "none" (the weights only). This run's learning rates and weight decay apply either way.
    init_optimizer: Literal["all", "embedding", "none"] = "all"
    # Steps between step records (metrics.jsonl, console, TensorBoard).
    log_every: int = 20
    # Sharding types the planner may use (subset of table_wise, row_wise, column_wise,
    # table_row_wise, table_column_wise, data_parallel); empty = all that suit the device on CUDA,
    # table_wise on CPU (gloo: pinads_rec.parallel.CPU_DEFAULT_SHARDING says why).
    sharding_types: List[str] = field(default_factory=list)
    # A plan saved by `python -m pinads_rec.plan --out`: each table keeps its sharding type and
    # compute kernel (the planner still places shards for the actual world size).
    plan_file: Optional[str] = None
    # A non-finite loss or gradient: stop naming the step, task and batch source, or skip the
    # batch (no update) and count it in the metrics log.
    nonfinite: Literal["stop", "skip"] = "stop"
    # TensorBoard event files in run_dir beside metrics.jsonl (`tensorboard --logdir <run_dir>`).
    tensorboard: bool = True
    # [first, last]: every rank records a torch.profiler trace of steps first..last (inclusive) to
    # <run_dir>/profile/ (Chrome trace JSON: Perfetto, chrome://tracing). Empty: no trace.
    profile_steps: List[int] = field(default_factory=list)
    # Seconds a collective (all-to-all, all-reduce, barrier...) may wait for the other ranks before
    # the run stops naming the rank and step: a rank that died or hangs ends the job in this time,
    # not the backend's 30 minutes. Above the slowest legitimate wait (a peer's checkpoint save, its
    # first step's tracing).
    collective_timeout_s: float = 600.0
    # Evaluations during training: {epochs: N} or {steps: N}; null: none (the final one only). Each
    # is logged, in metrics.jsonl and TensorBoard; the best one's weights (train.early_stop.metric)
    # are reloaded at the end, so calibration, the final evaluation and serving use them.
    eval_every: Optional[EvalEveryConfig] = None
    # Where: "holdout", the rows held out for calibration, never trained on (data.calibration_dir,
    # or data.calibration_holdout's last training row groups), which leaves data.eval_dir unseen by
    # the choice; or "eval", data.eval_dir itself (then the final evaluation is of a chosen model).
    eval_on: Literal["holdout", "eval"] = "holdout"
    # The metric that picks the best evaluation, and early stopping (its patience); null: the
    # defaults (mean AUC over surfaces and tasks; never stops early). Needs train.eval_every.
    early_stop: Optional[EarlyStopConfig] = None

    @property
    def selection(self) -> EarlyStopConfig:
        """train.early_stop, or its defaults."""
        return self.early_stop or EarlyStopConfig()


@dataclass
class ServeConfig:
    """The online ranking service (``python -m pinads_rec.serve online``; docs/serving.md): Ray
    Serve's HTTP proxy in front of ``replicas`` copies of the model, each batching concurrent
    requests."""

    host: str = "127.0.0.1"  # the HTTP proxy's address (0.0.0.0 to serve other machines)
    port: int = 8000  # the HTTP proxy's port
    replicas: int = 1  # model replicas (Ray actors); each gets cores / replicas torch threads
    # torch threads per replica; 0: the machine's cores less one (left to the HTTP proxy) over the
    # replicas, at least 1.
    threads: int = 0
    # At most this many replicas on one Ray node (0: no bound); 1 puts each replica on a node of its own.
    max_replicas_per_node: int = 0
    # Where a replica scores: cpu, cuda (one GPU a replica: Ray places them), or auto (cuda where torch
    # sees a GPU, else cpu).
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Dynamic batching: a replica scores up to this many concurrent requests at once (1: one at a time).
    max_batch_size: int = 32
    # How long a batch waits after its first request for others to join, milliseconds.
    batch_wait_ms: float = 5.0
    # Backpressure: requests a replica holds (scoring or waiting for its batch).
    max_ongoing_requests: int = 32
    # Requests queued at the proxy beyond those a replica holds; past them a request gets 503.
    max_queued_requests: int = 64
    retry_after_s: float = 1.0  # the 503's Retry-After, seconds
    max_candidates: int = 500  # a request with more candidates is refused (400)
    max_events: int = 5000  # a request with more rows of one behaviour log is refused (400)
    # How often a replica looks for a newer model (a run's newer checkpoint, the daily loop's next
    # day), seconds; 0: never.
    reload_poll_s: float = 10.0


@dataclass
class ReferenceConfig:
    """The reference model beside every run (``python -m pinads_rec.reference``; docs/datasets.md):
    LightGBM on point-in-time features the project computes from the built files -- the user's and
    the item's positive rates on the training split, the matches of the candidate with the newest
    events of each sequence group, the dense features -- scored on the eval split and printed in the
    run's final table beside the model."""

    # Fit and print the reference when a run ends (rank 0, after the evaluation).
    enabled: bool = True
    # Training rows it is fitted on: a uniform sample of whole requests when the split holds more
    # (bounds its time and memory; the table says how many were used).
    max_train_rows: int = 300000
    # Eval rows it scores: a uniform sample of whole requests beyond this (0: every row, as the model).
    max_eval_rows: int = 0
    trees: int = 200  # LightGBM's boosting rounds per task
    leaves: int = 31  # LightGBM's num_leaves
    learning_rate: float = 0.1  # LightGBM's shrinkage per round
    seed: int = 0  # the row sample's and LightGBM's seed


@dataclass
class ExperimentConfig:
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    data: DataConfig = field(default_factory=DataConfig)
    synth: SynthConfig = field(default_factory=SynthConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    build: BuildConfig = field(default_factory=BuildConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
