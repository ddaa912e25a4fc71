"""Parallelism in one place: process group, planner, sharders, DistributedModelParallel, optimizers.

The models (``pinads_rec/models/``) are plain modules built on the meta device; everything that knows
about ranks, devices and sharding lives here. Which tables exist comes from the feature layout
(``pinads_rec/features.py``), not from any one model. One job a module:

- ``process_group.py``: the process group (``init_distributed``, ``Distributed``)
- ``table_sharders.py``: the collections' sharders (row-wise bags on CPU, managed-collision ones
  resetting evicted rows on CPU too, reproducibly)
- ``sharding_constraints.py``: the planner's constraints per table, the managed tables' world sizes
- ``plan_file.py``: a plan as JSON (``train.plan_file``, a checkpoint's plan)
- ``planning.py``: topology, the ordered search space, the storage reservation, ``plan_sharding``
- ``sharding.py``: ``shard``, the model in ``DistributedModelParallel``
- ``initialization.py``: the tables' parameters, a rank's pieces of one, their plan-independent init
- ``optimizers.py``: the embedding and dense optimizers and the LR schedule
"""

from pinads_rec.parallel.initialization import EMBEDDING_PARAM, init_embeddings, local_pieces
from pinads_rec.parallel.optimizers import (
    DENSE_ADAMW_KERNELS,
    attach_embedding_optimizer,
    embedding_optimizer,
    lr_multiplier,
    make_optimizer,
)
from pinads_rec.parallel.plan_file import load_plan, plan_tables
from pinads_rec.parallel.planning import (
    STORAGE_RESERVE,
    OrderedEnumerator,
    data_parallel_tables_have_no_spec,
    dense_bytes,
    ordered_enumerator,
    plan_sharding,
    storage_reservation,
    topology,
)
from pinads_rec.parallel.process_group import Distributed, init_distributed
from pinads_rec.parallel.sharding import shard
from pinads_rec.parallel.sharding_constraints import (
    CPU_DEFAULT_SHARDING,
    MANAGED_KERNELS,
    allowed_sharding_types,
    check_managed_world_size,
    constraints,
    plan_kernel_changes,
)
from pinads_rec.parallel.table_sharders import BagSharder, ManagedBagSharder, ManagedSequenceSharder, sharders

__all__ = [
    "BagSharder",
    "CPU_DEFAULT_SHARDING",
    "DENSE_ADAMW_KERNELS",
    "Distributed",
    "EMBEDDING_PARAM",
    "MANAGED_KERNELS",
    "ManagedBagSharder",
    "ManagedSequenceSharder",
    "OrderedEnumerator",
    "STORAGE_RESERVE",
    "allowed_sharding_types",
    "attach_embedding_optimizer",
    "check_managed_world_size",
    "constraints",
    "data_parallel_tables_have_no_spec",
    "dense_bytes",
    "embedding_optimizer",
    "init_distributed",
    "init_embeddings",
    "load_plan",
    "local_pieces",
    "lr_multiplier",
    "make_optimizer",
    "ordered_enumerator",
    "plan_kernel_changes",
    "plan_sharding",
    "plan_tables",
    "shard",
    "sharders",
    "storage_reservation",
    "topology",
]
