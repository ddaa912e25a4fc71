"""The sharders of the embedding collections, made to run on CPU as on CUDA: row-wise bags on CPU
(``BagSharder``), and TorchRec's managed-collision sharders whose evicted rows are reset on CPU too,
reproducibly (``ManagedBagSharder`` / ``ManagedSequenceSharder``)."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.mc_embedding import (
    ManagedCollisionEmbeddingCollectionSharder,
    ShardedManagedCollisionEmbeddingCollection,
)
from torchrec.distributed.mc_embeddingbag import (
    ManagedCollisionEmbeddingBagCollectionSharder,
    ShardedManagedCollisionEmbeddingBagCollection,
)
from torchrec.distributed.types import ShardingType

from pinads_rec.managed_collision import seeded_rng


class BagSharder(EmbeddingBagCollectionSharder):
    """The stock sharder offers row-wise only on CUDA; fbgemm's CPU kernels run it correctly too."""

    def sharding_types(self, compute_device_type: str) -> List[str]:
        types = super().sharding_types(compute_device_type)
        extra = [ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value]
        return types + [t for t in extra if t not in types]


class _ReproducibleEviction:
    """An evicted slot's row starts fresh: TorchRec resets it (weights from the table's init_fn,
    optimizer state to zero). Here each table's round draws its rows with torch's RNG seeded by
    ``ManagedIds.round_seed`` (the run's seed, the table, the shard, the round's step): a resumed
    run re-initializes the rows the uninterrupted one did, whatever else drew from the global RNG
    in between (a new loader iterator does), and the global RNG is left as it was.

    TorchRec's reset goes through fbgemm's ``reset_weight_momentum``, which fbgemm 1.8 has for CUDA
    only (on CPU: "Could not run 'fbgemm::reset_weight_momentum' with arguments from the 'CPU'
    backend"). On CPU the same reset goes through the table-batched kernel's own views of its
    weights and optimizer state; on CUDA TorchRec's own path runs."""

    run_seed: int = 0  # train.seed, set by ``seed_evictions``

    def _evict(self, evictions_per_table: Dict[str, Optional[torch.Tensor]]) -> None:
        for table, slots in evictions_per_table.items():
            if slots is None or slots.numel() == 0:
                continue
            module = self._managed_collision_collection._managed_collision_modules[table]
            with seeded_rng(module.round_seed(self.run_seed), self._device):
                if self._device.type == "cuda":
                    super()._evict({table: slots})
                    continue
                kernel, index = self._table_to_tbe_and_index[table]
                index = int(index)
                init = self._embedding_module._table_name_to_config[table].init_fn
                with torch.no_grad():
                    weights = kernel.split_embedding_weights()[index]
                    weights[slots] = init(weights[slots].clone())
                    for state in kernel.get_optimizer_state()[index].values():
                        state[slots] = 0


class _ShardedManagedBags(_ReproducibleEviction, ShardedManagedCollisionEmbeddingBagCollection):
    pass


class _ShardedManagedSequences(_ReproducibleEviction, ShardedManagedCollisionEmbeddingCollection):
    pass


class ManagedBagSharder(ManagedCollisionEmbeddingBagCollectionSharder):
    """TorchRec's managed-collision EBC sharder over BagSharder (whose row-wise the CPU needs: the
    stock one lists row-wise only on CUDA, and managed collections shard row-wise only), resetting
    evicted rows on CPU too."""

    def __init__(self):
        super().__init__(ebc_sharder=BagSharder())

    def shard(self, module, params, env, device=None, module_fqn=None):
        return _ShardedManagedBags(
            module, params, ebc_sharder=self._e_sharder, mc_sharder=self._mc_sharder, env=env, device=device
        )


class ManagedSequenceSharder(ManagedCollisionEmbeddingCollectionSharder):
    """TorchRec's managed-collision EC sharder, resetting evicted rows on CPU too."""

    def shard(self, module, params, env, device=None, module_fqn=None):
        return _ShardedManagedSequences(
            module, params, ec_sharder=self._e_sharder, mc_sharder=self._mc_sharder, env=env, device=device
        )


def seed_evictions(dmp: nn.Module, seed: int) -> None:
    """Gives every managed collection of the sharded model the run's seed (train.seed) its evicted
    rows are drawn from."""
    for module in dmp.modules():
        if isinstance(module, _ReproducibleEviction):
            module.run_seed = seed


def sharders() -> list:
    return [BagSharder(), EmbeddingCollectionSharder(), ManagedBagSharder(), ManagedSequenceSharder()]
