"""The scaling sweep's GPU projection: TorchRec's planner (``pinads_rec.plan.plan``) plans the
base model for 8..128 GPUs (H100-class: compute_device cuda, 80 GiB HBM, 8 GPUs per host) with the
ids per example of every feature measured on the generated data as pooling factors
(``pinads_rec.plan.measured_pooling``).

``project(cfg, gpus, pooling)`` -> one row per GPU count (``PROJECTION_COLUMNS``): the critical path
(the rank with the largest summed ``perf.total`` of its shards) per step at the per-rank batch, its
parts, and the embedding-only examples/s it implies. This is TorchRec's cost model: embedding
lookups and their comms only; no dense compute, no data loading.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Optional, Tuple

from pinads_rec import config, parallel, plan
from pinads_rec.features import FeatureLayout

DEFAULT_GPUS = (8, 16, 32, 64, 128)
HBM_GB = 80.0
DDR_GB = 128.0  # TorchRec's Topology default (DDR_CAP)

PROJECTION_COLUMNS = [
    "gpus",
    "table_rows",
    "batch_size_per_rank",
    "critical_path_ms",
    "critical_rank",
    "fwd_compute_ms",
    "fwd_comms_ms",
    "bwd_compute_ms",
    "bwd_comms_ms",
    "input_dist_ms",
    "mean_rank_ms",
    "embedding_examples_per_s",
    "hbm_gib_max",
    "sharding",
]


def measured_constraints(
    cfg: config.ExperimentConfig, spec: plan.PlanSpec, pooling: Dict[str, Tuple[float, float]]
) -> Dict[str, object]:
    """Training's per-table constraints with the measured pooling factors and batch sizes per feature."""
    batch = spec.batch_size or cfg.data.batch_size
    constraints = parallel.constraints(cfg.features, cfg.train, spec.compute_device)
    for table in FeatureLayout.of(cfg.features).all_table_configs():
        measured = [pooling.get(name, (1.0, 1.0)) for name in table.feature_names]
        constraints[table.name] = dataclasses.replace(
            constraints[table.name],
            pooling_factors=[max(f, 1e-3) for f, _ in measured],
            batch_sizes=[max(1, round(batch * r)) for _, r in measured],
        )
    return constraints


def gpu_spec(gpus: int) -> plan.PlanSpec:
    return plan.PlanSpec(
        world_size=gpus, local_world_size=min(8, gpus), compute_device="cuda", hbm_gb=HBM_GB, ddr_gb=DDR_GB
    )


def projection_row(report: dict, table_rows: Optional[int]) -> dict:
    """One CSV row from ``plan.plan``'s report."""
    ranks = report["per_rank"]
    c = ranks[report["critical_path"]["rank"]]
    kinds: Dict[str, List[str]] = {}
    for name, t in report["tables"].items():
        kinds.setdefault(t["sharding_type"], []).append(name)
    batch = report["batch_size"]
    return {
        "gpus": len(ranks),
        "table_rows": table_rows if table_rows is not None else "",
        "batch_size_per_rank": batch,
        "critical_path_ms": c["total"],
        "critical_rank": c["rank"],
        "fwd_compute_ms": c["fwd_compute"],
        "fwd_comms_ms": c["fwd_comms"],
        "bwd_compute_ms": c["bwd_compute"],
        "bwd_comms_ms": c["bwd_comms"],
        "input_dist_ms": c["input_dist_comms"],
        "mean_rank_ms": sum(r["total"] for r in ranks) / len(ranks),
        "embedding_examples_per_s": len(ranks) * batch / (c["total"] / 1000.0) if c["total"] > 0 else float("inf"),
        "hbm_gib_max": max(r["hbm_bytes"] for r in ranks) / 2**30,
        "sharding": " ".join(f"{k}:{'+'.join(sorted(v))}" for k, v in sorted(kinds.items())),
    }


def project(
    cfg: config.ExperimentConfig,
    gpus: Iterable[int],
    pooling: Optional[Dict[str, Tuple[float, float]]] = None,
    table_rows: Optional[int] = None,
) -> List[dict]:
    """Per GPU count: the planner's estimate of one step's critical path at the per-rank batch
    (``pooling``: measured_pooling's factors; None: TorchRec's default of one id per table and row)."""
    out = []
    for n in gpus:
        spec = gpu_spec(n)
        if pooling:
            report = plan.plan(cfg, spec, constraints=measured_constraints(cfg, spec, pooling))
        else:
            report = plan.plan(cfg, dataclasses.replace(spec, pooling_factors=False))
        out.append(projection_row(report, table_rows))
    return out
