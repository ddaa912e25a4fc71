"""Sharding-plan inspection: run TorchRec's planner offline for a target cluster and print the plan.

    python -m pinads_rec.plan --config configs/prod_8gpu.yaml --world-size 16 --local-world-size 8 \\
        --hbm-gb 80 --ddr-gb 512 --batch-size 4096 [--out plan.json]

The model of ``--config`` is built on the meta device (no weights are allocated) and TorchRec's
``EmbeddingShardingPlanner`` plans it for the topology given on the command line, in this plain
process: no process group, no GPU. The sharders and per-table constraints are the ones training
uses (``pinads_rec.parallel.sharders()`` / ``constraints()``, so ``train.sharding_types`` and
``train.plan_file`` apply), and the embedding optimizer is attached first, as in training, so its
state counts. The printout has:

* each table: rows x dim, fp32 weight size, the planned HBM/DDR (weights + optimizer state),
  sharding type, compute kernel and ranks;
* each rank: HBM/DDR used (embedding shards + what the storage reservation holds for the dense
  model and the input batches) and the planner's per-step estimates in ms: forward/backward
  compute and comms, prefetch, total;
* the critical path: the slowest rank and its total (plus TorchRec's synchronized estimate);
* the storage reservation: ``HeuristicalStorageReservation(percentage)``'s margin, dense and
  input (KJT) reservations per rank -- the one training plans with
  (``pinads_rec.parallel.storage_reservation``, whose comment says why this one).

When nothing fits the planner's error is printed readably, with the tables' smallest possible
footprints against what the ranks have, and the command exits with status 1 (no traceback).

Topology and planning options (GB = 2^30 bytes and GB/s = 2^30 bytes/s, as TorchRec counts):

  --world-size N, --local-world-size N   devices in all / per host (default 8 / min(world, 8))
  --compute-device {cuda,cpu}             the devices planned for (default cuda)
  --hbm-gb, --ddr-gb                      memory per rank (default 80 / 512)
  --batch-size N                          per-rank batch (default data.batch_size)
  --hbm-bw, --ddr-bw                      memory bandwidths, GB/s (default 897 / 51)
  --intra-host-bw, --inter-host-bw        comms bandwidths per rank, GB/s (default 600 / 12.5)
  --reserve-pct P                         storage reservation margin, % of HBM (default 15)
  --sharding-types a,b                    allowed sharding types (= --set train.sharding_types=[a,b])
  --set key.path=value                    any config override (repeatable)
  --no-pooling-factors                    plan with TorchRec's default of one lookup per table and
                                          row, instead of the config's sequence lengths (below)

Pooling factors: a sequence table is looked up ``max_length`` times per *request* for each
sequence feature using it (the EmbeddingCollection input has one row per request, about
``batch / synth.candidates_per_request`` of them), and a candidate feature sharing it once per
row; pooled features once per row. These go to the planner as per-feature pooling factors and
batch sizes, so sequence tables weigh what they cost.

Outputs:

  --out plan.json    the plan as JSON, read by ``train.plan_file`` (``pinads_rec.parallel.load_plan``):
                     {"tables": {name: {"sharding_type", "compute_kernel", "ranks",
                     "shards": [[row_off, col_off, rows, cols, rank], ...], ...}}, "topology": {...},
                     "config": path, "per_rank": [...], "critical_path": {...}, ...}.
                     Train with it: ``--set train.plan_file=plan.json`` (each table keeps its sharding
                     type and kernel; on CPU fused_uvm* kernels become fused).
  --verbose          also print TorchRec's own stats tables (logger torchrec.distributed.planner.stats).

Comparing: ``--compare FIELD=VALUE[,FIELD=VALUE...]`` plans a second topology that differs in the
given fields (the option names above with underscores: world_size, local_world_size,
compute_device, hbm_gb, ddr_gb, batch_size, hbm_bw, ddr_bw, intra_host_bw, inter_host_bw,
reserve_pct, sharding_types, pooling_factors), e.g. ``--compare world_size=8,local_world_size=8``;
``--compare-config other.yaml`` plans another config (both may be given; ``--set`` applies to both).
Both summaries are printed, then a side-by-side table per rank and per table of what changed.
``--out`` saves the first plan. The exit status is 1 when either plan does not fit.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import re
import sys
import textwrap
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from pinads_rec.config import SHARDING_TYPES, split_overrides

GB = 1024**3  # TorchRec's planner counts GB as GiB (its HBM_CAP is 32 * 1024**3 "32 GB")
DEFAULT_CONFIG = "configs/demo.yaml"
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
        for t in self.sharding_types:
            if t not in SHARDING_TYPES:
                raise ValueError(f"sharding type {t!r} is not one of {list(SHARDING_TYPES)}")

    def describe(self) -> str:
        hosts = math.ceil(self.world_size / self.local)
        mem = (
            f"{_num(self.hbm_gb)} GB HBM + {_num(self.ddr_gb)} GB DDR"
            if self.compute_device == "cuda"
            else f"{_num(self.ddr_gb)} GB DDR"
        )
        return (
            f"{hosts} host(s) x {self.local} {self.compute_device} device(s) = world size {self.world_size}, "
            f"{mem} per rank"
        )


# ---------------------------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------------------------


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


def build_model(cfg, compute_device: str):
    """The training task (what training.trainer.shard_train_task shards) on the meta device, with the fused embedding
    optimizer attached so the planner counts its state."""
    import torch

    from pinads_rec import parallel
    from pinads_rec.models import build_model
    from pinads_rec.models.train_task import TrainTask

    model = TrainTask(build_model(cfg.features, cfg.model, device=torch.device("meta")))
    parallel.attach_embedding_optimizer(model, cfg.train, torch.device(compute_device))
    return model


def table_constraints(cfg, spec: PlanSpec, batch_size: int) -> Dict[str, object]:
    """pinads_rec.parallel.constraints() plus per-feature pooling factors and batch sizes."""
    from pinads_rec import parallel
    from pinads_rec.config import CANDIDATE_PREFIX
    from pinads_rec.features import FeatureLayout

    out = parallel.constraints(cfg, spec.compute_device)
    if not spec.pooling_factors:
        return out
    f = cfg.features
    per_request = max(1, math.ceil(batch_size / max(cfg.synth.candidates_per_request, 1.0)))
    max_len = {g.name: g.max_length for g in f.sequence_groups}
    layout = FeatureLayout.of(f)
    for t in layout.embedding_bag_configs():
        n = len(t.feature_names)
        out[t.name] = dataclasses.replace(out[t.name], pooling_factors=[1.0] * n, batch_sizes=[batch_size] * n)
    for t in layout.embedding_bag_configs(user_side=True):  # looked up once per request
        n = len(t.feature_names)
        out[t.name] = dataclasses.replace(out[t.name], pooling_factors=[1.0] * n, batch_sizes=[per_request] * n)
    for t in layout.embedding_configs():
        factors = []
        for key in t.feature_names:
            if key.startswith(CANDIDATE_PREFIX):  # the request's candidates, in row order
                factors.append(float(cfg.synth.candidates_per_request))
            else:
                factors.append(float(max_len[key.split(".", 1)[0]]))
        out[t.name] = dataclasses.replace(
            out[t.name], pooling_factors=factors, batch_sizes=[per_request] * len(factors)
        )
    return out


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
    PlanFailed with a readable message when no plan fits. ``constraints``: the per-table
    ParameterConstraints to plan with instead of ``table_constraints(cfg, spec, batch)`` (e.g. with
    pooling factors measured on data)."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.stats import EmbeddingStats
    from torchrec.distributed.planner.types import PlannerError

    from pinads_rec import parallel

    spec.validate()
    if spec.sharding_types:
        from pinads_rec import config as config_mod

        cfg = config_mod.from_dict(config_mod.to_dict(cfg), [f"train.sharding_types=[{','.join(spec.sharding_types)}]"])
    batch = spec.batch_size or cfg.data.batch_size
    started = time.perf_counter()
    model = build_model(cfg, spec.compute_device)
    topology = make_topology(spec)
    if constraints is None:
        constraints = table_constraints(cfg, spec, batch)
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
            raise PlanFailed(_explain_failure(e, spec, model, sharders, reservation, capture, batch)) from None
        except RuntimeError as e:
            if "No available sharding type" not in str(e):
                raise
            raise PlanFailed(f"no sharding type/kernel is left for a table after the constraints: {e}") from None
    return _report(
        capture.best_plan, cfg, spec, config_path, topology, reservation, batch, time.perf_counter() - started, capture
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


def _report(best_plan, cfg, spec: PlanSpec, config_path, topology, reservation, batch, seconds, capture) -> dict:
    from pinads_rec import parallel

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
        "sharding_types": parallel.allowed_sharding_types(cfg, spec.compute_device),
        "pooling_factors": spec.pooling_factors,
        "storage_reservation": reserved,
        "per_rank": ranks,
        "critical_path": critical,
        "planner": {
            "proposals": getattr(capture, "num_proposals", None),
            "plans": getattr(capture, "num_plans", None),
            "seconds": seconds,
        },
    }


def _readable(message: str) -> List[str]:
    """TorchRec's error text with byte counts in GB, without per-shard Perf dumps, wrapped."""

    def storage(m):
        hbm, ddr = int(m.group(1)), int(m.group(2))
        return f"Storage(hbm={hbm / GB:.2f} GB, ddr={ddr / GB:.2f} GB)"

    text = re.sub(r"Storage\(hbm=(\d+), ddr=(\d+)(?:, ssd=\d+)?\)", storage, message.expandtabs(2))
    text = re.sub(r",? ?perf: Perf\([^)]*\)", "", text)
    out = []
    for line in text.strip().splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        out += textwrap.wrap(
            line.strip(), width=110, initial_indent=" " * (indent + 2), subsequent_indent=" " * (indent + 6)
        ) or [""]
    return out


