"""The experiment config: typed dataclasses loaded from YAML, validated once at load.

Every default lives in the schema. A config file only states what differs; a wrong key, a wrong type,
a negative size or a reference to an undeclared table/column fails at load with the key's dotted path
(``features.tables[2].num_embeddings: must be > 0, got -5``). Command-line overrides use the same
paths: ``--set model.dcn.num_layers=3 --set train.lr=0.01``.

- ``schema.py``: the sections every tool shares as dataclasses, each key's default and (in its
  comment) meaning, the constants (``SHARDING_TYPES``, ``SELECTION_METRICS``, ``REQUIRED``...), and
  ``ExperimentConfig``, which composes them with the sections declared beside their owners:
  ``synth:`` (``data/synth_settings.py``), ``build:`` (``data/build_settings.py``) and each sequence
  encoder's keys (beside its entry in ``modules/encoders.py``)
- ``feature_declarations.py``: the ``features:`` section
- ``loading.py``: YAML -> dataclasses (``load``, ``from_dict``, ``read_yaml`` with ``extends:``),
  ``to_dict``, the ``--set`` overrides (``split_overrides``, ``add_overrides_flag``)
- ``checks.py``: the semantic checks, one function per section (``validate``), ``validate_layout``
  (where a model is built), ``require`` (a key only some tools need, asked for by the tool)

Everything is re-exported here, the sections declared elsewhere and ``config_base``'s
``ConfigError``, ``positive``, ``unique`` and ``CANDIDATE_PREFIX`` included: ``from pinads_rec import
config; config.load(...)``. A section's checks that only one tool reads live with that tool
(``data.build.check_build``).
"""

from pinads_rec.config.checks import require, validate, validate_layout
from pinads_rec.config.feature_declarations import (
    AdmissionConfig,
    ColumnsConfig,
    DenseFeatureConfig,
    FeaturesConfig,
    ManagedCollisionConfig,
    SequenceFeatureConfig,
    SequenceGroupConfig,
    SparseFeatureConfig,
    TableConfig,
    TaskConfig,
)
from pinads_rec.config.loading import (
    add_overrides_flag,
    from_dict,
    load,
    read_yaml,
    saved_as_today,
    split_overrides,
    to_dict,
)
from pinads_rec.config.schema import (
    REQUIRED,
    SELECTION_METRICS,
    SHARDING_TYPES,
    DataConfig,
    DCNConfig,
    EarlyInteractionConfig,
    EarlyStopConfig,
    EvalEveryConfig,
    ExperimentConfig,
    IdMatchConfig,
    MMoEConfig,
    ModelConfig,
    PrecisionConfig,
    ReferenceConfig,
    ResilientBNConfig,
    RowFilterConfig,
    SequenceEncoderConfig,
    ServeConfig,
    TrainConfig,
    TwoTowerConfig,
)
from pinads_rec.config_base import CANDIDATE_PREFIX, ConfigError, positive, unique
from pinads_rec.data.build_settings import (
    BuildConfig,
    ImpressionsConfig,
    NegativeDownsamplingConfig,
    RawSourceConfig,
    SequenceSourceConfig,
    SideTableConfig,
    SplitConfig,
    VocabularyConfig,
)
from pinads_rec.data.synth_settings import DriftConfig, FaultsConfig, LongHistoryConfig, SynthConfig
from pinads_rec.modules.encoders import (
    CountPair,
    HSTUConfig,
    MatchCountsConfig,
    RetrievalConfig,
    SequenceProjectionConfig,
)

__all__ = [
    "AdmissionConfig",
    "BuildConfig",
    "ReferenceConfig",
    "ServeConfig",
    "CANDIDATE_PREFIX",
    "ColumnsConfig",
    "ConfigError",
    "CountPair",
    "DCNConfig",
    "DataConfig",
    "DenseFeatureConfig",
    "EarlyInteractionConfig",
    "EarlyStopConfig",
    "EvalEveryConfig",
    "ExperimentConfig",
    "FaultsConfig",
    "FeaturesConfig",
    "HSTUConfig",
    "IdMatchConfig",
    "ImpressionsConfig",
    "DriftConfig",
    "LongHistoryConfig",
    "ManagedCollisionConfig",
    "MMoEConfig",
    "MatchCountsConfig",
    "ModelConfig",
    "NegativeDownsamplingConfig",
    "PrecisionConfig",
    "REQUIRED",
    "RawSourceConfig",
    "ResilientBNConfig",
    "RetrievalConfig",
    "RowFilterConfig",
    "SELECTION_METRICS",
    "SHARDING_TYPES",
    "SequenceEncoderConfig",
    "SequenceFeatureConfig",
    "SequenceGroupConfig",
    "SequenceProjectionConfig",
    "SequenceSourceConfig",
    "SideTableConfig",
    "SparseFeatureConfig",
    "SplitConfig",
    "SynthConfig",
    "TableConfig",
    "TaskConfig",
    "TrainConfig",
    "TwoTowerConfig",
    "VocabularyConfig",
    "add_overrides_flag",
    "from_dict",
    "load",
    "positive",
    "read_yaml",
    "require",
    "saved_as_today",
    "split_overrides",
    "to_dict",
    "unique",
    "validate",
    "validate_layout",
]
