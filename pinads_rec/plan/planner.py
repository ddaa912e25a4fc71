"""TorchRec's ``EmbeddingShardingPlanner`` run offline: the target cluster (``PlanSpec``), the
training task on the meta device as training builds it, the per-table constraints with pooling
factors, the topology, and ``plan`` -> the report (the ``--out`` JSON)."""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from pinads_rec.config import SHARDING_TYPES
from pinads_rec.plan.failure import explain_failure
from pinads_rec.plan.formats import GB, num
from pinads_rec.plan.pooling import Candidates, candidates_per_request, with_pooling_factors

STATS_LOGGER = "torchrec.distributed.planner.stats"


class PlanFailed(Exception):
    """No plan fits; the message is the readable explanation (TorchRec's error, reformatted, and
    which tables cannot be placed)."""


@dataclass
class PlanSpec:
    """Everything about the target cluster and planning that is not in the experiment config."""

    world_size: int = 8
    local_world_size: Optional[int] = None  # None: min(world_size, 8)
    compute_device: str = "cuda"
    hbm_gb: float = 80.0
    ddr_gb: float = 512.0
    batch_size: Optional[int] = None  # None: the config's data.batch_size
    hbm_bw: float = 897.0  # GB/s, TorchRec's HBM_MEM_BW
    ddr_bw: float = 51.0  # GB/s, DDR_MEM_BW
    intra_host_bw: float = 600.0  # GB/s, INTRA_NODE_BANDWIDTH
    inter_host_bw: float = 12.5  # GB/s, CROSS_NODE_BANDWIDTH
    reserve_pct: float = 15.0  # % of HBM kept back by HeuristicalStorageReservation (TorchRec's default)
    sharding_types: List[str] = field(default_factory=list)  # empty: the config's train.sharding_types
    pooling_factors: bool = True
    candidates_per_request: Optional[float] = None  # None: measured from the data (pooling.py)

    @property
    def local(self) -> int:
        return self.local_world_size or min(self.world_size, 8)

    def validate(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size must be >= 1, got {self.world_size}")
        if self.local < 1 or self.local > self.world_size:
            raise ValueError(f"local world size must be in [1, world size {self.world_size}], got {self.local}")
        if self.compute_device not in ("cuda", "cpu"):
            raise ValueError(f"compute device must be cuda or cpu, got {self.compute_device!r}")
        for name in ("hbm_gb", "ddr_gb", "hbm_bw", "ddr_bw", "intra_host_bw", "inter_host_bw"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name.replace('_', '-')} must be > 0, got {value}")
        if not 0 <= self.reserve_pct < 100:
            raise ValueError(f"reserve-pct must be in [0, 100), got {self.reserve_pct}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {self.batch_size}")
        c = self.candidates_per_request
        if c is not None and not (math.isfinite(c) and c >= 1):  # a request holds at least one candidate
            raise ValueError(f"candidates-per-request must be >= 1, got {c}")
        for t in self.sharding_types:
            if t not in SHARDING_TYPES:
                raise ValueError(f"sharding type {t!r} is not one of {list(SHARDING_TYPES)}")

    def describe(self) -> str:
        hosts = math.ceil(self.world_size / self.local)
        mem = (
            f"{num(self.hbm_gb)} GB HBM + {num(self.ddr_gb)} GB DDR"
            if self.compute_device == "cuda"
            else f"{num(self.ddr_gb)} GB DDR"
        )
        return (
            f"{hosts} host(s) x {self.local} {self.compute_device} device(s) = world size {self.world_size}, "
            f"{mem} per rank"
        )


class _Capture:
    """A TorchRec ``Stats`` that keeps what the planner hands its stats loggers: the chosen sharding
    options (or, when planning fails, the last proposal) and the enumerator."""

    def __init__(self):
        self.best_plan = None
        self.enumerator = None

    def log(
        self,
        sharding_plan,
        topology,
        batch_size,
        storage_reservation,
        num_proposals,
        num_plans,
        run_time,
        best_plan,
        constraints=None,
        sharders=None,
        enumerator=None,
        debug=False,
        debug_stats=None,
        **_,
    ):
        self.best_plan, self.enumerator = best_plan, enumerator
        self.num_proposals, self.num_plans, self.run_time = num_proposals, num_plans, run_time


@contextlib.contextmanager
def _quiet_planner(verbose: bool):
    """The planner's notice for data-parallel tables (which have no sharding spec by design) off;
    with ``verbose`` TorchRec's stats tables go to stdout."""
    from pinads_rec import parallel

    stats_logger = logging.getLogger(STATS_LOGGER)
    handler, saved = None, (stats_logger.level, stats_logger.propagate)
    if verbose:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        stats_logger.addHandler(handler)
        stats_logger.setLevel(logging.INFO)
        stats_logger.propagate = False
    try:
        with parallel.data_parallel_tables_have_no_spec():
            yield
    finally:
        if handler is not None:
            stats_logger.removeHandler(handler)
            stats_logger.setLevel(saved[0])
            stats_logger.propagate = saved[1]


def planned_task(cfg, compute_device: str):
    """The training task exactly as training shards it (``training.task.meta_train_task``: on the
    meta device), with the fused embedding optimizer attached as ``parallel.shard`` does, so the
    planner counts its state."""
    import torch

    from pinads_rec import parallel
    from pinads_rec.training.task import meta_train_task

    task = meta_train_task(cfg.features, cfg.model, cfg.train)
    parallel.attach_embedding_optimizer(task, cfg.train, torch.device(compute_device))
    return task


def table_constraints(cfg, spec: PlanSpec, batch_size: int, candidates: Optional[float] = None) -> Dict[str, object]:
    """pinads_rec.parallel.constraints() plus, with ``spec.pooling_factors``, per-feature pooling
    factors and batch sizes for ``candidates`` per request (pooling.with_pooling_factors)."""
    from pinads_rec import parallel

    out = parallel.constraints(cfg.features, cfg.train, spec.compute_device)
    if not spec.pooling_factors:
        return out
    if candidates is None:
        raise ValueError("pooling factors need the candidates per request")
    return with_pooling_factors(out, cfg.features, batch_size, candidates)


def make_topology(spec: PlanSpec):
    from pinads_rec import parallel

    to_bytes_per_ms = GB / 1000.0  # TorchRec's bandwidths are bytes per ms
    return parallel.topology(
        spec.world_size,
        spec.compute_device,
        spec.local,
        hbm_cap=int(spec.hbm_gb * GB),
        ddr_cap=int(spec.ddr_gb * GB),
        hbm_mem_bw=spec.hbm_bw * to_bytes_per_ms,
        ddr_mem_bw=spec.ddr_bw * to_bytes_per_ms,
        intra_host_bw=spec.intra_host_bw * to_bytes_per_ms,
        inter_host_bw=spec.inter_host_bw * to_bytes_per_ms,
    )


def plan(cfg, spec: PlanSpec, config_path: str = "", verbose: bool = False, constraints: Optional[dict] = None) -> dict:
    """Plans ``cfg`` for ``spec``; returns the report (JSON-able, the --out format). Raises
    PlanFailed with a readable message when no plan fits, and pooling.NoCandidates when the
    candidates per request are needed and nothing gives them. ``constraints``: the per-table
    ParameterConstraints to plan with instead of ``table_constraints`` (e.g. with pooling factors
    measured on data)."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.stats import EmbeddingStats
    from torchrec.distributed.planner.types import PlannerError

    from pinads_rec import parallel

    spec.validate()
    parallel.check_managed_world_size(cfg.features, spec.world_size)
    if spec.sharding_types:
        from pinads_rec import config as config_mod

        cfg = config_mod.from_dict(config_mod.to_dict(cfg), [f"train.sharding_types=[{','.join(spec.sharding_types)}]"])
    batch = spec.batch_size or cfg.data.batch_size
    started = time.perf_counter()
    if constraints is not None:
        candidates = Candidates(None, "constraints", "not used: the caller's per-table constraints")
    elif spec.pooling_factors:  # first: a missing dataset is said before any planning
        candidates = candidates_per_request(cfg, spec.candidates_per_request, config_path)
        constraints = table_constraints(cfg, spec, batch, candidates.value)
    else:
        candidates = Candidates(None, "unused", "not used: --no-pooling-factors")
        constraints = table_constraints(cfg, spec, batch)
    model = planned_task(cfg, spec.compute_device)
    topology = make_topology(spec)
    capture = _Capture()
    stats = [capture, EmbeddingStats()] if verbose else [capture]
    with _quiet_planner(verbose):
        reservation = parallel.storage_reservation(model, spec.reserve_pct / 100.0)
        planner = EmbeddingShardingPlanner(
            topology=topology,
            batch_size=batch,
            storage_reservation=reservation,
            enumerator=parallel.ordered_enumerator(topology, batch, constraints),
            constraints=constraints,
            stats=stats,
            debug=verbose,
        )
        sharders = parallel.sharders()
        try:
            planner.plan(model, sharders)
        except PlannerError as e:
            raise PlanFailed(explain_failure(e, spec, model, sharders, reservation, capture, batch)) from None
        except RuntimeError as e:
            if "No available sharding type" not in str(e):
                raise
            raise PlanFailed(f"no sharding type/kernel is left for a table after the constraints: {e}") from None
    seconds = time.perf_counter() - started
    return _report(
        capture.best_plan, cfg, spec, config_path, topology, reservation, batch, seconds, capture, candidates
    )


def _storage(s) -> Tuple[int, int]:
    return (int(s.hbm), int(s.ddr)) if s is not None else (0, 0)


def _reserved(reservation, spec: PlanSpec) -> dict:
    # What the reservation computed (TorchRec keeps these on the object; no public accessor).
    dense_hbm, dense_ddr = _storage(getattr(reservation, "_dense_storage", None))
    kjt_hbm, kjt_ddr = _storage(getattr(reservation, "_kjt_storage", None))
    cap = int(spec.hbm_gb * GB) if spec.compute_device == "cuda" else 0
    margin = cap - int((1 - spec.reserve_pct / 100.0) * cap)
    left = reservation.last_reserved_topology
    return {
        "policy": "HeuristicalStorageReservation",
        "percentage": spec.reserve_pct,
        "margin_hbm_bytes": margin,
        "dense_bytes": dense_hbm + dense_ddr,
        "kjt_bytes": kjt_hbm + kjt_ddr,
        "memory": "hbm" if spec.compute_device == "cuda" else "ddr",
        "reserved_hbm_bytes": margin + dense_hbm + kjt_hbm,
        "reserved_ddr_bytes": dense_ddr + kjt_ddr,
        "available_hbm_bytes": int(left.devices[0].storage.hbm) if left is not None else None,
        "available_ddr_bytes": int(left.devices[0].storage.ddr) if left is not None else None,
    }


def _report(
    best_plan, cfg, spec: PlanSpec, config_path, topology, reservation, batch, seconds, capture, candidates: Candidates
) -> dict:
    from pinads_rec import parallel
    from pinads_rec.managed_collision import id_map_bytes

    reserved = _reserved(reservation, spec)
    in_use_hbm = reserved["reserved_hbm_bytes"] - reserved["margin_hbm_bytes"]  # dense + KJT, really used
    in_use_ddr = reserved["reserved_ddr_bytes"]
    order = {t.name: i for i, t in enumerate(cfg.features.tables)}
    tables: Dict[str, dict] = {}
    perf_keys = ("fwd_compute", "fwd_comms", "bwd_compute", "bwd_comms", "prefetch_compute")
    ranks = [
        {
            "rank": r,
            "host": r // spec.local,
            "hbm_bytes": 0,
            "ddr_bytes": 0,
            "shards": 0,
            **{k: 0.0 for k in perf_keys},
            "input_dist_comms": 0.0,  # TorchRec's Perf.total leaves it out; kept apart
        }
        for r in range(spec.world_size)
    ]
    for so in sorted(best_plan, key=lambda so: order.get(so.name, len(order))):
        rows, dim = (int(x) for x in so.tensor.shape)
        hbm = sum(int(s.storage.hbm) for s in so.shards)
        ddr = sum(int(s.storage.ddr) for s in so.shards)
        tables[so.name] = {
            "sharding_type": so.sharding_type,
            "compute_kernel": so.compute_kernel,
            "ranks": [int(s.rank) for s in so.shards],
            "shards": [
                [int(s.offset[0]), int(s.offset[1]), int(s.size[0]), int(s.size[1]), int(s.rank)] for s in so.shards
            ],
            "module": so.path,
            "num_embeddings": rows,
            "embedding_dim": dim,
            "weight_bytes": rows * dim * so.tensor.element_size(),
            "hbm_bytes": hbm,
            "ddr_bytes": ddr,
            "cost_ms": sum(s.perf.total for s in so.shards),
        }
        managed = cfg.features.table(so.name).managed_collision if so.name in order else None
        if managed is not None:
            tables[so.name]["managed_collision"] = {
                "eviction": managed.eviction,
                "eviction_interval": managed.eviction_interval,
                "admission": managed.admission.kind,
                "id_map_bytes": id_map_bytes(cfg.features.table(so.name)),
            }
        for s in so.shards:
            r = ranks[s.rank]
            r["hbm_bytes"] += int(s.storage.hbm)
            r["ddr_bytes"] += int(s.storage.ddr)
            r["shards"] += 1
            for k in perf_keys:
                r[k] += getattr(s.perf, k)
            r["input_dist_comms"] += s.perf.input_dist_comms
    for r in ranks:
        r["total"] = sum(r[k] for k in perf_keys)
        r["hbm_total_bytes"] = r["hbm_bytes"] + in_use_hbm
        r["ddr_total_bytes"] = r["ddr_bytes"] + in_use_ddr
    slowest = max(ranks, key=lambda r: r["total"])
    critical = {"rank": slowest["rank"], "total_ms": slowest["total"], **{f"{k}_ms": slowest[k] for k in perf_keys}}
    try:  # TorchRec's own estimate, with a synchronization point per module x sharding type
        from torchrec.distributed.planner.stats import _calculate_critical_path

        cp = _calculate_critical_path(best_plan)
        critical["torchrec_sync_estimate_ms"] = {
            "comms": cp.comms_estimate,
            "compute": cp.comp_estimate,
            "total": cp.total(),
        }
    except Exception:  # a private helper: optional
        pass
    return {
        "tables": tables,
        "topology": {
            "world_size": spec.world_size,
            "local_world_size": spec.local,
            "compute_device": spec.compute_device,
            "hbm_cap_bytes": int(topology.devices[0].storage.hbm),
            "ddr_cap_bytes": int(topology.devices[0].storage.ddr),
            "hbm_gb": spec.hbm_gb,
            "ddr_gb": spec.ddr_gb,
            "hbm_bw_gbps": spec.hbm_bw,
            "ddr_bw_gbps": spec.ddr_bw,
            "intra_host_bw_gbps": spec.intra_host_bw,
            "inter_host_bw_gbps": spec.inter_host_bw,
        },
        "config": config_path,
        "batch_size": batch,
        "sharding_types": parallel.allowed_sharding_types(cfg.train, spec.compute_device),
        "pooling_factors": spec.pooling_factors,
        "candidates_per_request": candidates.as_dict(),
        "storage_reservation": reserved,
        "per_rank": ranks,
        "critical_path": critical,
        "planner": {
            "proposals": getattr(capture, "num_proposals", None),
            "plans": getattr(capture, "num_plans", None),
            "seconds": seconds,
        },
    }
