"""Experiment configuration: typed dataclasses loaded from YAML, validated once at load.

Every default lives here. A config file only states what differs; a wrong key, a wrong type, a
negative size or a reference to an undeclared table/column fails at load with the key's dotted path
(``features.tables[2].num_embeddings: must be > 0, got -5``). Command-line overrides use the same
paths: ``--set model.dcn.num_layers=3 --set train.lr=0.01``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Sequence

import yaml


class ConfigError(ValueError):
    """A config that cannot be used; the message names the offending key."""


CANDIDATE_PREFIX = "candidate."


# --------------------------------------------------------------------------------------------
# Feature declarations: which Parquet column is what. Nothing about columns is hard-coded.
# --------------------------------------------------------------------------------------------


@dataclass
class TableConfig:
    """One embedding table; several features may share it."""

    name: str
    num_embeddings: int
    embedding_dim: int
    # Ids >= num_embeddings are hashed into range (id mod size); without it they are an error.
    hash: bool = False


@dataclass
class SparseFeatureConfig:
    """A categorical feature of the candidate row: an int64 column (one id) or list<int64> column
    (multi-hot), pooled by an EmbeddingBagCollection. A single-id feature whose table is also used by
    sequence features is looked up by the EmbeddingCollection instead, so the candidate and the
    user's events share one embedding space (e.g. the candidate's topic and the events' topics)."""

    name: str
    column: str
    table: str
    pooling: Literal["sum", "mean"] = "sum"
    # True for the user-side features (same for every candidate of a request): these may be
    # computed once per request and broadcast.
    user_side: bool = False


@dataclass
class DenseFeatureConfig:
    """A float column (dim 1) or a fixed-size list<float> column (dim > 1)."""

    name: str
    column: str
    dim: int = 1
    # Per-feature normalization before the dense arch: signed log, min-max clip, layer norm, plain
    # BatchNorm1d, or Resilient Batch Norm (hyper-parameters in model.resilient_bn).
    norm: Literal["none", "log", "minmax", "layer_norm", "batch_norm", "resilient_bn"] = "none"
    clip_min: float = 0.0
    clip_max: float = 1.0
    # Same value for every candidate of a request (e.g. the user's activity): the two-tower model
    # puts it in the user tower.
    user_side: bool = False


@dataclass
class SequenceFeatureConfig:
    """One id attribute of a sequence event (item id, action type, taxonomy id...)."""

    name: str
    column: str
    table: str


@dataclass
class SequenceGroupConfig:
    """Aligned list columns describing the user's recent engagement events, newest first."""

    name: str
    timestamp_column: str
    features: List[SequenceFeatureConfig]
    max_length: int = 100
    # Optional list<fixed_size_list<float, dim>> column: a pretrained embedding per event.
    embedding_column: Optional[str] = None
    embedding_dim: int = 0


@dataclass
class TaskConfig:
    name: str
    label_column: str
    weight: float = 1.0
    # Column holding the probability the label was drawn from (synthetic data): enables oracle metrics.
    true_probability_column: Optional[str] = None


@dataclass
class ColumnsConfig:
    request_id: str = "request_id"
    user_id: str = "user_id"
    item_id: str = "item_id"
    surface: str = "surface"
    timestamp: str = "timestamp"


