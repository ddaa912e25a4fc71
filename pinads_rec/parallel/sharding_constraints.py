"""The planner's constraints: per table, the sharding types (``train.sharding_types``, the CPU
default, a managed collection's row-wise) and kernels (a ``train.plan_file``'s) the device can run,
and the world sizes a managed-collision table shards over."""

from __future__ import annotations

from typing import Dict, List

from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ShardingType

from pinads_rec.config import FeaturesConfig, TrainConfig
from pinads_rec.features import FeatureLayout
from pinads_rec.managed_collision import PLANNING_BUCKETS
from pinads_rec.parallel.plan_file import load_plan

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
