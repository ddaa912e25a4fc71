"""The config's semantic checks, one function per section; each error names the key it is about.

``validate`` runs them all on a freshly built config (``loading.from_dict``); each encoder's checks
come from its registry entry (modules/encoders.py). ``require`` is for the keys without a default
that only some tools read: the tool asks for them where it reads them. ``positive`` and ``unique``
(one value's checks) live in ``config_base``, which the settings declared beside their owners share.
"""

from __future__ import annotations

from typing import Any, Optional

from pinads_rec.config.feature_declarations import FeaturesConfig, SequenceGroupConfig
from pinads_rec.config.schema import (
    REQUIRED,
    SELECTION_METRICS,
    SHARDING_TYPES,
    DataConfig,
    ExperimentConfig,
    ModelConfig,
    SequenceEncoderConfig,
    TrainConfig,
)
from pinads_rec.config_base import CANDIDATE_PREFIX, ConfigError, positive, unique
from pinads_rec.modules import encoders as registry


def require(cfg: ExperimentConfig, key: str) -> Any:
    """The value of ``key``, a dotted path in ``schema.REQUIRED``: a ConfigError naming it and what it
    is when the config leaves it unset (None or empty). The tool that reads a path calls it."""
    what = REQUIRED[key]
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    if value is None or (isinstance(value, (str, list)) and not value):
        raise ConfigError(f"{key}: required -- {what}")
    return value


def validate(cfg: ExperimentConfig) -> None:
    """Every section's checks (run on each config built: ``loading.from_dict``)."""
    for key in ("features.tasks", "features.surfaces"):
        require(cfg, key)
    _validate_features(cfg.features)
    _validate_data(cfg.data, cfg.features, cfg.model)
    _validate_model(cfg.model, cfg.features)
    _validate_train(cfg.train, cfg)
    _validate_table_dtypes(cfg)


def _validate_table_dtypes(cfg: ExperimentConfig) -> None:
    """serve.table_dtypes: tables of features.tables, each given a dtype serve.embedding_dtype takes."""
    dtypes = ("fp32", "fp16", "int8", "int4")
    tables = [t.name for t in cfg.features.tables]
    for table, dtype in cfg.serve.table_dtypes.items():
        if table not in tables:
            raise ConfigError(f"serve.table_dtypes.{table}: no such table in features.tables ({tables})")
        if dtype not in dtypes:
            raise ConfigError(f"serve.table_dtypes.{table}: {dtype!r} is not one of {list(dtypes)}")


def _validate_managed_collision(where: str, t) -> None:
    mc = t.managed_collision
    if t.hash:
        raise ConfigError(
            f"{where}: hash and managed_collision both map ids beyond the table; keep one (managed_collision "
            "gives every id its own slot until evicted, hash shares rows for ever)"
        )
    if t.num_embeddings < 2:
        raise ConfigError(f"{where}.num_embeddings: a managed table needs 2 slots or more (one is the unknown row)")
    positive(f"{where}.managed_collision.eviction_interval", mc.eviction_interval)
    a = mc.admission
    if a.kind == "min_count":
        positive(f"{where}.managed_collision.admission.min_count", a.min_count)
    if a.kind == "dynamic" and not a.skew > 0:
        raise ConfigError(f"{where}.managed_collision.admission.skew: must be > 0, got {a.skew}")
    if a.kind == "probabilistic" and not 0 < a.probability <= 1:
        raise ConfigError(f"{where}.managed_collision.admission.probability: must be in (0, 1], got {a.probability}")


