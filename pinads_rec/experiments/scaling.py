"""Scaling experiments: real multi-process gloo runs over a sweep, plus the planner's GPU projection.

    python -m pinads_rec.experiments.scaling --config configs/demo.yaml --sweep ranks=1,2 \\
        --sweep batch_size=256,512,1024 --sweep sequence_length=25,50,100 \\
        --sweep table_rows=10000,100000,1000000 [--grid] [--steps N --warmup N --out runs/scaling]

The sweep's dimensions and points: ``scaling_sweep`` (``--sweep NAME=v1,...``, ``--base NAME=VALUE``
to move the base point, ``--grid`` for the full product; the base run is shared). ``--set
key=value`` applies to every run (e.g. ``--set train.sharding_types=[table_wise]``).

Run length: the loader's cost comes in bursts (a row group read, checked, and the shuffle buffer
compacted, every ``max(data.shuffle_buffer_rows, synth.row_group_size)`` rows: a few hundred ms
once every 8-64 steps), so by default the warmup covers the first buffer fill and the measured
window 4 such periods (``--steps`` / ``--warmup`` fix the counts instead). On a shared machine,
``--quiet-wait S`` waits up to S seconds before each run for other processes to go quiet,
``--repeats N`` runs every point N times (interleaved) and the table and plots keep the fastest;
each row records the CPU other processes used during the run (``other_load_cores``).

Every run is a fresh set of processes (``harness.rank_results``: spawn, FILE rendezvous, a
deadline; the ranks die with the sweep process). Each rank builds its trainer as ``train.py`` does
(``Trainer.setup()``: planner + DMP + fused embedding optimizer + AdamW) and times a plain loop of
it phase by phase (``harness.measure_training`` / ``timed_steps``: data, forward, backward,
optimizer; the data loader runs in the trainer process unless ``--num-workers``).

Comms: torch.profiler records every gloo collective (``collectives.PhaseProfile``). It also
records every op, which slows a CPU step by ~10%, so the timed steps run without it and
``--comms-steps`` more steps (default: as many) run under it after them: per phase, the ms per step
during which at least one collective was in flight (``comms_fwd_ms``, ``comms_bwd_ms``,
``comms_data_ms``); that includes waiting for a slower peer. DDP's gradient all_reduce is timed over
the timed steps by a comm hook identical to DDP's default one, from enqueue to completion
(``ddp_allreduce_ms``): it overlaps backward compute, so it is not part of the sums. Each rank's JSON
(``runs/<point>-<repeat>/rank-N.json``) also has the per-step phase times and, by phase, the
collectives started per profiled step and their ms.

Memory: each rank's peak RSS (``VmHWM``) at the end, and its RSS before the model is built (the
torch/torchrec import baseline, ~0.4 GiB per process).

Outputs under ``--out``: ``scaling.csv`` (one row per run), ``projection.csv`` (``scaling_report``),
``scaling_<dim>.png`` and ``projection.png`` (``scaling_plot``), per-run JSON under ``runs/``,
generated data under ``data/`` (``pinads_rec.data.synth.ensure``: reused when its generator settings
match and it holds enough rows). The planner projection for 8..128 GPUs: ``scaling_projection``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from pinads_rec import arguments, config
from pinads_rec.data import synth
from pinads_rec.experiments import harness
from pinads_rec.experiments.scaling_plot import plot
from pinads_rec.experiments.scaling_projection import DEFAULT_GPUS, PROJECTION_COLUMNS, project
from pinads_rec.experiments.scaling_report import read_csv, report, write_csv
from pinads_rec.experiments.scaling_sweep import (
    DIMENSIONS,
    Point,
    base_point,
    data_key,
    data_synth,
    parse_sweeps,
    point_config,
    point_steps,
    scaled_table_names,
    sweep_points,
)
from pinads_rec.plan import measured_pooling

log = logging.getLogger("pinads_rec.experiments.scaling")

# CSV columns, in order: the sweep values, then what was measured.
COLUMNS = [
    "run",
    "ranks",
    "batch_size",
    "sequence_length",
    "table_rows",
    "global_batch",
    "steps",
    "warmup",
    "examples_per_s",
    "examples_per_s_per_rank",
    "step_ms",
    "data_ms",
    "forward_ms",
    "backward_ms",
    "optimizer_ms",
    "data_p50_ms",
    "data_max_ms",
    "comms_ms",
    "comms_fwd_ms",
    "comms_bwd_ms",
    "comms_data_ms",
    "ddp_allreduce_ms",
    "peak_rss_mib",
    "peak_rss_mib_total",
    "base_rss_mib",
    "ids_per_example",
    "requests_per_batch",
    "embedding_rows",
    "embedding_mib",
    "wall_s",
    "run_seconds",
    "repeat",
    "other_load_cores",
    "best",
    "plan",
]


def prepare_data(
    cfg: config.ExperimentConfig,
    points: Sequence[Point],
    tables: Sequence[str],
    out: Path,
    warmup: Optional[int],
    steps: Optional[int],
    comms_steps: Optional[int] = None,
) -> Dict[Tuple[int, Optional[int]], Path]:
    """One generated set per (sequence length, table rows) under ``out/data``, sized for the longest
    run that uses it; a cached set with at least as many requests is reused."""
    dirs = {}
    for key in dict.fromkeys(data_key(p) for p in points):
        users = [p for p in points if data_key(p) == key]
        rows = max(p.ranks * (sum(point_steps(cfg, p, warmup, steps, comms_steps)) + 2) * p.batch_size for p in users)
        pcfg = point_config(cfg, users[0], tables)
        s = data_synth(pcfg, int(rows * 1.15), max(p.ranks for p in users), max(p.batch_size for p in users))
        d = out / "data" / f"L{key[0]}-T{'cfg' if key[1] is None else key[1]}"
        synth.ensure(dataclasses.replace(pcfg, synth=s), d, at_least=("train_requests", "eval_requests"), echo=log.info)
        dirs[key] = d
    return dirs


def aggregate(
    p: Point, ranks: List[dict], warmup: int, seconds: float, repeat: int = 0, load: Optional[Dict[str, float]] = None
) -> dict:
    """One CSV row: global examples/s over the slowest rank's measured window; phases averaged over
    ranks; memory: the largest rank and the sum."""
    mean = lambda k: sum(r[k] for r in ranks) / len(ranks)  # noqa: E731
    steps = ranks[0]["steps"]
    wall = max(r["wall_s"] for r in ranks)
    global_batch = p.batch_size * p.ranks
    row = {
        "run": p.name,
        "ranks": p.ranks,
        "batch_size": p.batch_size,
        "sequence_length": p.sequence_length,
        "table_rows": p.table_rows if p.table_rows is not None else "",
        "global_batch": global_batch,
        "steps": steps,
        "warmup": warmup,
        "examples_per_s": global_batch * steps / wall,
        "examples_per_s_per_rank": p.batch_size * steps / wall,
        "step_ms": 1000.0 * wall / steps,
        **{f"{k}_ms": mean(f"{k}_ms") for k in harness.PHASES},
        "data_p50_ms": mean("data_p50_ms"),
        "data_max_ms": max(r["data_max_ms"] for r in ranks),
        "comms_fwd_ms": mean("comms_fwd_ms"),
        "comms_bwd_ms": mean("comms_bwd_ms"),
        "comms_data_ms": mean("comms_data_ms"),
        "ddp_allreduce_ms": mean("ddp_allreduce_ms"),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
        "peak_rss_mib_total": sum(r["peak_rss_mib"] for r in ranks),
        "base_rss_mib": mean("base_rss_mib"),
        "ids_per_example": mean("ids_per_example"),
        "requests_per_batch": mean("requests_per_batch"),
        "embedding_rows": sum(r["embedding_rows"] for r in ranks),
        "embedding_mib": sum(r["embedding_mib"] for r in ranks),
        "wall_s": wall,
        "run_seconds": seconds,
        "plan": ranks[0]["plan"],
        "repeat": repeat,
        "other_load_cores": (load or {}).get("other_cores", float("nan")),
    }
    row["comms_ms"] = row["comms_fwd_ms"] + row["comms_bwd_ms"]
    return row


def mark_best(rows: List[dict]) -> List[dict]:
    """Per sweep point, flags the repeat with the highest examples/s (other users' load on a shared
    machine only ever slows a run down) and returns those rows in sweep order."""
    best: Dict[str, dict] = {}
    for r in rows:
        if r["run"] not in best or r["examples_per_s"] > best[r["run"]]["examples_per_s"]:
            best[r["run"]] = r
    for r in rows:
        r["best"] = int(best[r["run"]] is r)
    return list(best.values())


def run_sweep(
    cfg: config.ExperimentConfig,
    sweeps: Dict[str, List[int]],
    out: Path,
    warmup: Optional[int] = None,
    steps: Optional[int] = None,
    grid: bool = False,
    base: Optional[Dict[str, int]] = None,
    gpus: Sequence[int] = DEFAULT_GPUS,
    scale_tables: Optional[Sequence[str]] = None,
    num_workers: int = 0,
    timeout_s: float = 900.0,
    repeats: int = 1,
    quiet_wait_s: float = 0.0,
    comms_steps: Optional[int] = None,
    echo=print,
) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    tables = scaled_table_names(cfg, scale_tables)
    bp = base_point(cfg, sweeps, tables, base)
    points = sweep_points(sweeps, bp, grid)
    echo(f"base point: {bp.name}; {len(points)} point(s) x {repeats} repeat(s): {', '.join(p.name for p in points)}")
    data_dirs = prepare_data(cfg, points, tables, out, warmup, steps, comms_steps)
    (out / "sweep.json").write_text(json.dumps({"sweeps": sweeps, "base": dataclasses.asdict(bp), "grid": grid}))

    rows: List[dict] = []
    order = [(rep, p) for rep in range(repeats) for p in points]  # repeats interleaved: drift spreads out
    for i, (rep, p) in enumerate(order):
        if quiet_wait_s > 0:
            harness.wait_quiet(quiet_wait_s, echo=echo)
        pcfg = point_config(cfg, p, tables, data_dirs[data_key(p)])
        w, n, c = point_steps(pcfg, p, warmup, steps, comms_steps)
        meter = harness.CpuMeter()
        run_dir = out / "runs" / f"{p.name}-{rep}"
        ranks = harness.rank_results(
            harness.measure_training, p.ranks, run_dir, pcfg, w, n, num_workers, c, timeout_s=timeout_s
        )
        load = meter.stop()
        row = aggregate(p, ranks, w, load["seconds"], rep, load)
        rows.append(row)
        echo(
            f"[{i + 1}/{len(order)}] {p.name} #{rep}: {row['examples_per_s']:,.0f} examples/s, "
            f"{row['step_ms']:.1f} ms/step, peak {row['peak_rss_mib']:,.0f} MiB, "
            f"other load {load['other_cores']:.2f} cores ({load['seconds']:.0f} s)"
        )
        mark_best(rows)
        write_csv(out / "scaling.csv", rows, COLUMNS)  # after every run: a partial sweep is kept
    best = mark_best(rows)
    write_csv(out / "scaling.csv", rows, COLUMNS)

    projection = []
    if gpus:
        bcfg = point_config(cfg, bp, tables, data_dirs[data_key(bp)])
        pooling = measured_pooling(bcfg)
        rows_values = sweeps.get("table_rows") or [bp.table_rows]
        for tr in rows_values:
            pcfg = point_config(cfg, dataclasses.replace(bp, table_rows=tr), tables)
            projection += project(pcfg, gpus, pooling, tr)
        write_csv(out / "projection.csv", projection, PROJECTION_COLUMNS)
    pngs = plot(best, sweeps, bp, out, projection)
    report(best, projection, repeats, out, pngs, echo)
    return {"base": bp, "points": points, "rows": rows, "best": best, "projection": projection, "plots": pngs}


def replot(out: Path, echo=print) -> List[Path]:
    """Plots and table again from ``out``'s CSVs and sweep.json (no runs)."""
    meta = json.loads((out / "sweep.json").read_text())
    rows = read_csv(out / "scaling.csv")
    projection = read_csv(out / "projection.csv") if (out / "projection.csv").exists() else []
    best = mark_best(rows)
    pngs = plot(best, meta["sweeps"], Point(**meta["base"]), out, projection)
    report(best, projection, max(r["repeat"] for r in rows) + 1, out, pngs, echo, replotted=True)
    return pngs


