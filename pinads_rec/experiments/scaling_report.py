"""The scaling sweep's outputs other than plots: ``scaling.csv`` / ``projection.csv`` (write and read
back), the tables printed at the end, and the rank ratios (examples/s of N ranks against the fewest
at the same point)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Dict, List, Optional

from pinads_rec.experiments.scaling_sweep import DIMENSIONS


def write_csv(path: Path, rows: List[dict], columns: List[str]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for row in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})


def format_table(rows: List[dict]) -> str:
    head = (
        f"{'ranks':>5} {'batch':>6} {'seq':>4} {'rows':>8} | {'ex/s':>8} {'ex/s/rk':>8} {'step':>7} | "
        f"{'data':>6} {'d p50':>6} {'fwd':>6} {'bwd':>6} {'opt':>6} | "
        f"{'a2a f':>6} {'a2a b':>6} {'ddp':>5} | {'peak MiB':>8} {'other':>5}"
    )
    lines = [
        "ms per step, mean over the measured steps and ranks (d p50: median data wait; a2a f/b: "
        "collectives in forward/backward; ddp: dense all_reduce wall, overlapped; other: cores used by "
        "other processes during the run)",
        head,
        "-" * len(head),
    ]
    for r in rows:
        lines.append(
            f"{r['ranks']:>5} {r['batch_size']:>6} {r['sequence_length']:>4} {str(r['table_rows'] or 'cfg'):>8} | "
            f"{r['examples_per_s']:>8,.0f} {r['examples_per_s_per_rank']:>8,.0f} {r['step_ms']:>7.1f} | "
            f"{r['data_ms']:>6.1f} {r['data_p50_ms']:>6.1f} {r['forward_ms']:>6.1f} {r['backward_ms']:>6.1f} "
            f"{r['optimizer_ms']:>6.1f} | "
            f"{r['comms_fwd_ms']:>6.1f} {r['comms_bwd_ms']:>6.1f} {r['ddp_allreduce_ms']:>5.1f} | "
            f"{r['peak_rss_mib']:>8,.0f} {r['other_load_cores']:>5.2f}"
        )
    return "\n".join(lines)


def format_projection(rows: List[dict]) -> str:
    head = (
        f"{'GPUs':>5} {'rows':>8} | {'critical ms':>11} {'fwd cmp':>8} {'fwd com':>8} {'bwd cmp':>8} "
        f"{'bwd com':>8} | {'emb ex/s':>12} | sharding"
    )
    lines = ["planner projection (TorchRec cost model, per step at the per-GPU batch)", head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['gpus']:>5} {str(r['table_rows'] or 'cfg'):>8} | {r['critical_path_ms']:>11.3f} "
            f"{r['fwd_compute_ms']:>8.3f} {r['fwd_comms_ms']:>8.3f} {r['bwd_compute_ms']:>8.3f} "
            f"{r['bwd_comms_ms']:>8.3f} | {r['embedding_examples_per_s']:>12,.0f} | {r['sharding']}"
        )
    return "\n".join(lines)


def rank_ratios(rows: List[dict]) -> List[dict]:
    """Examples/s of every rank count against the fewest ranks, at each point where the other
    dimensions are equal: {"at": {...}, "ranks": n, "base_ranks": m, "ratio": x, "ideal": n / m}."""
    groups: Dict[tuple, List[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(str(r[d]) for d in DIMENSIONS if d != "ranks"), []).append(r)
    out = []
    for key, rs in groups.items():
        rs = sorted(rs, key=lambda r: r["ranks"])
        for r in rs[1:]:
            out.append(
                {
                    "at": dict(zip([d for d in DIMENSIONS if d != "ranks"], key)),
                    "ranks": r["ranks"],
                    "base_ranks": rs[0]["ranks"],
                    "ratio": r["examples_per_s"] / rs[0]["examples_per_s"],
                    "ideal": r["ranks"] / rs[0]["ranks"],
                }
            )
    return out


def ratio_line(rows: List[dict]) -> Optional[str]:
    """``2 vs 1 ranks: 1.73x examples/s (ideal 2x)`` for every point measured at several rank counts."""
    lines = []
    for q in rank_ratios(rows):
        at = ", ".join(f"{k}={v or 'cfg'}" for k, v in q["at"].items())
        lines.append(
            f"{q['ranks']} vs {q['base_ranks']} ranks: {q['ratio']:.2f}x examples/s (ideal {q['ideal']:.0f}x) at {at}"
        )
    return "\n".join(lines) or None


def report(
    best: List[dict],
    projection: List[dict],
    repeats: int,
    out: Path,
    pngs: List[Path],
    echo=print,
    replotted: bool = False,
) -> None:
    echo("")
    if repeats > 1:
        echo(f"best of {repeats} repeats per point (highest examples/s); every repeat is in scaling.csv")
    echo(format_table(best))
    ratio = ratio_line(best)
    if ratio:
        echo(ratio)
    if projection:
        echo("")
        echo(format_projection(projection))
    written = [] if replotted else [out / "scaling.csv"] + ([out / "projection.csv"] if projection else [])
    echo("\nwrote " + ", ".join(str(p) for p in written + list(pngs)))


def read_csv(path: Path) -> List[dict]:
    """Rows of a scaling.csv / projection.csv with their numbers as numbers."""
    ints = {"run", "plan", "sharding"}
    out = []
    with path.open() as f:
        for row in csv.DictReader(f):
            for k, v in row.items():
                if k in ints or v == "":
                    continue
                x = float(v)
                row[k] = int(x) if x.is_integer() and "." not in v and "e" not in v else x
            out.append(row)
    return out