def _validate_features(f: FeaturesConfig) -> None:
    unique("features.tables", [t.name for t in f.tables])
    unique("features.sparse", [s.name for s in f.sparse])
    unique("features.dense", [d.name for d in f.dense])
    unique("features.sequence_groups", [g.name for g in f.sequence_groups])
    unique("features.tasks", [t.name for t in f.tasks])
    for i, name in enumerate(f.surfaces):
        if name in f.surfaces[:i]:
            raise ConfigError(f"features.surfaces[{i}]: duplicate surface {name!r}")
    for i, t in enumerate(f.tables):
        positive(f"features.tables[{i}].num_embeddings", t.num_embeddings)
        positive(f"features.tables[{i}].embedding_dim", t.embedding_dim)
        if t.managed_collision is not None:
            _validate_managed_collision(f"features.tables[{i}]", t)
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
            where = f"features.sequence_groups[{i}].features[{j}]"
            if sf.table not in tables:
                raise ConfigError(f"{where}.table: no table named {sf.table!r} in features.tables")
            positive(f"{where}.max_values", sf.max_values)
        if all(sf.multi_valued for sf in g.features):
            # Its per-request event counts are read off a single-id attribute's lengths.
            raise ConfigError(
                f"features.sequence_groups[{i}].features: every feature of group {g.name!r} is a bag "
                f"(max_values > 1); give the events one single-id attribute too (the item, the query, the action)"
            )
        if g.name + "." == CANDIDATE_PREFIX:
            raise ConfigError(f"features.sequence_groups[{i}].name: 'candidate' is reserved")
        if g.embedding_column is not None:
            positive(f"features.sequence_groups[{i}].embedding_dim", g.embedding_dim)


def validate_layout(f: FeaturesConfig, m: ModelConfig) -> None:
    """Any mix of pooled, user-side, sequence and dense features trains (a collection without tables
    is left out, features.py); a layout the model cannot be built or trained on is refused here
    rather than deep inside torch. Called where a model is built (``models.build_model``: training,
    planning, serving), not at load: configs for the data tools (build, inspect drafts) and the
    defaults skeleton may declare no model inputs."""
    if not (f.sparse or f.sequence_groups):
        # Without a sharded collection TrainPipelineSparseDist's tracer treats no submodule as a leaf
        # and fails inside the dense layers.
        what = "the model has no input" if not f.dense else "no embedding table, which the sharded training needs"
        raise ConfigError(
            f"features: no sparse features and no sequence groups ({what}); declare at least one "
            f"in features.sparse or features.sequence_groups"
        )
    if m.kind == "two_tower" and all(s.user_side for s in f.sparse) and all(d.user_side for d in f.dense):
        raise ConfigError(
            "features: model.kind two_tower needs a candidate-side feature for its ad tower; declare one in "
            "features.sparse or features.dense without user_side: true"
        )


def _validate_data(d: DataConfig, f: FeaturesConfig, m: ModelConfig) -> None:
    positive("data.batch_size", d.batch_size)
    positive("data.shuffle_buffer_rows", d.shuffle_buffer_rows, allow_zero=True)
    positive("data.num_workers", d.num_workers, allow_zero=True)
    positive("data.prefetch_factor", d.prefetch_factor)
    positive("data.max_unique_users_per_batch", d.max_unique_users_per_batch, allow_zero=True)
    if not 0.0 <= d.calibration_holdout < 1.0:
        raise ConfigError(f"data.calibration_holdout: must be in [0, 1), got {d.calibration_holdout}")
    if d.calibration_dir and d.calibration_holdout > 0.0:
        raise ConfigError(
            f"data.calibration_holdout: {d.calibration_holdout} rows held out of training would go "
            f"unused: the calibration is fit on data.calibration_dir; set it to 0"
        )
    if d.calibration_holdout == 0.0 and not d.calibration_dir and m.calibration != "none":
        raise ConfigError(
            f"data.calibration_holdout: model.calibration {m.calibration!r} is fit on "
            f"unseen rows; set a fraction > 0 (e.g. 0.05), or data.calibration_dir, or "
            f"model.calibration: none"
        )
    if d.row_filter is not None:
        known = {c.column for c in f.sparse} | {getattr(f.columns, k) for k in ("surface", "user_id", "item_id")}
        if d.row_filter.column not in known:
            raise ConfigError(
                f"data.row_filter.column: {d.row_filter.column!r} is not an int64 column of the "
                f"contract (sparse feature columns or surface/user_id/item_id)"
            )
        if not d.row_filter.values:
            raise ConfigError("data.row_filter.values: list at least one value to keep")