def _explain_failure(error, spec: PlanSpec, model, sharders, reservation, capture, batch: int) -> str:
    """TorchRec's message, tidied, then which tables cannot be placed and the totals against what
    the ranks have left after the storage reservation."""
    lines = [f"no sharding plan fits {spec.describe()}, batch {batch} per rank.", "TorchRec's planner says:"]
    lines += _readable(str(error))
    left = reservation.last_reserved_topology
    if left is None:  # the reservation itself failed: nothing is left for the embeddings
        return "\n".join(lines)
    try:
        options = capture.enumerator.enumerate(model, sharders) if capture.enumerator is not None else []
    except Exception:
        options = []
    if not options:
        return "\n".join(lines)
    rank_hbm, rank_ddr = left.devices[0].storage.hbm, left.devices[0].storage.ddr
    all_hbm, all_ddr = sum(d.storage.hbm for d in left.devices), sum(d.storage.ddr for d in left.devices)
    by_table: Dict[str, list] = {}
    for so in options:
        by_table.setdefault(so.name, []).append(so)
    rows, misfits, need_hbm, min_hbm, min_hbm_ddr = [], [], 0, 0, 0
    for name, opts in sorted(by_table.items(), key=lambda kv: -kv[1][0].tensor.numel()):

        def largest(so):
            return max(so.shards, key=lambda shard: shard.storage.hbm + shard.storage.ddr)

        in_hbm = [so for so in opts if so.total_storage.ddr == 0]
        best_hbm = min(in_hbm, key=lambda so: _prefer(so, so.total_storage.hbm)) if in_hbm else None
        offload = [so for so in opts if so.total_storage.ddr > 0]
        best_off = min(offload, key=lambda so: _prefer(so, so.total_storage.hbm)) if offload else None
        least = min(opts, key=lambda so: _prefer(so, so.total_storage.hbm))
        need_hbm += best_hbm.total_storage.hbm if best_hbm else least.total_storage.hbm
        min_hbm += least.total_storage.hbm
        min_hbm_ddr += least.total_storage.ddr
        fits = any(all(s.storage.hbm <= rank_hbm and s.storage.ddr <= rank_ddr for s in so.shards) for so in opts)
        smallest = min(opts, key=lambda so: _prefer(so, largest(so).storage.hbm + largest(so).storage.ddr))
        big = largest(smallest)
        if not fits:
            misfits.append(
                f"{name} (its smallest shard, {smallest.sharding_type}/{smallest.compute_kernel}, needs "
                f"{_gb(big.storage.hbm)} GB HBM + {_gb(big.storage.ddr)} GB DDR)"
            )
        rows.append(
            [
                name,
                _shape(opts[0]),
                _gb(opts[0].tensor.numel() * opts[0].tensor.element_size()),
                f"{_gb(best_hbm.total_storage.hbm)} ({best_hbm.sharding_type}/{best_hbm.compute_kernel})"
                if best_hbm
                else "-",
                f"{_gb(best_off.total_storage.hbm)} + {_gb(best_off.total_storage.ddr)} "
                f"({best_off.sharding_type}/{best_off.compute_kernel})"
                if best_off
                else "-",
                _gb(big.storage.hbm + big.storage.ddr),
                "yes" if fits else "NO",
            ]
        )
    lines.append("")
    lines.append(
        f"Per rank after the reservation: {_gb(rank_hbm)} GB HBM + {_gb(rank_ddr)} GB DDR "
        f"({spec.world_size} rank(s): {_gb(all_hbm)} GB HBM + {_gb(all_ddr)} GB DDR in all)."
    )
    lines.append(
        "Tables (GB over all shards, weights + optimizer state + I/O buffers, in the layout that needs "
        "the least HBM; 'fits a rank': some layout has every shard within a rank's memory):"
    )
    lines += [
        "  " + ln
        for ln in _table(
            [
                "table",
                "rows x dim",
                "weights GB",
                "all in HBM, GB",
                "with UVM offload, HBM + DDR GB",
                "smallest shard GB",
                "fits a rank?",
            ],
            rows,
        )
    ]
    lines.append(
        f"All tables in HBM need at least {_gb(need_hbm)} GB (HBM left: {_gb(all_hbm)} GB); with UVM "
        f"offload at least {_gb(min_hbm)} GB HBM + {_gb(min_hbm_ddr)} GB DDR (DDR left: {_gb(all_ddr)} GB)."
    )
    if misfits:
        lines.append("Does not fit on any rank in any layout: " + "; ".join(misfits) + ".")
        lines.append("Add ranks (row-wise shards get smaller), more memory per rank, or shrink these tables.")
    elif min_hbm > all_hbm or min_hbm_ddr > all_ddr:
        lines.append(
            "Every table fits a rank on its own, but not all of them together: add ranks or memory, "
            "shrink tables, or lower --reserve-pct."
        )
    else:
        lines.append(
            "The totals would fit: the allowed layouts (sharding types, kernels) cannot be packed onto "
            "the ranks; allow more sharding types (--sharding-types) or add ranks."
        )
    return "\n".join(lines)