@dataclass
class FeaturesConfig:
    columns: ColumnsConfig = field(default_factory=ColumnsConfig)
    surfaces: List[str] = field(default_factory=lambda: ["home_feed", "related_pins", "search"])
    tasks: List[TaskConfig] = field(default_factory=list)
    tables: List[TableConfig] = field(default_factory=list)
    sparse: List[SparseFeatureConfig] = field(default_factory=list)
    dense: List[DenseFeatureConfig] = field(default_factory=list)
    sequence_groups: List[SequenceGroupConfig] = field(default_factory=list)

    def table(self, name: str) -> TableConfig:
        return next(t for t in self.tables if t.name == name)

    @property
    def dense_dim(self) -> int:
        return sum(d.dim for d in self.dense)

    @property
    def sequence_keys(self) -> List[str]:
        """KeyedJaggedTensor keys of the sequence features, group by group: ``<group>.<feature>``."""
        return [f"{g.name}.{f.name}" for g in self.sequence_groups for f in g.features]

    @property
    def sequence_tables(self) -> List[str]:
        return sorted({f.table for g in self.sequence_groups for f in g.features})

    @property
    def pooled_sparse(self) -> List[SparseFeatureConfig]:
        """Features looked up by the EmbeddingBagCollection."""
        return [s for s in self.sparse if s.table not in self.sequence_tables]

    @property
    def user_sparse(self) -> List[SparseFeatureConfig]:
        """Pooled user-side features looked up once per request (request-level broadcasting): those
        marked user_side whose table no candidate-side feature uses."""
        row_tables = {s.table for s in self.sparse if not s.user_side}
        return [s for s in self.pooled_sparse if s.user_side and s.table not in row_tables]

    @property
    def row_sparse(self) -> List[SparseFeatureConfig]:
        """Pooled features looked up once per row (candidate-side, or sharing a candidate table)."""
        user = {s.name for s in self.user_sparse}
        return [s for s in self.pooled_sparse if s.name not in user]

    @property
    def shared_sparse(self) -> List[SparseFeatureConfig]:
        """Candidate features whose table is a sequence table: looked up by the EmbeddingCollection."""
        return [s for s in self.sparse if s.table in self.sequence_tables]

    @property
    def embedding_collection_keys(self) -> List[str]:
        """Keys of the per-request KJT: the sequence features, then ``candidate.<feature>`` holding
        each request's candidates' ids in row order (so their lookups come back as [B, D])."""
        return self.sequence_keys + [CANDIDATE_PREFIX + s.name for s in self.shared_sparse]


# --------------------------------------------------------------------------------------------
# Data loading, synthetic data, model and training.
# --------------------------------------------------------------------------------------------


@dataclass
class RowFilterConfig:
    column: str
    values: List[int]


@dataclass
class DataConfig:
    train_dir: str = "data/demo/train"
    eval_dir: str = "data/demo/eval"
    batch_size: int = 512
    # Rows held for shuffling (whole requests are shuffled, never split by the buffer).
    shuffle_buffer_rows: int = 16384
    num_workers: int = 1
    # NaN/inf in a dense column: stop with an error, or replace by 0 and count the repair.
    nonfinite_dense: Literal["error", "replace"] = "error"
    # Sequences longer than max_length: keep the newest max_length events and count, or error.
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
    zero_fill_window: List[float] = field(default_factory=lambda: [0.4, 0.5])
    # Dense column whose distribution shifts (scale x shift_scale + shift_offset) after a time point.
    shift_column: Optional[str] = None
    shift_after: float = 0.7
    shift_scale: float = 5.0
    shift_offset: float = 3.0
    # Fraction of rows whose dense values are stale (copied from an earlier row of the user).
    stale_fraction: float = 0.0


@dataclass
class SynthConfig:
    """Sizes and seed of the planted-truth synthetic data (see docs/synthetic_data.md)."""

    seed: int = 0
    train_requests: int = 20000
    eval_requests: int = 4000
    # Extra requests over the latest 5% of the training span, written to calibration/ (fit the
    # calibration layers on them with data.calibration_dir). 0: no calibration split.
    calibration_requests: int = 0
    candidates_per_request: float = 12.0
    num_users: int = 200000
    num_items: int = 50000
    num_advertisers: int = 2000
    num_topics: int = 32
    sequence_length: int = 100
    # Width of the pretrained per-event embedding of the pins group (a noisy topic vector). It is
    # repeated on every candidate row of a request, so it dominates the file size.
    event_embedding_dim: int = 32
    num_files: int = 4
    row_group_size: int = 8192
    faults: FaultsConfig = field(default_factory=FaultsConfig)


@dataclass
class SequenceEncoderConfig:
    """Encoder applied to every sequence group (issue-level variants extend this)."""

    d_model: int = 32
    num_layers: int = 1
    num_heads: int = 1
    ffn_dim: int = 64
    dropout: float = 0.0
    # Time-delta position embedding: bucket = floor(log2(1 + seconds)), clamped to num_buckets - 1.
    time_buckets: int = 24
    # How the encoded events become features: "summary" (the prepended summary token), "mean"
    # (masked mean of the events) -- both once per request -- and "target" (each candidate attends
    # over its request's events: per row, light).
    poolings: List[Literal["summary", "mean", "target"]] = field(
        default_factory=lambda: ["summary", "mean", "target"])