def _validate_model(m: ModelConfig, f: FeaturesConfig) -> None:
    group_names = [g.name for g in f.sequence_groups]
    for name in m.sequence_groups:
        if name not in group_names:
            raise ConfigError(
                f"model.sequence_groups.{name}: no sequence group named {name!r} in "
                f"features.sequence_groups ({group_names})"
            )
    _validate_encoder("model.sequence", m.sequence, f, None)
    for g in f.sequence_groups:
        if g.name in m.sequence_groups:
            _validate_encoder(f"model.sequence_groups.{g.name}", m.sequence_for(g.name), f, g)
            continue
        try:
            _validate_encoder("model.sequence", m.sequence, f, g)
        except ConfigError as e:
            # model.sequence passed alone: what fails is its fit to this group (a retrieval attribute
            # the group lacks, a window past its max_length), which an entry of the group's own changes.
            key = str(e).split(":", 1)[0]
            key = key.removeprefix("model.sequence.") if key.startswith("model.sequence.") else ""
            encoder = key.split(".")[0]
            drop = f", or its encoders without {encoder!r}" if encoder in m.sequence.encoders else ""
            raise ConfigError(
                f"{e}; model.sequence serves every group without an entry in model.sequence_groups: set "
                f"model.sequence_groups.{g.name}{'.' + key if key else ''} for group {g.name!r} alone{drop}"
            ) from None
    _validate_id_matches(m, f)
    positive("model.dcn.num_layers", m.dcn.num_layers, allow_zero=True)
    positive("model.dcn.low_rank", m.dcn.low_rank, allow_zero=True)
    positive("model.mmoe.num_experts", m.mmoe.num_experts)
    rbn = m.resilient_bn
    positive("model.resilient_bn.minimal_variance", rbn.minimal_variance, allow_zero=True)
    positive("model.resilient_bn.eps", rbn.eps)
    if rbn.variance_shift_threshold <= 1.0:
        raise ConfigError(
            f"model.resilient_bn.variance_shift_threshold: must be > 1 (a ratio), got {rbn.variance_shift_threshold}"
        )
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


def _validate_id_matches(m, f) -> None:
    """Each pair: a candidate-side sparse feature and another sparse feature on its table."""
    sparse = {s.name: s for s in f.sparse}
    for i, pair in enumerate(m.id_matches):
        where = f"model.id_matches[{i}]"
        cand, other = sparse.get(pair.candidate), sparse.get(pair.other)
        if cand is None or cand.user_side:
            raise ConfigError(
                f"{where}.candidate: {pair.candidate!r} is not a candidate-side sparse feature "
                f"({sorted(n for n, s in sparse.items() if not s.user_side)})"
            )
        if other is None or pair.other == pair.candidate:
            others = sorted(n for n in sparse if n != pair.candidate)
            raise ConfigError(f"{where}.other: {pair.other!r} is not another sparse feature ({others})")
        if other.table != cand.table:
            raise ConfigError(
                f"{where}.other: {pair.other!r} uses table {other.table!r} but {pair.candidate!r} uses {cand.table!r}: "
                f"a match compares ids, so both must use one table"
            )


def _validate_train(t: TrainConfig, cfg: ExperimentConfig) -> None:
    positive("train.epochs", t.epochs)
    positive("train.keep_checkpoints", t.keep_checkpoints)
    positive("train.max_steps", t.max_steps, allow_zero=True)
    positive("train.lr", t.lr)
    positive("train.embedding_lr", t.embedding_lr)
    positive("train.warmup_steps", t.warmup_steps, allow_zero=True)
    positive("train.collective_timeout_s", t.collective_timeout_s)
    for i, st in enumerate(t.sharding_types):
        if st not in SHARDING_TYPES:
            raise ConfigError(f"train.sharding_types[{i}]: {st!r} is not one of {sorted(SHARDING_TYPES)}")
    if t.profile_steps:
        if len(t.profile_steps) != 2:
            raise ConfigError(f"train.profile_steps: need [first, last] (two steps), got {t.profile_steps}")
        first, last = t.profile_steps
        positive("train.profile_steps[0]", first)
        if last < first:
            raise ConfigError(f"train.profile_steps: last step {last} is before first step {first}")
        if t.max_steps and last > t.max_steps:
            raise ConfigError(f"train.profile_steps: last step {last} is after train.max_steps {t.max_steps}")
    _validate_evaluations(t, cfg)


