"""Planning a sharding: the cluster's topology as TorchRec's planner sees it, its search space in a
fixed order (``OrderedEnumerator``), the memory it keeps back for the dense model and the inputs
(``storage_reservation``), and ``plan_sharding``, the plan a training run uses."""

from __future__ import annotations

import logging
import os
from typing import Dict, List, Optional

import torch.distributed as dist
from torch import nn
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
from torchrec.distributed.planner.types import (
    HardwareConfig,
    KernelConfig,
    ParameterConstraints,
    ShardingOption,
    TopologyFactory,
    TrainerConfig,
)
from torchrec.distributed.types import ModuleSharder, ShardingPlan
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from pinads_rec.config import ExperimentConfig
from pinads_rec.library_notices import without_log_message, without_warning
from pinads_rec.parallel.process_group import Distributed
from pinads_rec.parallel.sharding_constraints import check_managed_world_size, constraints, plan_kernel_changes
from pinads_rec.parallel.table_sharders import sharders


class OrderedEnumerator(EmbeddingEnumerator):
    """TorchRec's EmbeddingEnumerator with a search space in a fixed order: table by table as TorchRec
    walks the model, and within a table the sharding types, then the kernels, in the sharder's order.

    TorchRec intersects the sharding types and kernels a constraint allows with the sharder's as
    Python sets, whose order follows the string-hash seed (PYTHONHASHSEED), and the planner keeps the
    first of equally rated plans (row_wise and table_row_wise on one host, for instance): without
    this the same command could print different plans. Only the public ``enumerate`` is overridden,
    reordering what TorchRec returns (its sharding options are public: fqn, module, sharding_type,
    compute_kernel); no estimate depends on the order."""

    def __init__(self, topology: Topology, batch_size: int, constraints: Optional[Dict[str, ParameterConstraints]]):
        super().__init__(topology=topology, batch_size=batch_size, constraints=constraints)
        self.compute_device = topology.compute_device

    def enumerate(self, module: nn.Module, sharders: List[ModuleSharder[nn.Module]]) -> List[ShardingOption]:
        options = super().enumerate(module, sharders)
        sharder_of = {s.module_type: s for s in sharders}
        table_index: Dict[str, int] = {}
        for option in options:
            table_index.setdefault(option.fqn, len(table_index))

        def position(option: ShardingOption) -> tuple:
            sharder = sharder_of[type(option.module[1])]
            types = sharder.sharding_types(self.compute_device)
            kernels = sharder.compute_kernels(option.sharding_type, self.compute_device)
            return table_index[option.fqn], types.index(option.sharding_type), kernels.index(option.compute_kernel)

        return sorted(options, key=position)


def ordered_enumerator(topology: Topology, batch_size: int, constraints) -> OrderedEnumerator:
    return OrderedEnumerator(topology, batch_size, constraints)


def topology(
    world_size: int,
    compute_device: str,
    local_world_size: int,
    *,
    hbm_cap: Optional[int] = None,
    ddr_cap: Optional[int] = None,
    hbm_mem_bw: Optional[float] = None,
    ddr_mem_bw: Optional[float] = None,
    intra_host_bw: Optional[float] = None,
    inter_host_bw: Optional[float] = None,
) -> Topology:
    """The planner's Topology, built by TorchRec's TopologyFactory as TorchRec asks (a Topology built
    directly logs that "the job will fail"). Memory per rank in bytes, bandwidths in bytes/ms; None:
    TorchRec's defaults, the same as a directly built Topology's."""
    return TopologyFactory.create_topology(
        trainer_config=TrainerConfig(
            world_size=world_size, local_world_size=local_world_size, hbm_cap_bytes=hbm_cap, ddr_cap_bytes=ddr_cap
        ),
        # The bandwidths are given, not detected: HardwareConfig is where the factory takes them from,
        # and only with use_hardware_based_bandwidth (TorchRec's defaults fill what is None).
        hardware_config=HardwareConfig(
            hbm_mem_bw=hbm_mem_bw, ddr_mem_bw=ddr_mem_bw, intra_host_bw=intra_host_bw, inter_host_bw=inter_host_bw
        ),
        kernel_config=KernelConfig(compute_device=compute_device, use_hardware_based_bandwidth=True),
    )


