"""The command line, and the summary as text:

python -m pinads_rec.data.build --config X.yaml --raw RAW_DIR --out DIR [--memory-limit 2GB] [--threads N]
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from pinads_rec.config import ConfigError, add_overrides_flag, load
from pinads_rec.data.build.steps import build
from pinads_rec.data.contract import ContractError


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
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    # The help's one line is the package's: what the command makes, not this module's job.
    about = sys.modules[__package__].__doc__.split("\n")[0]
    ap = argparse.ArgumentParser(prog="python -m pinads_rec.data.build", description=about)
    ap.add_argument("--config", required=True, help="experiment YAML with a build: section")
    ap.add_argument("--raw", required=True, help="directory the build's file paths are relative to")
    ap.add_argument(
        "--out",
        required=True,
        help="output directory (<split>/, vocabularies/, summary.json, manifest.json), replaced whole once the "
        "build is complete",
    )
    ap.add_argument("--memory-limit", default=None, help="DuckDB memory cap, e.g. 2GB (spills to disk beyond it)")
    ap.add_argument("--threads", type=int, default=None, help="worker threads (default: every core)")
    add_overrides_flag(ap, "override a config field, e.g. --set build.timezone=UTC (repeatable)")
    args = ap.parse_args(argv)
    try:
        cfg = load(args.config, args.overrides)
        summary = build(cfg, args.raw, args.out, args.memory_limit, args.threads)
    except (ConfigError, ContractError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    return 0
