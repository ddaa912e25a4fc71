"""The planner's command line: run TorchRec's planner offline for a target cluster and print the plan.

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
  --candidates-per-request N              candidates per request the lookups are sized with
                                          (default: measured from data.train_dir; below)
  --no-pooling-factors                    plan with TorchRec's default of one lookup per table and
                                          row, instead of the config's sequence lengths (below)

Pooling factors: a sequence table is looked up ``max_length`` times per *request* for each
sequence feature using it (the EmbeddingCollection input has one row per request, about
``batch / candidates per request`` of them), and a candidate feature sharing it once per row;
pooled features once per row. These go to the planner as per-feature pooling factors and batch
sizes, so sequence tables weigh what they cost. The candidates per request: ``--candidates-per-request``,
else measured from data.train_dir's Parquet files (rows / requests, from the footers), else
``synth.candidates_per_request`` when the config's data is the synthetic generator's (no files
and no ``build:`` raw sources; a note says so), else an error (build the data, or pass the flag).
The report states the number and where it came from.

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
reserve_pct, sharding_types, pooling_factors, candidates_per_request), e.g.
``--compare world_size=8,local_world_size=8``;
``--compare-config other.yaml`` plans another config (both may be given; ``--set`` applies to both).
Both summaries are printed, then a side-by-side table per rank and per table of what changed.
``--out`` saves the first plan. The exit status is 1 when either plan does not fit, 2 for a usage,
config or data error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from typing import List, Optional

from pinads_rec import arguments
from pinads_rec.config import SHARDING_TYPES, split_overrides
from pinads_rec.plan.planner import PlanFailed, PlanSpec, plan
from pinads_rec.plan.report import format_comparison, format_report

DEFAULT_CONFIG = "configs/demo.yaml"

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
        "--world-size",
        type=arguments.positive_int,
        default=8,
        metavar="N",
        help="devices (ranks) in all (default %(default)s)",
    )
    g.add_argument(
        "--local-world-size",
        type=arguments.positive_int,
        default=None,
        metavar="N",
        help="devices per host (default: min(world size, 8))",
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
        "--batch-size",
        type=arguments.positive_int,
        default=None,
        metavar="N",
        help="per-rank batch size (default: data.batch_size)",
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
        "--candidates-per-request",
        type=float,
        default=None,
        metavar="N",
        help="mean candidates per request, which size the sequence tables' lookups (default: measured "
        "from data.train_dir; synth.candidates_per_request for the generator's data)",
    )
    g.add_argument(
        "--no-pooling-factors",
        dest="pooling_factors",
        action="store_false",
        help="one lookup per table and row (TorchRec's default) instead of the sequence lengths",
    )
    g = p.add_argument_group("output")
    g.add_argument(
        "--out",
        default=None,
        type=arguments.output_file,
        metavar="PLAN.json",
        help="write the (first) plan as JSON, for train.plan_file",
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
        candidates_per_request=args.candidates_per_request,
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
        for cfg in cfgs:  # read before planning, which builds the model first
            if cfg.train.plan_file:
                from pinads_rec.parallel import load_plan

                load_plan(cfg.train.plan_file)
    except config.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    reports, failed, notes = [], False, set()
    for i, ((path, s), cfg) in enumerate(zip(jobs, cfgs)):
        title = "" if len(jobs) == 1 else ("A", "B")[i]
        try:
            report = plan(cfg, s, path, verbose=args.verbose)
        except PlanFailed as e:
            failed = True
            reports.append(None)
            print(f"error{f' (plan {title})' if title else ''}: {e}", file=sys.stderr, flush=True)
            continue
        except ValueError as e:  # constraints that cannot be used, no data to size lookups by, bad data
            print(f"error: {e}", file=sys.stderr)
            return 2
        reports.append(report)
        note = report["candidates_per_request"].get("note")
        if note and note not in notes:  # said once when both plans read the same config
            notes.add(note)
            print(note)
        if title:
            print(f"[{title}] {_label(path, s)}")
        print(format_report(report, title))
        print(flush=True)
        if i == 0 and args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
            print(f"plan written to {args.out} (train with --set train.plan_file={args.out})\n", flush=True)
    if len(reports) == 2 and all(reports):
        changed = ", ".join(x for x in (args.compare, args.compare_config) if x)
        print(format_comparison(reports[0], reports[1], _label(*jobs[0]), f"{_label(*jobs[1])} ({changed})"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
