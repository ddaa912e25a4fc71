"""The ``features:`` section: which Parquet column is what (tables, sparse, dense and sequence
features, tasks, identity columns), the declarations every tool reads. Nothing about columns is
hard-coded elsewhere. Part of the schema (``schema.py`` composes it into ``ExperimentConfig``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Literal, Optional


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
