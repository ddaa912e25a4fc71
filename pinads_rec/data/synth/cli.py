"""The command line, and the summary as text:

python -m pinads_rec.data.synth --config configs/demo.yaml --out data/demo [--raw] [--seed N]
python -m pinads_rec.data.synth --config configs/demo.yaml --out data/drift --set synth.drift.days=14
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from pinads_rec import arguments
from pinads_rec.config import ConfigError, load
from pinads_rec.data.synth.truth import STALE_DAYS, TASKS
from pinads_rec.data.synth.writing import generate


def format_summary(summary: dict) -> str:
    lines = [
        f"wrote {summary['rows']:,} rows / {summary['requests']:,} requests, "
        f"{summary['bytes'] / 2**20:.1f} MiB to {summary['out_dir']} in {summary['seconds']:.2f} s "
        f"({summary['rows_per_second']:,.0f} rows/s)"
    ]
    head = (
        f"{'split':<11} {'surface':<13} {'rows':>9} {'click':>7} {'good':>7} {'save':>7} | "
        f"{'AUC clk':>7} {'good':>6} {'save':>6} | {'NE clk':>6} {'good':>6} {'save':>6}"
    )
    lines += [head, "-" * len(head)]
    splits = summary["splits"] if "splits" in summary else summary["days"]
    for split, v in splits.items():
        for name, e in v["surfaces"].items():
            rates = " ".join(f"{e[t]['rate']:7.4f}" for t in TASKS)
            aucs = " ".join(f"{e[t]['oracle_auc']:{7 if i == 0 else 6}.3f}" for i, t in enumerate(TASKS))
            nes = " ".join(f"{e[t]['oracle_ne']:6.3f}" for t in TASKS)
            lines.append(f"{split:<11} {name:<13} {e['rows']:>9,} {rates} | {aucs} | {nes}")
    for split, v in splits.items():
        if "dormant" not in v:
            continue
        d, q = v["dormant"], v["pins_length"]
        lifts = ", ".join(
            f"{name} {e['oracle_auc']:.3f} -> {e['oracle_auc_without_dormant']:.3f} ({e['dormant_lift']:+.3f})"
            for name, e in d["surfaces"].items()
        )
        newest = ", ".join(f"{w}: {x:.4f}" for w, x in d["burst_in_newest"].items())
        lines.append(
            f"{split}: click oracle AUC with -> without the dormant term: {lifts}; pins length median "
            f"{q['median']:.0f} p90 {q['p90']:.0f} max {q['max']} mean {q['mean']:.0f}; "
            f"burst in the newest W events ({d['dormant_request_share']:.1%} of requests have one): {newest}"
        )
    if "drift" in summary:
        lines += _drift_lines(summary)
    for split, v in splits.items():
        sizes = ", ".join(
            f"{Path(f['path']).name} {f['bytes'] / 2**20:.1f} MiB ({f['row_groups']} rg)" for f in v["files"]
        )
        lines.append(f"{split}: {sizes}")
    return "\n".join(lines)


def _drift_lines(summary: dict) -> list:
    """A drifting world's days: impressions, ads, trend, the oracle's click AUC and that of the truth
    of j days before (j = 1 .. STALE_DAYS); then the mean drop per j (the drift check)."""
    js = range(1, STALE_DAYS + 1)
    head = f"{'day':<11} {'impressions':>11} {'new ads':>7} {'live ads':>8} {'trend':>5} {'oracle':>6} | " + " ".join(
        f"{f'j={j}':>5}" for j in js
    )
    lines = ["", "click AUC of the truth of day - j on the day's impressions (the drift check)", head, "-" * len(head)]
    for name, v in summary["days"].items():
        stale = " ".join(
            f"{v['stale_truth_auc'][str(j)]:5.3f}" if str(j) in v["stale_truth_auc"] else f"{'':5}" for j in js
        )
        lines.append(
            f"{name:<11} {v['impressions']:>11,} {v['new_ad_share']:7.1%} {v['live_ads']:>8,} {v['trend_topic']:>5} "
            f"{v['oracle_auc']['click']:6.3f} | {stale}"
        )
    drops = summary["drift"]["stale_truth"]
    lines.append(
        f"{'mean drop':<11} {'':>11} {'':>7} {'':>8} {'':>5} {'':>6} | "
        + " ".join(f"{drops[str(j)]['drop']:5.3f}" if str(j) in drops else f"{'':5}" for j in js)
    )
    lines.append(f"item ids: {summary['num_item_ids']:,} (a config's item table needs as many rows, or hash: true)")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    # The help's one line is the package's: what the command makes, not this module's job.
    about = sys.modules[__package__].__doc__.split("\n")[0]
    ap = argparse.ArgumentParser(prog="python -m pinads_rec.data.synth", description=about)
    ap.add_argument("--config", required=True)
    ap.add_argument(
        "--out",
        required=True,
        type=arguments.output_dir,
        help="output directory (train/, eval/, summary.json; with synth.drift days/<date>/)",
    )
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--train-requests", type=arguments.positive_int)
    ap.add_argument("--eval-requests", type=arguments.positive_int)
    ap.add_argument(
        "--raw", action="store_true", help="also write the raw logs under OUT/raw/ (docs/synthetic_data.md)"
    )
    args = ap.parse_args(argv)
    overrides = list(args.set)
    for flag, key in (("seed", "seed"), ("train_requests", "train_requests"), ("eval_requests", "eval_requests")):
        if getattr(args, flag) is not None:
            overrides.append(f"synth.{key}={getattr(args, flag)}")
    try:
        cfg = load(args.config, overrides)
        summary = generate(cfg, args.out, raw=args.raw)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    return 0
