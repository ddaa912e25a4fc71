"""The command line, and the summary as text:

python -m pinads_rec.data.build --config X.yaml --raw RAW_DIR --out DIR [--engine duckdb|spark]
    [--memory-limit 2GB] [--threads N] [--day YYYY-MM-DD[:YYYY-MM-DD] [--vocabularies BUILD_DIR]]
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from pinads_rec import arguments
from pinads_rec.config import ConfigError, add_overrides_flag, load
from pinads_rec.data.build.days import DAYS, build_days, parse_days
from pinads_rec.data.build.engines import ENGINES
from pinads_rec.data.build.full_build import build
from pinads_rec.data.loader.contract import ContractError


def format_summary(summary: dict) -> str:
    lines = [f"built in {summary['seconds']} s on {summary['threads']} thread(s)"]
    for split, s in summary["splits"].items():
        lines.append(f"{split}: {s['requests']} requests, {s['rows']} rows, {s['files']} file(s)")
        for surface, v in (s.get("surfaces") or {}).items():
            rates = "  ".join(f"{t} {r:.4f}" for t, r in v["label_rate"].items())
            lines.append(f"  {surface:<14} {v['rows']:>10} rows  {rates}")
        for g, q in (s.get("sequence_lengths") or {}).items():
            lines.append(
                f"  sequence {g:<10} mean {q['mean']:.1f}  p50 {q['p50']}  p90 {q['p90']}  p99 {q['p99']}  "
                f"max {q['max']}  empty {q['empty']}"
            )
    for what, n in summary["repairs"].items():
        if n:
            lines.append(f"{what}: {n}")
    for name, n in summary["join_misses"].items():
        lines.append(f"side table {name}: {n} impression(s) without a row (defaults used)")
    # The config's own ELSE values: no repair, but a raw value no WHEN foresaw shows up here.
    chosen = [f"  {what}: {n}" for what, n in summary["case_else"].items() if n]
    if chosen:
        lines += ["rows no WHEN of the config's CASE matched (given its own ELSE; not repairs):"] + chosen
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    # The help's one line is the package's: what the command makes, not this module's job.
    about = sys.modules[__package__].__doc__.split("\n")[0]
    ap = argparse.ArgumentParser(prog="python -m pinads_rec.data.build", description=about)
    ap.add_argument("--config", required=True, help="experiment YAML with a build: section")
    ap.add_argument(
        "--raw", required=True, type=arguments.existing_dir, help="directory the build's file paths are relative to"
    )
    ap.add_argument(
        "--out",
        required=True,
        type=arguments.output_dir,
        help="output directory (<split>/, vocabularies/, summary.json, manifest.json), replaced whole once the "
        f"build is complete; with --day, each day's partition {DAYS}/<day>/ in it is",
    )
    ap.add_argument(
        "--day",
        default=None,
        metavar="DAY[:LAST]",
        help=f"build only the requests of this day (YYYY-MM-DD, in build.timezone), or of each day of a range "
        f"YYYY-MM-DD:YYYY-MM-DD (both ends included), each into its own partition OUT/{DAYS}/<day>/; build.splits is "
        f"ignored (docs/data_build.md, Builds by day)",
    )
    ap.add_argument(
        "--vocabularies",
        default=None,
        type=arguments.existing_dir,
        metavar="BUILD_DIR",
        help="with --day: the build (its --out) whose vocabularies map the ids, the same on every day; required "
        "when the config has build.vocabularies",
    )
    ap.add_argument(
        "--engine",
        choices=ENGINES,
        default="duckdb",
        help="the SQL engine: duckdb (one machine) or spark (PySpark: local[--threads] here, or the master "
        "spark-submit gives; docs/data_build.md, On Spark)",
    )
    ap.add_argument(
        "--memory-limit",
        default=None,
        help="memory cap, e.g. 2GB: DuckDB's (it spills to disk beyond it); on Spark local[N], the driver's memory",
    )
    ap.add_argument("--threads", type=arguments.positive_int, default=None, help="worker threads (default: every core)")
    add_overrides_flag(ap, "override a config field, e.g. --set build.timezone=UTC (repeatable)")
    args = ap.parse_args(argv)
    try:
        cfg = load(args.config, args.overrides)
        if args.day is None:
            if args.vocabularies is not None:
                raise ConfigError("--vocabularies: only with --day (a full build fits build.vocabularies itself)")
            print(format_summary(build(cfg, args.raw, args.out, args.memory_limit, args.threads, args.engine)))
            return 0
        days = parse_days(args.day)
        if cfg.build.splits:
            print(
                f"note: --day: build.splits ignored ({', '.join(s.name for s in cfg.build.splits)}): each day is its "
                f"own partition, {args.out}/{DAYS}/<day>/ (train on a day, evaluate on the next)",
                file=sys.stderr,
            )
        if args.vocabularies is not None and not cfg.build.vocabularies:
            print("note: --vocabularies: the config has no build.vocabularies; ignored", file=sys.stderr)
        summaries = build_days(
            cfg, args.raw, args.out, days, args.vocabularies, args.memory_limit, args.threads, args.engine
        )
    except (ConfigError, ContractError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for day, summary in summaries.items():
        print(f"{args.out}/{DAYS}/{day}/: " + format_summary(summary))
    return 0
