"""The experiment config's schema: what every tool shares, and the sections composed from the
settings their owners declare.

Each field's meaning is the ``#`` comment above it (``config_reference`` renders them as
docs/config.md). A config file only states what differs from these defaults; ``loading.py`` turns a
YAML mapping into these classes, ``checks.py`` checks their values. The ``features:`` section is
in ``feature_declarations.py``. Sections one tool owns are declared beside it and composed here:
``synth:`` in ``data/synth_settings.py``, ``build:`` in ``data/build_settings.py``, each sequence
encoder's keys beside its registry entry (``modules/encoders.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional

from pinads_rec.config.feature_declarations import FeaturesConfig
from pinads_rec.data.build_settings import BuildConfig
from pinads_rec.data.synth_settings import SynthConfig
from pinads_rec.modules import encoders as registry
from pinads_rec.modules.encoders import (
    DINSettings,
    HSTUConfig,
    LongShortSettings,
    MatchCountsConfig,
    PeriodSumSettings,
    RetrievalConfig,
    TransformerSettings,
)

# TorchRec's sharding types by name (train.sharding_types; the planner's --sharding-types).
SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise", "data_parallel")

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
# Data loading, model, training, serving and the reference; the whole config.
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
class EarlyInteractionConfig:
    """Early feature interaction (sequence-modeling article, "More Feature Interaction")."""

    # Cosine similarity between each event and these representations, added as event attributes.
    cosine: List[Literal["candidate", "user"]] = field(default_factory=list)
    # These representations fed into the Transformer's self-attention as extra tokens (in the groups
    # with a Transformer).
    tokens: List[Literal["candidate", "user"]] = field(default_factory=list)


@dataclass
class SequenceEncoderConfig(LongShortSettings, DINSettings, PeriodSumSettings, TransformerSettings):
    """How one sequence group becomes features (modules/sequence.py; docs/ablations.md compares the
    choices). Each encoder's own keys are declared beside its registry entry (modules/encoders.py)."""

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
    # The candidate attentions' weights (the Transformer's and HSTU's target pooling, DIN):
    # "softmax" shares one unit of weight over the events; "sigmoid" weighs each event by its own
    # sigmoid over the group's max_length (or window), so how many events match the candidate
    # survives the pooling (DIN's paper, 4.3; HSTU drops the softmax too).
    target_weights: Literal["softmax", "sigmoid"] = "softmax"
    early_interaction: EarlyInteractionConfig = field(default_factory=EarlyInteractionConfig)
    hstu: HSTUConfig = field(default_factory=HSTUConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    counts: MatchCountsConfig = field(default_factory=MatchCountsConfig)
    # The settings of a registered encoder that declares its own (modules/encoders.py, Encoder.settings),
    # by the encoder's name: its keys under model.sequence.settings.<name>.
    settings: Dict[str, Any] = field(default_factory=dict, metadata={"value_class": registry.settings_class})

    def settings_for(self, encoder: str) -> Any:
        """The settings of ``encoder`` (registered with ``settings``): this config's, else the defaults."""
        return self.settings.get(encoder) or registry.settings_class(encoder)()


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
class IdMatchConfig:
    """One match indicator of the ranker (modules/id_match.py): whether the candidate's ``candidate``
    and ``other`` (the request's context, the user's query: any sparse feature on the same table)
    share an id."""

    # A candidate-side sparse feature.
    candidate: str = "item_topic"
    # Another sparse feature on the same table (candidate-side or user-side).
    other: str = "context_topic"


@dataclass
class ModelConfig:
    # The model: the unified ranker, or the two-tower ranker (model.two_tower).
    kind: Literal["ranker", "two_tower"] = "ranker"
    # Every sequence group's encoder; sequence_groups.<group> changes some keys for one group
    # (the unset ones are model.sequence's).
    sequence: SequenceEncoderConfig = field(default_factory=SequenceEncoderConfig)
    # Per-group encoders: sequence group name -> the keys that differ from model.sequence.
    sequence_groups: Dict[str, SequenceEncoderConfig] = field(default_factory=dict)
    # The ranker's match indicators: per pair, 1 where the two sparse features share an id, an input
    # of the cross network (an equality of two ids, which embeddings only approximate). The
    # two-tower model has none: it keeps the candidate apart from the request until its dot product.
    id_matches: List[IdMatchConfig] = field(default_factory=list)
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
    # The embedding tables' dtype as served (serve score / export / online, Predictor;
    # serve/quantize.py): fp32 as trained, or fp16 / int8 / int4 through TorchRec's quantized
    # collections (int8 and int4 row-wise: each row with its own scale and bias).
    embedding_dtype: Literal["fp32", "fp16", "int8", "int4"] = "fp32"
    # Per-table exceptions to embedding_dtype, {table: dtype}: e.g. the AUC guard's choice
    # (python -m pinads_rec.serve guard --write).
    table_dtypes: Dict[str, str] = field(default_factory=dict)


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