def dense_bytes(model: nn.Module) -> int:
    """The dense part's device memory as HeuristicalStorageReservation estimates it (6 x parameter
    bytes: weights, AdamW's two moments, DDP's buckets and gradients; plus buffers), over everything
    but the embedding collections. Exact on the meta device too: sizes, not values."""
    tables = {f"{n}." for n, m in model.named_modules() if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))}
    params, buffers = 0, 0
    for name, p in model.named_parameters():
        if not any(name.startswith(t) for t in tables):
            params += p.numel() * p.element_size()
    for name, b in model.named_buffers():
        if not any(name.startswith(t) for t in tables):
            buffers += b.numel() * b.element_size()
    return 6 * params + buffers


# The storage reservation (what the planner keeps back from each rank's memory before placing tables).
# TorchRec 1.8 offers HeuristicalStorageReservation (a margin of `percentage` of HBM, plus the dense
# model and the input batches: what really shares the device with the tables), deprecated with a
# FutureWarning, and FixedPercentageStorageReservation (the margin only: nothing for the dense model
# or the inputs, and nothing at all on CPU, where the margin of HBM is a margin of zero). We keep the
# heuristic one, deliberately: the FutureWarning's complaint is that it over-estimates dense tensors
# in dry runs, and it recommends passing `dense_tensor_estimate` -- which we do, computed exactly
# from the model (dense_bytes). Measured with `python -m pinads_rec.plan` (docs/reliability.md): the
# two give the same plans for configs/demo.yaml and configs/prod_8gpu.yaml on the default 8 x 80 GB,
# and differ only when memory is tight (prod_8gpu from 15.57 GB of HBM per rank down to 14.9 GB:
# the heuristic keeps 0.58 GB for dense + inputs and moves the user table to fused_uvm_caching, the
# fixed margin fills HBM with every table and leaves the dense model to the margin).
STORAGE_RESERVE = 0.15  # TorchRec's default margin


def storage_reservation(model: nn.Module, percentage: float = STORAGE_RESERVE) -> HeuristicalStorageReservation:
    # The FutureWarning is raised in __init__ whatever the arguments (see above for why it does not apply).
    with without_warning("HeuristicalStorageReservation is known to cause issues", FutureWarning):
        return HeuristicalStorageReservation(percentage=percentage, dense_tensor_estimate=dense_bytes(model))


def data_parallel_tables_have_no_spec():
    """TorchRec's planner logs "Sharding spec not found" (root logger) for every data_parallel table:
    replicated tables have no sharding spec by design, so the plan is fine. Enclose planning in it."""
    return without_log_message("root", "Sharding spec not found")


def plan_sharding(
    model: nn.Module, cfg: ExperimentConfig, env: Distributed, local_world_size: Optional[int] = None
) -> ShardingPlan:
    compute = env.device.type
    topo = topology(
        env.world_size, compute, local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
    )
    if env.is_main:  # what the planner was told about the cluster (a 2 x 1 launch: 2 hosts of 1)
        logging.getLogger("pinads_rec.parallel").info(
            "sharding plan for %d host(s) x %d %s rank(s)",
            env.world_size // topo.local_world_size,
            topo.local_world_size,
            compute,
        )
    check_managed_world_size(cfg.features, env.world_size)
    allowed = constraints(cfg.features, cfg.train, compute)
    changes = plan_kernel_changes(cfg.features, cfg.train, compute)
    if changes and env.is_main:  # a plan file is an explicit request: never changed without a word
        logging.getLogger("pinads_rec.parallel").warning(changes)
    planner = EmbeddingShardingPlanner(
        topology=topo,
        batch_size=cfg.data.batch_size,
        storage_reservation=storage_reservation(model),
        constraints=allowed,
        enumerator=ordered_enumerator(topo, cfg.data.batch_size, allowed),
        debug=False,
    )
    with data_parallel_tables_have_no_spec():
        if env.world_size > 1:
            return planner.collective_plan(model, sharders(), dist.GroupMember.WORLD)
        return planner.plan(model, sharders())
