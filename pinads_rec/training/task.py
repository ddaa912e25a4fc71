"""The training task the trainer trains: the model with its training precision and non-finite
guard built on the meta device (:func:`meta_train_task`, which the offline planner plans too), then
sharded by DistributedModelParallel (:func:`shard_train_task`), and which of its sharded modules the
training pipeline overlaps (:func:`pipelined_module_names`)."""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist
from torchrec.distributed.types import ShardingPlan

from pinads_rec import config, parallel
from pinads_rec.models import build_model
from pinads_rec.models.train_task import NonFiniteGuard, TrainTask
from pinads_rec.modules.precision import set_precision


def meta_train_task(
    features: config.FeaturesConfig,
    model: config.ModelConfig,
    train: config.TrainConfig,
    group: Optional[dist.ProcessGroup] = None,
) -> TrainTask:
    """The training task before sharding -- the model (embedding tables on the meta device), its
    training precision and the non-finite guard (``group``, gloo, lets its ranks agree) -- what
    ``shard_train_task`` shards and the offline planner (``pinads_rec.plan``) plans."""
    torch.manual_seed(train.seed)
    # Embedding tables are created on the meta device: DMP allocates each rank's shards only.
    net = build_model(features, model, device=torch.device("meta"))
    set_precision(net, model.precision.train, fp16_overflow=model.precision.fp16_overflow)
    return TrainTask(net, NonFiniteGuard([t.name for t in features.tasks], train.nonfinite, group))


def shard_train_task(
    cfg: config.ExperimentConfig,
    env: parallel.Distributed,
    plan: Optional[ShardingPlan] = None,
    group: Optional[dist.ProcessGroup] = None,
):
    """The model of ``cfg`` in a TrainTask (``meta_train_task``), sharded (DistributedModelParallel);
    ``group`` (gloo) lets the non-finite guard's ranks agree."""
    return parallel.shard(meta_train_task(cfg.features, cfg.model, cfg.train, group), cfg, env, plan)


def pipelined_module_names(dmp, pipeline) -> List[str]:
    """Sharded modules whose input distribution the pipeline really overlaps (it silently skips
    modules whose inputs it cannot trace back to the batch)."""
    chosen = {id(m) for m in pipeline._pipelined_modules}
    return [name for name, m in dmp.named_modules() if id(m) in chosen]