def _validate_evaluations(t: TrainConfig, cfg: ExperimentConfig) -> None:
    """train.eval_every, train.eval_on and train.early_stop."""
    if t.eval_every is None:
        if t.early_stop is not None:
            raise ConfigError("train.early_stop: needs train.eval_every (evaluations to compare), e.g. {epochs: 1}")
        return
    every = t.eval_every
    positive("train.eval_every.epochs", every.epochs, allow_zero=True)
    positive("train.eval_every.steps", every.steps, allow_zero=True)
    if bool(every.epochs) == bool(every.steps):
        raise ConfigError(
            f"train.eval_every: set one of epochs or steps (e.g. {{epochs: 1}} or {{steps: 500}}), "
            f"got epochs {every.epochs}, steps {every.steps}"
        )
    if every.epochs > t.epochs:
        raise ConfigError(f"train.eval_every.epochs: {every.epochs} is more than train.epochs {t.epochs}")
    d = cfg.data
    if t.eval_on == "holdout" and not d.calibration_dir and d.calibration_holdout == 0.0:
        raise ConfigError(
            "train.eval_on: holdout evaluates on the rows held out for calibration, and this config holds "
            "none out (data.calibration_dir unset, data.calibration_holdout 0); set one, or train.eval_on: eval"
        )
    stop = t.selection
    if stop.task is not None and stop.task not in [x.name for x in cfg.features.tasks]:
        raise ConfigError(
            f"train.early_stop.task: no task named {stop.task!r} in features.tasks "
            f"({[x.name for x in cfg.features.tasks]}); null for the mean over tasks"
        )
    if stop.surface not in ("mean", "all") and stop.surface not in cfg.features.surfaces:
        raise ConfigError(
            f"train.early_stop.surface: {stop.surface!r} is not 'mean', 'all' or one of features.surfaces "
            f"{cfg.features.surfaces}"
        )
    if stop.mode is not None and stop.mode != SELECTION_METRICS[stop.metric]:
        raise ConfigError(
            f"train.early_stop.mode: {stop.metric} is better when "
            f"{'higher' if SELECTION_METRICS[stop.metric] == 'max' else 'lower'}; mode {stop.mode} would keep "
            f"the worst evaluation (leave it unset)"
        )
    positive("train.early_stop.patience", stop.patience, allow_zero=True)
    positive("train.early_stop.min_delta", stop.min_delta, allow_zero=True)


def _validate_encoder(
    path: str, enc: SequenceEncoderConfig, features: FeaturesConfig, group: Optional[SequenceGroupConfig]
) -> None:
    positive(f"{path}.d_model", enc.d_model)
    positive(f"{path}.time_buckets", enc.time_buckets)
    if len(set(enc.encoders)) != len(enc.encoders):
        raise ConfigError(f"{path}.encoders: listed twice in {enc.encoders}")
    if not enc.encoders:
        raise ConfigError(f"{path}.encoders: list at least one (to drop a group's sequence, remove the group)")
    for i, name in enumerate(enc.encoders):
        if name not in registry.REGISTRY:
            raise ConfigError(f"{path}.encoders[{i}]: must be one of {registry.names()}, got {name!r}")
    e = enc.early_interaction
    for key in ("cosine", "tokens"):
        if len(set(getattr(e, key))) != len(getattr(e, key)):
            raise ConfigError(f"{path}.early_interaction.{key}: listed twice in {getattr(e, key)}")
    positive(f"{path}.window", enc.window, allow_zero=True)
    if group is not None and enc.window > group.max_length:
        raise ConfigError(
            f"{path}.window: {enc.window} is more than the max_length {group.max_length} of "
            f"sequence group {group.name!r}"
        )
    width = _event_width(features, group, enc)
    for entry in registry.REGISTRY.values():
        entry.check(registry.CheckContext(path, enc, features, group, width, entry.name in enc.encoders))


def _event_width(
    features: FeaturesConfig, group: Optional[SequenceGroupConfig], enc: SequenceEncoderConfig
) -> Optional[int]:
    """The group's event width as ``EventRepresentation`` makes it (None: concat without a group)."""
    if enc.combine == "sum":
        return registry.width_of_events([], 0, "sum", enc.d_model)
    if group is None:
        return None
    attr_dims = [features.table(f.table).embedding_dim for f in group.features]
    pretrained = group.embedding_dim if group.embedding_column else 0
    return registry.width_of_events(attr_dims, pretrained, "concat", enc.d_model)
