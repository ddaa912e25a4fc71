"""The model sharded: the fused embedding optimizers attached, the plan made (or given), the model
wrapped in TorchRec's ``DistributedModelParallel``, every table initialized from the seed alone."""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardingEnv, ShardingPlan

from pinads_rec.config import ExperimentConfig
from pinads_rec.library_notices import without_warning
from pinads_rec.parallel.initialization import init_embeddings
from pinads_rec.parallel.optimizers import attach_embedding_optimizer
from pinads_rec.parallel.planning import plan_sharding
from pinads_rec.parallel.process_group import Distributed
from pinads_rec.parallel.table_sharders import seed_evictions, sharders


def shard(
    model: nn.Module, cfg: ExperimentConfig, env: Distributed, plan: Optional[ShardingPlan] = None
) -> DistributedModelParallel:
    """Fused embedding optimizers are attached first, so the sharded tables update inside backward;
    then every table is initialized from the seed alone, so the model does not depend on the plan."""
    attach_embedding_optimizer(model, cfg.train, env.device)
    plan = plan or plan_sharding(model, cfg, env)
    group = dist.GroupMember.WORLD
    # output_dtensor: the sharded tables' state (weights, fused optimizer state) comes out as DTensor,
    # which torch asks for instead of the deprecated ShardedTensor (ShardingEnv.from_process_group
    # has no such flag).
    sharding_env = ShardingEnv(dist.get_world_size(group), dist.get_rank(group), group, output_dtensor=True)
    # TorchRec 1.8's DefaultDataParallelWrapper passes DDP broadcast_buffers=False, which torch now
    # deprecates; its replacement (forward_sync_buffers=False) would also sync buffers at init, and
    # TorchRec has no option to pass it instead. Nothing of ours to change: silence that one message.
    with without_warning("`broadcast_buffers` is deprecated", FutureWarning):
        dmp = DistributedModelParallel(
            module=model, env=sharding_env, device=env.device, plan=plan, sharders=sharders()
        )
    init_embeddings(dmp, cfg.train.seed)
    seed_evictions(dmp, cfg.train.seed)
    return dmp