@dataclass
class DCNConfig:
    num_layers: int = 2
    # Low-rank cross layers (DCNv2 "mixture" style matrix factorization); 0 = full-rank.
    low_rank: int = 32


@dataclass
class MMoEConfig:
    num_experts: int = 4
    expert_dims: List[int] = field(default_factory=lambda: [128, 64])
    tower_dims: List[int] = field(default_factory=lambda: [32])


@dataclass
class ResilientBNConfig:
    """Resilient Batch Norm (sequence-modeling article; pinads_rec/modules/resilient_bn.py)."""

    # A column whose batch variance is below this is left out of the running-statistics update.
    minimal_variance: float = 1e-4
    # A column whose batch variance differs from the running variance by more than this factor
    # (either way) is left out of the update.
    variance_shift_threshold: float = 10.0
    momentum: float = 0.1
    eps: float = 1e-5


@dataclass
class TwoTowerConfig:
    """The lightweight two-tower ranker (two-tower article): user tower and ad tower, each MMoE-DCN,
    one dot product per task."""

    # Width of each task's user and ad vectors.
    embedding_dim: int = 32
    dcn: DCNConfig = field(default_factory=lambda: DCNConfig(num_layers=1, low_rank=16))
    mmoe: MMoEConfig = field(default_factory=lambda: MMoEConfig(num_experts=2, expert_dims=[64], tower_dims=[]))


@dataclass
class PrecisionConfig:
    """Mixed precision: the large layers (Transformer, DCNv2 cross network, MMoE experts) run in
    this dtype; embeddings, small layers, calibration and the loss stay float32."""

    train: Literal["fp32", "bf16", "fp16"] = "fp32"
    inference: Literal["fp32", "bf16", "fp16"] = "bf16"
    # FP16 overflowed (inf/NaN out of a large layer): stop with an error naming the layer, or
    # redo that layer in BF16 (counted).
    fp16_overflow: Literal["error", "bf16"] = "error"


@dataclass
class ModelConfig:
    kind: Literal["ranker", "two_tower"] = "ranker"
    sequence: SequenceEncoderConfig = field(default_factory=SequenceEncoderConfig)
    dcn: DCNConfig = field(default_factory=DCNConfig)
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


@dataclass
class TrainConfig:
    seed: int = 0
    epochs: int = 1
    # Stop after this many steps (0: run the epochs).
    max_steps: int = 0
    lr: float = 1e-3
    warmup_steps: int = 50
    # Linear decay to lr * final_lr_ratio at the last step.
    final_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    embedding_lr: float = 0.05
    # Fused embedding optimizer; on CPU only the exact SGD/Adagrad family is available.
    embedding_optimizer: Literal["rowwise_adagrad", "adagrad", "sgd", "adam"] = "rowwise_adagrad"
    run_dir: str = "runs/demo"
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    log_every: int = 20
    # Sharding types the planner may use (subset of table_wise, row_wise, column_wise,
    # table_row_wise, table_column_wise, data_parallel); empty = all that suit the device.
    sharding_types: List[str] = field(default_factory=list)
    # A plan saved by `python -m pinads_rec.plan --out`: each table keeps its sharding type and
    # compute kernel (the planner still places shards for the actual world size).
    plan_file: Optional[str] = None
    # A non-finite loss or gradient: stop naming the step, task and batch source, or skip the
    # batch (no update) and count it in the metrics log.
    nonfinite: Literal["stop", "skip"] = "stop"