def _parse_ints(text: str, what: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}: comma-separated integers, got {text!r}") from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{what}: values must be > 0, got {text!r}")
    return values


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pinads_rec.experiments.scaling", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/demo.yaml")
    config.add_overrides_flag(p, help="config override applied before the sweep (repeatable)")
    p.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="NAME=V1,V2,...",
        help=f"a dimension and its values; NAME one of {', '.join(DIMENSIONS)} (repeatable)",
    )
    p.add_argument("--grid", action="store_true", help="full product of the sweeps (default: one at a time)")
    p.add_argument(
        "--base",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="base-point value of a dimension (default: the config's if listed, else the first)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="measured steps per run (default: 4 loader periods of max(data.shuffle_buffer_rows, "
        "synth.row_group_size) rows, at least 20)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed steps first (default: the loader's first buffer fill, at least 5)",
    )
    p.add_argument(
        "--comms-steps",
        type=int,
        default=None,
        help="steps after the timed ones run under torch.profiler for the collectives' times (default: "
        "as many as the timed steps; 0: none, the comms columns stay 0)",
    )
    p.add_argument("--out", default="runs/scaling", type=arguments.output_dir)
    p.add_argument(
        "--gpus",
        type=lambda s: _parse_ints(s, "--gpus") if s else [],
        default=list(DEFAULT_GPUS),
        help="GPU counts for the planner projection ('' to skip)",
    )
    p.add_argument(
        "--scale-tables",
        type=lambda s: [t for t in s.split(",") if t],
        default=None,
        help="tables that table_rows resizes (default: the user and item id tables)",
    )
    p.add_argument(
        "--num-workers",
        type=arguments.non_negative_int,
        default=0,
        help="DataLoader workers per rank (default 0: the loader runs in the trainer process, "
        "so each rank is exactly one process on one thread)",
    )
    p.add_argument(
        "--timeout", type=arguments.positive_seconds, default=900.0, help="seconds per run before its ranks are killed"
    )
    p.add_argument(
        "--replot",
        action="store_true",
        help="no runs: redraw the plots and the table from --out's scaling.csv and sweep.json",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per point, interleaved; the table and plots keep the fastest (default 1)",
    )
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each run, wait up to this long for other processes to use < 0.25 cores",
    )
    args = p.parse_args(argv)
    if (args.steps is not None and args.steps < 1) or (args.warmup is not None and args.warmup < 1) or args.repeats < 1:
        p.error("--steps, --warmup and --repeats must be >= 1")
    if args.comms_steps is not None and args.comms_steps < 0:
        p.error("--comms-steps must be >= 0")
    try:
        args.sweeps = parse_sweeps(args.sweep)
        args.base_values = parse_sweeps(args.base) if args.base else {}
    except ValueError as e:
        p.error(str(e))
    if any(len(v) != 1 for v in args.base_values.values()):
        p.error("--base takes one value per dimension")
    args.base_values = {k: v[0] for k, v in args.base_values.items()}
    if not args.sweeps and not args.replot:
        p.error("give at least one --sweep NAME=v1,v2,...")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    harness.quiet_library_logs()
    log.setLevel(logging.INFO)
    if args.replot:
        try:
            replot(Path(args.out))
        except (OSError, ValueError, KeyError) as e:
            print(f"error: --replot {args.out}: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        cfg = config.load(args.config, args.overrides)
        run_sweep(
            cfg,
            args.sweeps,
            Path(args.out),
            args.warmup,
            args.steps,
            args.grid,
            args.base_values,
            args.gpus,
            args.scale_tables,
            args.num_workers,
            args.timeout,
            args.repeats,
            args.quiet_wait,
            args.comms_steps,
        )
    except (config.ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a rank failed or ran past --timeout: its traceback is in the message
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
