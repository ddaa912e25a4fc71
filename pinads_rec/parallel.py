"""Parallelism in one place: process group, planner, sharders, DistributedModelParallel, optimizers.

The models (``pinads_rec/models/``) are plain modules built on the meta device; everything that knows
about ranks, devices and sharding lives here. Which tables exist comes from the feature layout
(``pinads_rec/features.py``), not from any one model.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import zlib
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
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
from torchrec.distributed.model_parallel import DistributedModelParallel
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
from torchrec.distributed.types import ModuleSharder, ShardingEnv, ShardingPlan, ShardingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from pinads_rec.config import ConfigError, ExperimentConfig, FeaturesConfig, TrainConfig
from pinads_rec.features import FeatureLayout
from pinads_rec.library_notices import without_log_message, without_warning
from pinads_rec.managed_collision import seeded_rng


@dataclass
class Distributed:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(timeout_s: float = 600.0) -> Distributed:
    """Joins the process group torchrun/TorchX set up (env://): NCCL with CUDA, gloo without.
    Without a launcher it runs as a world of one. ``timeout_s`` (train.collective_timeout_s): how
    long a collective waits for the other ranks before it fails (gloo: raises on the waiting rank;
    NCCL: the watchdog ends the process)."""
    if torch.cuda.is_available():
        backend = "nccl"
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # NCCL collectives are asynchronous: the group's timeout is enforced by its watchdog thread,
        # which on a timeout aborts the communicators and tears the process down when async error
        # handling is on (torch's default, 3; 1 also cleans up) -- torchrun then stops the other
        # ranks. Its log names the rank, the collective and the timeout; the step is the one after
        # the last logged. With 0 a timed-out collective would never end the job: say so.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        if os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0":
            logging.getLogger("pinads_rec.parallel").warning(
                "TORCH_NCCL_ASYNC_ERROR_HANDLING=0: a collective that times out (train.collective_timeout_s "
                "%g s) will not end the job; unset it (torch's default 3) or set 1",
                timeout_s,
            )
    else:
        backend, local_rank, device = "gloo", int(os.environ.get("LOCAL_RANK", 0)), torch.device("cpu")
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
            rdzv = os.environ.get("PINADS_RDZV_FILE", f"/tmp/pinads_rec_single_rdzv_{os.getpid()}")
            init = f"file://{os.path.abspath(rdzv)}"
            dist.init_process_group(
                backend, init_method=init, rank=0, world_size=1, timeout=datetime.timedelta(seconds=timeout_s)
            )
        else:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return Distributed(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


# --- sharding --------------------------------------------------------------------------------


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

    run_seed: int = 0  # train.seed, set by ``shard``

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


def sharders() -> list:
    return [BagSharder(), EmbeddingCollectionSharder(), ManagedBagSharder(), ManagedSequenceSharder()]


# Without a configured choice, CPU (gloo) ranks shard every table table-wise. Each sharding type in a
# module brings its own input and output collectives, and on gloo a collective between computations
# costs ~0.8 ms of thread hand-offs whatever its size (benchmarks/collective_latency.py) -- a cost the
# planner's bandwidth model does not see, so it mixes row- and table-wise in both bag collections.
# One type per module measured 1.14-1.41x (no-sequence model) and 1.05-1.07x (full model) the
# planner's mix on 2 ranks (docs/performance.md).
CPU_DEFAULT_SHARDING = (ShardingType.TABLE_WISE.value,)


def allowed_sharding_types(train: TrainConfig, compute_device: str) -> List[str]:
    """The sharding types train.sharding_types allows (before per-table device limits); empty: all."""
    return list(train.sharding_types or (CPU_DEFAULT_SHARDING if compute_device != "cuda" else ()))


def constraints(features: FeaturesConfig, train: TrainConfig, compute_device: str) -> Dict[str, ParameterConstraints]:
    """Per-table allowed sharding types: the config's choice (on CPU without one, table-wise), minus what
    the device cannot run."""
    bag = {
        ShardingType.DATA_PARALLEL.value,
        ShardingType.TABLE_WISE.value,
        ShardingType.COLUMN_WISE.value,
        ShardingType.TABLE_COLUMN_WISE.value,
        ShardingType.ROW_WISE.value,
        ShardingType.TABLE_ROW_WISE.value,
    }
    seq = {ShardingType.TABLE_WISE.value, ShardingType.COLUMN_WISE.value, ShardingType.ROW_WISE.value}
    if compute_device == "cuda":
        seq.add(ShardingType.DATA_PARALLEL.value)
    # On CPU an EmbeddingCollection table planned data_parallel crashes in forward: never plan it.
    wanted = set(allowed_sharding_types(train, compute_device))
    saved = load_plan(train.plan_file)["tables"] if train.plan_file else {}
    out = {}
    layout = FeatureLayout.of(features)
    collections = [layout.embedding_bag_configs(), layout.embedding_bag_configs(user_side=True)]
    collections = [(tables, bag) for tables in collections] + [(layout.embedding_configs(), seq)]
    for tables, allowed in collections:
        managed = [t.name for t in tables if t.name in layout.managed_tables]
        if managed:
            out.update(_managed_constraints(tables, managed, train, compute_device, saved))
            continue
        for t in tables:
            if t.name in saved:
                choice = saved[t.name]
                if choice["sharding_type"] not in allowed:
                    raise ValueError(
                        f"train.plan_file {train.plan_file}: table {t.name!r} is planned "
                        f"{choice['sharding_type']}, which {compute_device} cannot run"
                    )
                out[t.name] = ParameterConstraints(
                    sharding_types=[choice["sharding_type"]],
                    compute_kernels=[_kernel_for(choice["compute_kernel"], compute_device)],
                )
                continue
            types = sorted(allowed & wanted) if wanted else sorted(allowed)
            if not types:
                raise ValueError(
                    f"train.sharding_types {sorted(wanted)} leaves table {t.name!r} no sharding "
                    f"type it can use on {compute_device} (allowed: {sorted(allowed)})"
                )
            out[t.name] = ParameterConstraints(sharding_types=types)
    return out


# The kernels a managed collection's tables may use: TorchRec's managed sharders list fused, UVM and
# key-value ones; UVM needs CUDA, and the key-value store is not what these tables are.
MANAGED_KERNELS = {"cuda": ["fused", "fused_uvm_caching", "fused_uvm"], "cpu": ["fused"]}


def _managed_constraints(
    tables: list, managed: List[str], train: TrainConfig, compute_device: str, saved: dict
) -> Dict[str, ParameterConstraints]:
    """The tables of a managed-collision collection (``managed``: the ones asking for it; the others
    pass their ids through): row-wise, the one sharding TorchRec's managed collections have, whatever
    the CPU default; a configured choice without it is refused."""
    names = [t.name for t in tables]
    row_wise = ShardingType.ROW_WISE.value
    if train.sharding_types and row_wise not in train.sharding_types:
        raise ValueError(
            f"train.sharding_types {list(train.sharding_types)}: tables {names} are one managed-collision "
            f"collection (managed_collision on {managed}), which TorchRec shards row_wise only; add row_wise"
        )
    for name in names:
        if name in saved and saved[name]["sharding_type"] != row_wise:
            raise ValueError(
                f"train.plan_file {train.plan_file}: table {name!r} is planned {saved[name]['sharding_type']}, "
                f"but it is in a managed-collision collection (managed_collision on {managed}): row_wise only"
            )
    kernels = MANAGED_KERNELS["cuda" if compute_device == "cuda" else "cpu"]
    out = {}
    for name in names:
        # A planned table keeps its kernel, as every other planned table does (on CPU a UVM kernel
        # runs as fused: plan_kernel_changes says so); one a managed table cannot run is refused.
        planned = saved[name]["compute_kernel"] if name in saved else None
        if planned is not None and _kernel_for(planned, compute_device) not in kernels:
            raise ValueError(
                f"train.plan_file {train.plan_file}: table {name!r} is planned with the {planned} kernel, but it is "
                f"in a managed-collision collection (managed_collision on {managed}), which runs "
                f"{' or '.join(kernels)} on {compute_device}"
            )
        chosen = [_kernel_for(planned, compute_device)] if planned is not None else kernels
        out[name] = ParameterConstraints(sharding_types=[row_wise], compute_kernels=chosen)
    return out


def check_managed_world_size(features: FeaturesConfig, world_size: int) -> None:
    """TorchRec's planner requires a managed table's buckets to divide evenly over the ranks."""
    from pinads_rec.managed_collision import PLANNING_BUCKETS

    managed = [t.name for t in features.tables if t.managed_collision is not None]
    if managed and PLANNING_BUCKETS % world_size:
        raise ValueError(
            f"world size {world_size}: managed-collision tables {managed} shard over world sizes dividing "
            f"{PLANNING_BUCKETS:,} (2^10 x 3^2 x 5 x 7: 1-10, 12, 14-16, 18, 20, 21, 24, 28, 30, 32 ... 1024)"
        )
    slots = {t.name: t.num_embeddings for t in features.tables if t.managed_collision is not None}
    small = [n for n, rows in slots.items() if rows < 2 * world_size]
    if small:
        raise ValueError(
            f"managed-collision tables {small}: each of the {world_size} ranks needs 2 slots or more of them "
            "(one is its unknown row); raise num_embeddings"
        )


def load_plan(path: str) -> dict:
    """A plan JSON written by pinads_rec.plan: {"tables": {name: {"sharding_type", "compute_kernel",
    "ranks", ...}}, "topology": {...}}. A ConfigError names the key when it cannot be read."""
    try:
        with open(path) as f:
            plan = json.load(f)
    except OSError as e:
        raise ConfigError(f"train.plan_file: cannot read {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"train.plan_file: cannot read {path}: not JSON ({e})") from None
    if not isinstance(plan, dict) or not isinstance(plan.get("tables"), dict):
        raise ConfigError(f"train.plan_file: {path} is not a plan written by pinads_rec.plan (no 'tables')")
    return plan


def plan_tables(plan: ShardingPlan) -> dict:
    """The per-table part of a plan in load_plan's format (table -> type, kernel, ranks)."""
    tables = {}
    for module in plan.plan.values():
        for param, sharding in module.items():
            tables[param] = {
                "sharding_type": sharding.sharding_type,
                "compute_kernel": sharding.compute_kernel,
                "ranks": list(sharding.ranks or []),
            }
    return {"tables": tables}


def _kernel_for(kernel: str, compute_device: str) -> str:
    # A plan made for GPUs names fused (HBM) kernels; on CPU the same "fused" kernel runs from DDR.
    if compute_device != "cuda" and kernel in ("fused_uvm", "fused_uvm_caching"):
        return "fused"
    return kernel


def plan_kernel_changes(features: FeaturesConfig, train: TrainConfig, compute_device: str) -> str:
    """'' when every table of train.plan_file runs the kernel planned on ``compute_device``; else one
    line naming each table that does not, the kernel planned, the one run and why (a plan for GPUs
    run on CPU: a UVM kernel keeps its table in CUDA's unified memory, which a CPU has not)."""
    if not train.plan_file:
        return ""
    names = {t.name for t in features.tables}
    planned = {n: t["compute_kernel"] for n, t in load_plan(train.plan_file)["tables"].items() if n in names}
    changed = [
        f"{n} {k} -> {_kernel_for(k, compute_device)}"
        for n, k in sorted(planned.items())
        if _kernel_for(k, compute_device) != k
    ]
    if not changed:
        return ""
    return (
        f"train.plan_file {train.plan_file}: {len(changed)} table(s) run another kernel than planned on "
        f"{compute_device} ({', '.join(changed)}): UVM kernels need CUDA's unified memory; fused runs from "
        "host memory"
    )


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
    for module in dmp.modules():
        if isinstance(module, _ReproducibleEviction):
            module.run_seed = cfg.train.seed
    return dmp


EMBEDDING_PARAM = (".embedding_bags.", ".embeddings.")  # parameter names of EBC / EC tables
_INIT_BLOCK_ROWS = 4096


def local_pieces(weight: torch.Tensor) -> list:
    """This rank's pieces of a table in a DMP state dict, as (global (row, col) offset, (rows, cols),
    the tensor holding them): a DTensor's local shards (TorchRec keeps a rank's shards of a table in
    a LocalShardsWrapper, with global offsets; none on a rank that holds no shard), a ShardedTensor's
    (checkpoints and modules made before DTensor output), or the whole of a replicated table."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(weight, DTensor):
        local = weight.to_local()
        return [
            (tuple(o), tuple(z), t) for o, z, t in zip(local.local_offsets(), local.local_sizes(), local.local_shards())
        ]
    if isinstance(weight, ShardedTensor):
        return [(s.metadata.shard_offsets, s.metadata.shard_sizes, s.tensor) for s in weight.local_shards()]
    return [((0, 0), tuple(weight.shape), weight)]  # replicated (data_parallel)


@torch.no_grad()
def init_embeddings(dmp: nn.Module, seed: int) -> None:
    """Uniform(+-1/sqrt(rows)) like TorchRec's default, but drawn per block of rows from
    (seed, table, block): a row's initial value is the same under every sharding plan and world size
    (table-, row-, column-wise or replicated), which makes plans comparable step for step."""
    for name, weight in dmp.state_dict().items():
        if not any(p in name for p in EMBEDDING_PARAM):
            continue
        rows, cols = weight.shape
        bound = rows**-0.5
        for (r0, c0), (h, w), out in local_pieces(weight):
            if h == 0:
                continue
            for block in range(r0 // _INIT_BLOCK_ROWS, (r0 + h - 1) // _INIT_BLOCK_ROWS + 1):
                g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}/{block}".encode()))
                start = block * _INIT_BLOCK_ROWS
                values = torch.empty(min(_INIT_BLOCK_ROWS, rows - start), cols).uniform_(-bound, bound, generator=g)
                lo, hi = max(r0, start), min(r0 + h, start + values.shape[0])
                out[lo - r0 : hi - r0].copy_(values[lo - start : hi - start, c0 : c0 + w])


def embedding_optimizer(train: TrainConfig, device: torch.device):
    """(optimizer class, kwargs) for embedding tables, whichever way they are sharded."""
    kind = train.embedding_optimizer
    if kind == "adam" and device.type != "cuda":
        raise ValueError("train.embedding_optimizer: adam is CUDA-only in fbgemm; use rowwise_adagrad on CPU")
    return {
        "rowwise_adagrad": (RowWiseAdagrad, {"lr": train.embedding_lr, "eps": 1e-8}),
        "adagrad": (torch.optim.Adagrad, {"lr": train.embedding_lr, "eps": 1e-8}),
        "sgd": (torch.optim.SGD, {"lr": train.embedding_lr}),
        "adam": (torch.optim.Adam, {"lr": train.embedding_lr}),
    }[kind]


def attach_embedding_optimizer(model: nn.Module, train: TrainConfig, device: torch.device) -> None:
    optim_cls, kwargs = embedding_optimizer(train, device)
    for module in model.modules():
        if isinstance(module, (EmbeddingBagCollection, EmbeddingCollection)):
            apply_optimizer_in_backward(optim_cls, module.parameters(), kwargs)


# torch.optim.AdamW's implementations, by train.dense_optimizer_kernel: one fused kernel, one
# multi-tensor (foreach) kernel per operation, or a Python loop over the parameters.
DENSE_ADAMW_KERNELS = {
    "fused": {"fused": True},
    "foreach": {"fused": False, "foreach": True},
    "for_loop": {"fused": False, "foreach": False},
}


def make_optimizer(dmp: DistributedModelParallel, train: TrainConfig, total_steps: int):
    """AdamW for the dense layers (its kernel: train.dense_optimizer_kernel); the embedding optimizer
    for every table -- fused into backward for sharded tables, and a plain optimizer of the same kind
    for replicated (data_parallel) ones, so a table trains the same whichever way it is sharded. The
    LR schedule (linear warm-up, then linear decay to final_lr_ratio) applies to the dense layers."""
    unfused = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    tables = {k: v for k, v in unfused.items() if any(p in k for p in EMBEDDING_PARAM)}
    layers = {k: v for k, v in unfused.items() if k not in tables}
    kernel = DENSE_ADAMW_KERNELS[train.dense_optimizer_kernel]
    dense = KeyedOptimizerWrapper(
        layers, lambda params: torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay, **kernel)
    )
    parts = [("dense", dense), ("sparse", dmp.fused_optimizer)]
    if tables:
        optim_cls, kwargs = embedding_optimizer(train, next(iter(tables.values())).device)
        parts.append(("replicated_tables", KeyedOptimizerWrapper(tables, lambda p: optim_cls(p, **kwargs))))
    optimizer = CombinedOptimizer(parts)
    schedule = torch.optim.lr_scheduler.LambdaLR(dense, lr_lambda=lr_multiplier(train, total_steps))
    return optimizer, schedule


def lr_multiplier(train: TrainConfig, total_steps: int):
    warmup, final = train.warmup_steps, train.final_lr_ratio

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        span = max(total_steps - warmup, 1)
        return 1.0 - (1.0 - final) * min(max(step - warmup, 0) / span, 1.0)

    return f


def all_reduce_int(value: int, op=dist.ReduceOp.MIN) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=op)
    return int(t.item())