@dataclass
class ExperimentConfig:
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    data: DataConfig = field(default_factory=DataConfig)
    synth: SynthConfig = field(default_factory=SynthConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


# --------------------------------------------------------------------------------------------
# Loading: YAML -> dataclasses with type checks, then semantic checks.
# --------------------------------------------------------------------------------------------


def _convert(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], path)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{path}: must be one of {list(args)}, got {value!r}")
        return value
    if origin in (list, List, Sequence):
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        return [_convert(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
    if origin in (dict, Dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        return {str(k): _convert(v, args[1], f"{path}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported config type {tp}")  # a bug in this module, not the user's


def _build(cls: type, raw: Any, path: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path or '<root>'}: expected a mapping, got {type(raw).__name__} {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        where = f"{path}.{unknown[0]}" if path else unknown[0]
        raise ConfigError(f"{where}: unknown key (valid keys here: {sorted(names)})")
    kwargs = {}
    for f in dataclasses.fields(cls):
        sub = f"{path}.{f.name}" if path else f.name
        if f.name in raw:
            kwargs[f.name] = _convert(raw[f.name], hints[f.name], sub)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{sub}: required key is missing")
    return cls(**kwargs)


def _set_override(raw: dict, assignment: str) -> None:
    if "=" not in assignment:
        raise ConfigError(f"override {assignment!r}: expected key.path=value")
    key, text = assignment.split("=", 1)
    value = yaml.safe_load(text) if text else ""
    node = raw
    parts = key.strip().split(".")
    for i, part in enumerate(parts[:-1]):
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {key}: {'.'.join(parts[: i + 1])} is not a mapping")
        node = nxt
    node[parts[-1]] = value


def _validate(cfg: ExperimentConfig) -> None:
    f = cfg.features

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

    unique("features.tables", [t.name for t in f.tables])
    unique("features.sparse", [s.name for s in f.sparse])
    unique("features.dense", [d.name for d in f.dense])
    unique("features.sequence_groups", [g.name for g in f.sequence_groups])
    unique("features.tasks", [t.name for t in f.tasks])
    if not f.tasks:
        raise ConfigError("features.tasks: at least one task (label column) is required")
    if not f.surfaces:
        raise ConfigError("features.surfaces: at least one surface is required")
    for i, name in enumerate(f.surfaces):
        if name in f.surfaces[:i]:
            raise ConfigError(f"features.surfaces[{i}]: duplicate surface {name!r}")
    for i, t in enumerate(f.tables):
        positive(f"features.tables[{i}].num_embeddings", t.num_embeddings)
        positive(f"features.tables[{i}].embedding_dim", t.embedding_dim)
    tables = {t.name for t in f.tables}
    for i, s in enumerate(f.sparse):
        if s.table not in tables:
            raise ConfigError(f"features.sparse[{i}].table: no table named {s.table!r} in features.tables")
    for i, d in enumerate(f.dense):
        positive(f"features.dense[{i}].dim", d.dim)
        if d.norm == "minmax" and d.clip_max <= d.clip_min:
            raise ConfigError(f"features.dense[{i}].clip_max: must exceed clip_min ({d.clip_min})")
    for i, g in enumerate(f.sequence_groups):
        positive(f"features.sequence_groups[{i}].max_length", g.max_length)
        if not g.features:
            raise ConfigError(f"features.sequence_groups[{i}].features: a group needs at least one id feature")
        for j, sf in enumerate(g.features):
            where = f"features.sequence_groups[{i}].features[{j}].table"
            if sf.table not in tables:
                raise ConfigError(f"{where}: no table named {sf.table!r} in features.tables")
        if g.name + "." == CANDIDATE_PREFIX:
            raise ConfigError(f"features.sequence_groups[{i}].name: 'candidate' is reserved")
        if g.embedding_column is not None:
            positive(f"features.sequence_groups[{i}].embedding_dim", g.embedding_dim)
    d, s, m, t = cfg.data, cfg.synth, cfg.model, cfg.train
    positive("data.batch_size", d.batch_size)
    positive("data.shuffle_buffer_rows", d.shuffle_buffer_rows, allow_zero=True)
    positive("data.num_workers", d.num_workers, allow_zero=True)
    positive("data.max_unique_users_per_batch", d.max_unique_users_per_batch, allow_zero=True)
    if not 0.0 <= d.calibration_holdout < 1.0:
        raise ConfigError(f"data.calibration_holdout: must be in [0, 1), got {d.calibration_holdout}")
    if d.calibration_dir and d.calibration_holdout > 0.0:
        raise ConfigError(f"data.calibration_holdout: {d.calibration_holdout} rows held out of training would go "
                          f"unused: the calibration is fit on data.calibration_dir; set it to 0")
    if d.calibration_holdout == 0.0 and not d.calibration_dir and cfg.model.calibration != "none":
        raise ConfigError(f"data.calibration_holdout: model.calibration {cfg.model.calibration!r} is fit on "
                          f"unseen rows; set a fraction > 0 (e.g. 0.05), or data.calibration_dir, or "
                          f"model.calibration: none")
    if d.row_filter is not None:
        known = {c.column for c in f.sparse} | {getattr(f.columns, k) for k in ("surface", "user_id", "item_id")}
        if d.row_filter.column not in known:
            raise ConfigError(f"data.row_filter.column: {d.row_filter.column!r} is not an int64 column of the "
                              f"contract (sparse feature columns or surface/user_id/item_id)")
        if not d.row_filter.values:
            raise ConfigError("data.row_filter.values: list at least one value to keep")
    positive("synth.calibration_requests", s.calibration_requests, allow_zero=True)
    for name in ("train_requests", "eval_requests", "num_users", "num_items", "num_advertisers",
                 "num_topics", "sequence_length", "event_embedding_dim", "num_files", "row_group_size"):
        positive(f"synth.{name}", getattr(s, name))
    positive("synth.candidates_per_request", s.candidates_per_request)
    enc = m.sequence
    positive("model.sequence.d_model", enc.d_model)
    positive("model.sequence.num_layers", enc.num_layers, allow_zero=True)
    positive("model.sequence.num_heads", enc.num_heads)
    positive("model.sequence.time_buckets", enc.time_buckets)
    if not enc.poolings or len(set(enc.poolings)) != len(enc.poolings):
        raise ConfigError(f"model.sequence.poolings: need one or more distinct poolings, got {enc.poolings}")
    if enc.d_model % enc.num_heads:
        raise ConfigError(f"model.sequence.num_heads: {enc.num_heads} does not divide d_model {enc.d_model}")
    positive("model.dcn.num_layers", m.dcn.num_layers, allow_zero=True)
    positive("model.dcn.low_rank", m.dcn.low_rank, allow_zero=True)
    positive("model.mmoe.num_experts", m.mmoe.num_experts)
    rbn = m.resilient_bn
    positive("model.resilient_bn.minimal_variance", rbn.minimal_variance, allow_zero=True)
    positive("model.resilient_bn.eps", rbn.eps)
    if rbn.variance_shift_threshold <= 1.0:
        raise ConfigError(f"model.resilient_bn.variance_shift_threshold: must be > 1 (a ratio), "
                          f"got {rbn.variance_shift_threshold}")
    if not 0.0 < rbn.momentum <= 1.0:
        raise ConfigError(f"model.resilient_bn.momentum: must be in (0, 1], got {rbn.momentum}")
    positive("model.two_tower.embedding_dim", m.two_tower.embedding_dim)
    positive("model.two_tower.mmoe.num_experts", m.two_tower.mmoe.num_experts)
    if not m.two_tower.mmoe.expert_dims:
        raise ConfigError("model.two_tower.mmoe.expert_dims: at least one expert layer is required")
    for name in ("expert_dims", "tower_dims"):
        for i, v in enumerate(getattr(m.mmoe, name)):
            positive(f"model.mmoe.{name}[{i}]", v)
    if not m.mmoe.expert_dims:
        raise ConfigError("model.mmoe.expert_dims: at least one expert layer is required")
    positive("train.epochs", t.epochs)
    positive("train.keep_checkpoints", t.keep_checkpoints)
    positive("train.max_steps", t.max_steps, allow_zero=True)
    positive("train.lr", t.lr)
    positive("train.embedding_lr", t.embedding_lr)
    positive("train.warmup_steps", t.warmup_steps, allow_zero=True)
    valid_types = {"table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise", "data_parallel"}
    for i, st in enumerate(t.sharding_types):
        if st not in valid_types:
            raise ConfigError(f"train.sharding_types[{i}]: {st!r} is not one of {sorted(valid_types)}")


def from_dict(raw: Dict[str, Any], overrides: Sequence[str] = ()) -> ExperimentConfig:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"<root>: expected a mapping of sections, got {type(raw).__name__}")
    raw = copy.deepcopy(raw)  # overrides must not write into the caller's dicts
    for assignment in overrides:
        _set_override(raw, assignment)
    cfg = _build(ExperimentConfig, raw, "")
    _validate(cfg)
    return cfg


def load(path: str | Path, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Load a YAML config, apply ``key.path=value`` overrides, validate; ConfigError names the key."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    try:
        return from_dict(raw, overrides)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def to_dict(cfg: ExperimentConfig) -> Dict[str, Any]:
    return dataclasses.asdict(cfg)