def _prefer(so, size: float) -> Tuple[int, bool]:
    """Sort key: size to the MB, and of equal sizes a sharded layout before a replicated one."""
    return round(size / 2**20), so.sharding_type == "data_parallel"


def _shape(so) -> str:
    return f"{int(so.tensor.shape[0]):,} x {int(so.tensor.shape[1])}"


# ---------------------------------------------------------------------------------------------
# Printing
# ---------------------------------------------------------------------------------------------


def _num(x: float) -> str:
    return f"{x:g}"


def _gb(b: float) -> str:
    """Bytes as GB: two decimals, more significant digits below 0.1 GB, plain 0 for nothing."""
    v = b / GB
    if v == 0:
        return "0"
    if abs(v) >= 0.1:
        return f"{v:.2f}"
    return f"{v:.4f}" if abs(v) >= 0.0001 else "<0.0001"


def _ranks(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8'."""
    uniq = sorted(set(ranks))
    parts, i = [], 0
    while i < len(uniq):
        j = i
        while j + 1 < len(uniq) and uniq[j + 1] == uniq[j] + 1:
            j += 1
        parts.append(str(uniq[i]) if i == j else f"{uniq[i]}-{uniq[j]}")
        i = j + 1
    out = ",".join(parts)
    return out if len(ranks) == len(uniq) else f"{out} ({len(ranks)} shards)"


def _table(header: List[str], rows: List[List[str]]) -> List[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    left = [not any(_is_number(r[i]) for r in rows) for i in range(len(header))]

    def fmt(row):
        return "  ".join(
            (str(x).ljust(w) if at_left else str(x).rjust(w)) for x, w, at_left in zip(row, widths, left)
        ).rstrip()

    return [fmt(header), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows]


def _is_number(x) -> bool:
    return bool(re.fullmatch(r"[-+]?[\d,]*\.?\d+%?", str(x)))


def format_report(report: dict, title: str = "") -> str:
    t, res, cp = report["topology"], report["storage_reservation"], report["critical_path"]
    cuda = t["compute_device"] == "cuda"
    hosts = math.ceil(t["world_size"] / t["local_world_size"])
    out = []
    head = f"Plan for {report['config'] or 'config'}" + (f" ({title})" if title else "")
    out.append(head)
    out.append("=" * len(head))
    mem = f"{_num(t['hbm_gb'])} GB HBM + {_num(t['ddr_gb'])} GB DDR" if cuda else f"{_num(t['ddr_gb'])} GB DDR"
    out.append(
        f"Topology: {hosts} host(s) x {t['local_world_size']} {t['compute_device']} = {t['world_size']} ranks, "
        f"{mem} per rank; batch {report['batch_size']} per rank"
    )
    out.append(
        f"Bandwidths (GB/s): HBM {_num(t['hbm_bw_gbps'])}, DDR {_num(t['ddr_bw_gbps'])}, "
        f"intra-host {_num(t['intra_host_bw_gbps'])}, inter-host {_num(t['inter_host_bw_gbps'])}"
    )
    allowed = ",".join(report["sharding_types"]) or "all the device supports"
    out.append(
        f"Sharding types allowed: {allowed}; pooling factors: "
        f"{'from the config (sequence lengths)' if report['pooling_factors'] else 'TorchRec default (1)'}"
    )
    where = "HBM" if cuda else "DDR"
    out.append(
        f"Storage reserved per rank ({res['policy']}, {_num(res['percentage'])}%): "
        f"{_gb(res['margin_hbm_bytes'])} GB margin + {_gb(res['dense_bytes'])} GB dense (6 x params) + "
        f"{_gb(res['kjt_bytes'])} GB input batches = "
        f"{_gb(res['margin_hbm_bytes'] + res['dense_bytes'] + res['kjt_bytes'])} GB; "
        f"{_gb(res['available_hbm_bytes'] if cuda else res['available_ddr_bytes'])} GB {where} left for embeddings"
    )
    out.append("")
    out.append(
        "Tables (GB over all shards: weights + optimizer state + the kernels' I/O buffers; "
        "cost: the shards' per-step ms, summed)"
    )
    rows = []
    for name, tb in report["tables"].items():
        mem_cols = [_gb(tb["hbm_bytes"]), _gb(tb["ddr_bytes"])] if cuda else [_gb(tb["hbm_bytes"] + tb["ddr_bytes"])]
        rows.append(
            [
                name,
                tb["module"].rsplit(".", 1)[-1],
                f"{tb['num_embeddings']:,} x {tb['embedding_dim']}",
                _gb(tb["weight_bytes"]),
                *mem_cols,
                tb["sharding_type"],
                tb["compute_kernel"],
                _ranks(tb["ranks"]),
                f"{tb['cost_ms']:.3f}",
            ]
        )
    mem_head = ["HBM GB", "DDR GB"] if cuda else ["DDR GB"]
    out += [
        "  " + ln
        for ln in _table(
            ["table", "module", "rows x dim", "weights GB", *mem_head, "sharding", "kernel", "ranks", "cost ms"], rows
        )
    ]
    out.append("")
    out.append("Per rank (GB: embedding shards + dense/input reservation; ms per step, planner estimates)")
    rows = []
    for r in report["per_rank"]:
        mem_cols = (
            [_gb(r["hbm_bytes"]), _gb(r["hbm_total_bytes"]), f"{100 * r['hbm_total_bytes'] / t['hbm_cap_bytes']:.0f}%"]
            if cuda
            else []
        )
        rows.append(
            [
                str(r["rank"]),
                str(r["host"]),
                *mem_cols,
                _gb(r["ddr_total_bytes"]),
                str(r["shards"]),
                f"{r['fwd_compute']:.3f}",
                f"{r['fwd_comms']:.3f}",
                f"{r['bwd_compute']:.3f}",
                f"{r['bwd_comms']:.3f}",
                f"{r['prefetch_compute']:.3f}",
                f"{r['total']:.3f}",
                "*" if r["rank"] == cp["rank"] else "",
            ]
        )
    mem_head = ["emb HBM", "HBM used", "of cap"] if cuda else []
    out += [
        "  " + ln
        for ln in _table(
            [
                "rank",
                "host",
                *mem_head,
                "DDR used",
                "shards",
                "fwd comp",
                "fwd comms",
                "bwd comp",
                "bwd comms",
                "prefetch",
                "total ms",
                "",
            ],
            rows,
        )
    ]
    out.append("")
    hbm_max = max(report["per_rank"], key=lambda r: r["hbm_total_bytes"] if cuda else r["ddr_total_bytes"])
    used = hbm_max["hbm_total_bytes"] if cuda else hbm_max["ddr_total_bytes"]
    cap = t["hbm_cap_bytes"] if cuda else t["ddr_cap_bytes"]
    out.append(
        f"Critical path: rank {cp['rank']} (*), {cp['total_ms']:.3f} ms per step "
        f"(fwd {cp['fwd_compute_ms']:.3f} compute + {cp['fwd_comms_ms']:.3f} comms, "
        f"bwd {cp['bwd_compute_ms']:.3f} compute + {cp['bwd_comms_ms']:.3f} comms, "
        f"prefetch {cp['prefetch_compute_ms']:.3f})"
    )
    if "torchrec_sync_estimate_ms" in cp:
        s = cp["torchrec_sync_estimate_ms"]
        out.append(
            f"TorchRec's synchronized critical path: {s['total']:.3f} ms "
            f"({s['comms']:.3f} comms + {s['compute']:.3f} compute)"
        )
    global_batch = report["batch_size"] * t["world_size"]
    if cp["total_ms"] > 0:
        out.append(
            f"Embedding-bound rate: global batch {global_batch:,} / {cp['total_ms']:.3f} ms = "
            f"{global_batch / cp['total_ms'] / 1000:.2f} M examples/s (sparse part only: no dense compute)"
        )
    out.append(f"Most memory: rank {hbm_max['rank']}, {_gb(used)} of {_gb(cap)} GB {where} ({100 * used / cap:.0f}%)")
    kinds: Dict[str, List[str]] = {}
    for name, tb in report["tables"].items():
        kinds.setdefault(f"{tb['sharding_type']}/{tb['compute_kernel']}", []).append(name)
    out.append("Layouts: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in kinds.items()))
    planner = report["planner"]
    if planner.get("proposals") is not None:
        out.append(
            f"(planner: {planner['proposals']} proposals, {planner['plans']} plans that fit, "
            f"{planner['seconds']:.1f} s)"
        )
    return "\n".join(out)


def format_comparison(a: dict, b: dict, label_a: str, label_b: str) -> str:
    out = ["Side by side", "============", f"A = {label_a}", f"B = {label_b}", ""]
    ta, tb = a["topology"], b["topology"]
    cuda = ta["compute_device"] == "cuda" and tb["compute_device"] == "cuda"
    ra, rb = a["critical_path"], b["critical_path"]
    ga, gb = a["batch_size"] * ta["world_size"], b["batch_size"] * tb["world_size"]
    out.append(
        f"Critical path: A rank {ra['rank']} {ra['total_ms']:.3f} ms, B rank {rb['rank']} {rb['total_ms']:.3f} ms"
    )
    if ra["total_ms"] > 0 and rb["total_ms"] > 0:
        out.append(
            f"Embedding-bound rate: A {ga / ra['total_ms'] / 1000:.2f} M examples/s (global batch {ga:,}), "
            f"B {gb / rb['total_ms'] / 1000:.2f} M examples/s (global batch {gb:,})"
        )
    key = "hbm_total_bytes" if cuda else "ddr_total_bytes"
    ma, mb = max(r[key] for r in a["per_rank"]), max(r[key] for r in b["per_rank"])
    out.append(f"Most {'HBM' if cuda else 'DDR'} on a rank: A {_gb(ma)} GB   B {_gb(mb)} GB")
    out.append("")
    out.append("Tables (* = layout or ranks differ; GB: HBM + DDR over all shards)")
    rows = []
    for name in list(a["tables"]) + [n for n in b["tables"] if n not in a["tables"]]:
        x, y = a["tables"].get(name), b["tables"].get(name)

        def cell(t):
            return (
                ("-", "-", "-")
                if t is None
                else (
                    f"{t['sharding_type']}/{t['compute_kernel']}",
                    _ranks(t["ranks"]),
                    _gb(t["hbm_bytes"] + t["ddr_bytes"]),
                )
            )

        cx, cy = cell(x), cell(y)
        changed = x is None or y is None or cx[:2] != cy[:2]
        rows.append([("* " if changed else "  ") + name, *cx, *cy])
    out += ["  " + ln for ln in _table(["table", "A layout", "A ranks", "A GB", "B layout", "B ranks", "B GB"], rows)]
    out.append("")
    out.append("Per rank (GB used, ms per step)")
    mem = "HBM" if cuda else "DDR"
    rows = []
    for r in range(max(ta["world_size"], tb["world_size"])):
        x = a["per_rank"][r] if r < ta["world_size"] else None
        y = b["per_rank"][r] if r < tb["world_size"] else None
        gx, gy = (_gb(x[key]) if x else "-"), (_gb(y[key]) if y else "-")
        mx, my = (f"{x['total']:.3f}" if x else "-"), (f"{y['total']:.3f}" if y else "-")
        dm = f"{(y[key] - x[key]) / GB:+.2f}" if x and y else "-"
        dt = f"{y['total'] - x['total']:+.3f}" if x and y else "-"
        rows.append([str(r), gx, gy, dm, mx, my, dt])
    out += ["  " + ln for ln in _table(["rank", f"A {mem}", f"B {mem}", "B-A GB", "A ms", "B ms", "B-A ms"], rows)]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

_SPEC_FIELDS = {f.name: f for f in dataclasses.fields(PlanSpec)}


def parse_compare(text: str, base: PlanSpec) -> PlanSpec:
    """``"world_size=8,local_world_size=8"`` -> a copy of ``base`` with those fields. A comma inside a
    value (sharding_types=table_wise,row_wise) is kept: pairs split only before another ``key=``."""
    changes = {}
    for pair in split_overrides(text):
        if "=" not in pair:
            raise ValueError(f"--compare {text!r}: expected FIELD=VALUE pairs, got {pair!r}")
        key, value = (s.strip() for s in pair.split("=", 1))
        key = key.replace("-", "_")
        if key not in _SPEC_FIELDS:
            raise ValueError(f"--compare: unknown field {key!r} (fields: {', '.join(_SPEC_FIELDS)})")
        kind = {
            "world_size": int,
            "local_world_size": int,
            "batch_size": int,
            "compute_device": str,
            "sharding_types": list,
            "pooling_factors": bool,
        }.get(key, float)
        try:
            if kind is list:
                changes[key] = [s for s in re.split(r"[,\s]+", value.strip("[]")) if s]
            elif kind is bool:
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(value)
                changes[key] = value.lower() in ("true", "1", "yes")
            else:
                changes[key] = kind(value)
        except ValueError:
            raise ValueError(f"--compare: {key}={value!r} is not a valid {kind.__name__}") from None
    if not changes:
        raise ValueError(f"--compare {text!r}: no FIELD=VALUE given")
    if "world_size" in changes and "local_world_size" not in changes and base.local_world_size is not None:
        changes["local_world_size"] = min(base.local_world_size, changes["world_size"])
    return dataclasses.replace(base, **changes)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    from pinads_rec import config

    p = argparse.ArgumentParser(
        prog="python -m pinads_rec.plan",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="docs/planning.md has worked examples (1 x 8 and 2 x 8 GPUs).",
    )
    p.add_argument("--config", default=DEFAULT_CONFIG, help="experiment YAML (default %(default)s)")
    config.add_overrides_flag(p, "config override, e.g. --set model.sequence.d_model=256 (repeatable)")
    g = p.add_argument_group("topology (GB = 2^30 bytes, GB/s = 2^30 bytes/s)")
    g.add_argument(
        "--world-size", type=int, default=8, metavar="N", help="devices (ranks) in all (default %(default)s)"
    )
    g.add_argument(
        "--local-world-size", type=int, default=None, metavar="N", help="devices per host (default: min(world size, 8))"
    )
    g.add_argument(
        "--compute-device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="device type planned for (default %(default)s)",
    )
    g.add_argument(
        "--hbm-gb",
        type=float,
        default=80.0,
        metavar="GB",
        help="GPU memory per rank (default %(default)s; unused for cpu)",
    )
    g.add_argument(
        "--ddr-gb", type=float, default=512.0, metavar="GB", help="host memory per rank (default %(default)s)"
    )
    g.add_argument("--hbm-bw", type=float, default=897.0, metavar="GB/S", help="HBM bandwidth (default %(default)s)")
    g.add_argument("--ddr-bw", type=float, default=51.0, metavar="GB/S", help="DDR bandwidth (default %(default)s)")
    g.add_argument(
        "--intra-host-bw",
        type=float,
        default=600.0,
        metavar="GB/S",
        help="comms bandwidth per rank within a host (default %(default)s)",
    )
    g.add_argument(
        "--inter-host-bw",
        type=float,
        default=12.5,
        metavar="GB/S",
        help="comms bandwidth per rank across hosts (default %(default)s)",
    )
    g = p.add_argument_group("planning")
    g.add_argument(
        "--batch-size", type=int, default=None, metavar="N", help="per-rank batch size (default: data.batch_size)"
    )
    g.add_argument(
        "--reserve-pct",
        type=float,
        default=15.0,
        metavar="P",
        help="HeuristicalStorageReservation margin, percent of HBM (default %(default)s)",
    )
    g.add_argument(
        "--sharding-types",
        default=None,
        metavar="A,B",
        help=f"allowed sharding types, from {','.join(SHARDING_TYPES)} "
        "(default: train.sharding_types, or all the device supports; table_wise on CPU)",
    )
    g.add_argument(
        "--no-pooling-factors",
        dest="pooling_factors",
        action="store_false",
        help="one lookup per table and row (TorchRec's default) instead of the sequence lengths",
    )
    g = p.add_argument_group("output")
    g.add_argument(
        "--out", default=None, metavar="PLAN.json", help="write the (first) plan as JSON, for train.plan_file"
    )
    g.add_argument("--verbose", action="store_true", help="also print TorchRec's planner stats tables")
    g.add_argument(
        "--compare",
        default=None,
        metavar="FIELD=VALUE,...",
        help="plan a second topology differing in these fields, e.g. world_size=8,local_world_size=8",
    )
    g.add_argument("--compare-config", default=None, metavar="YAML", help="plan a second config and compare")
    return p.parse_args(argv)


def spec_from_args(args: argparse.Namespace) -> PlanSpec:
    types = [s for s in re.split(r"[,\s]+", args.sharding_types.strip("[]")) if s] if args.sharding_types else []
    return PlanSpec(
        world_size=args.world_size,
        local_world_size=args.local_world_size,
        compute_device=args.compute_device,
        hbm_gb=args.hbm_gb,
        ddr_gb=args.ddr_gb,
        batch_size=args.batch_size,
        hbm_bw=args.hbm_bw,
        ddr_bw=args.ddr_bw,
        intra_host_bw=args.intra_host_bw,
        inter_host_bw=args.inter_host_bw,
        reserve_pct=args.reserve_pct,
        sharding_types=types,
        pooling_factors=args.pooling_factors,
    )


def _label(path: str, spec: PlanSpec) -> str:
    return f"{path}, {spec.describe()}"


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    from pinads_rec import config

    try:
        spec = spec_from_args(args)
        spec.validate()
        jobs = [(args.config, spec)]
        if args.compare or args.compare_config:
            other = parse_compare(args.compare, spec) if args.compare else spec
            other.validate()
            jobs.append((args.compare_config or args.config, other))
        cfgs = [config.load(path, args.overrides) for path, _ in jobs]
    except config.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    reports, failed = [], False
    for i, ((path, s), cfg) in enumerate(zip(jobs, cfgs)):
        title = "" if len(jobs) == 1 else ("A", "B")[i]
        try:
            report = plan(cfg, s, path, verbose=args.verbose)
        except PlanFailed as e:
            failed = True
            reports.append(None)
            print(f"error{f' (plan {title})' if title else ''}: {e}", file=sys.stderr, flush=True)
            continue
        except ValueError as e:  # constraints (train.plan_file, sharding types) that cannot be used
            print(f"error: {e}", file=sys.stderr)
            return 2
        reports.append(report)
        if title:
            print(f"[{title}] {_label(path, s)}")
        print(format_report(report, title))
        print(flush=True)
        if i == 0 and args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
            print(f"plan written to {args.out} (train with --set train.plan_file={args.out})\n", flush=True)
    if len(reports) == 2 and all(reports):
        changed = ", ".join(x for x in (args.compare, args.compare_config) if x)
        print(format_comparison(reports[0], reports[1], _label(*jobs[0]), f"{_label(*jobs[1])} ({changed})"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
